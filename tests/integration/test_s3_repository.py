"""A model repository on an S3-compatible server (moto's server mode, started by the tests):
``rayinfer serve --model-repository s3://host:port/bucket/path`` serves its models, a Python
model among them, over HTTP and gRPC, and in poll mode picks up objects added, changed and
removed. Explicit mode's loads are checked without Ray in tests/unit/serving."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import HTTP_PORT, add_sub_inputs, start_server, stop_server, stop_shared_server
from rayinfer.repository.object_store import MOUNT_DIRECTORY_VARIABLE
from s3_server import CREDENTIALS, client, upload_folder
from waiting import wait_until

pytestmark = pytest.mark.own_cluster

PORT = HTTP_PORT + 300
BUCKET = "rayinfer-models"


@pytest.fixture(scope="module")
def s3_server_run(model_repository, s3_endpoint, tmp_path_factory):
    """A bucket holding ``simple`` and ``simple_identity`` under ``repository/``, and a
    poll-mode server on it (its copy in a folder of the test's)."""
    stop_shared_server()  # one Ray cluster at a time on a small machine
    s3 = client(s3_endpoint)
    s3.create_bucket(Bucket=BUCKET)
    for model in ("simple", "simple_identity"):
        upload_folder(s3, BUCKET, f"repository/{model}", model_repository / model)
    copy = tmp_path_factory.mktemp("s3_copy")
    log = tmp_path_factory.mktemp("s3_server") / "rayinfer.log"
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {**CREDENTIALS, MOUNT_DIRECTORY_VARIABLE: str(copy)}.items():
            patch.setenv(key, value)  # the server and its replicas read them, as Triton does
        proc = start_server(f"s3://{s3_endpoint}/{BUCKET}/repository", log, [
            "--model-control-mode", "poll", "--repository-poll-secs", "1", "--http-port", str(PORT),
            "--grpc-port", str(PORT + 1), "--metrics-port", str(PORT + 2), "--serve-http-port", str(PORT + 10),
            "--serve-grpc-port", str(PORT + 11),
        ])
    try:
        yield s3, copy, httpclient.InferenceServerClient(f"127.0.0.1:{PORT}", network_timeout=120.0), \
            grpcclient.InferenceServerClient(f"127.0.0.1:{PORT + 1}")
    finally:
        stop_server(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]


def test_the_buckets_models_serve_over_http_and_grpc(s3_server_run):
    _, copy, http, grpc = s3_server_run
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    np.testing.assert_array_equal(http.infer("simple", add_sub_inputs(a, a)).as_numpy("OUTPUT0"), a * 2)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    for tensor in inputs:
        tensor.set_data_from_numpy(a)
    np.testing.assert_array_equal(grpc.infer("simple", inputs).as_numpy("OUTPUT1"), a * 0)
    text = np.array([[b"from", b"s3"]], dtype=object)
    identity = httpclient.InferInput("INPUT0", [1, 2], "BYTES")
    identity.set_data_from_numpy(text)
    assert http.infer("simple_identity", [identity]).as_numpy("OUTPUT0").tolist() == text.tolist()
    assert {m["name"] for m in http.get_model_repository_index()} == {"simple", "simple_identity"}
    assert (copy / "simple_identity" / "1" / "model.py").is_file()  # the node's copy


def test_poll_mode_follows_the_buckets_objects(s3_server_run, model_repository):
    s3, _, http, grpc = s3_server_run
    config = (model_repository / "simple" / "config.pbtxt").read_text()
    s3.put_object(Bucket=BUCKET, Key="repository/added/config.pbtxt", Body=config.replace('name: "simple"', 'name: "added"'))
    s3.put_object(Bucket=BUCKET, Key="repository/added/1/model.onnx",
                  Body=(model_repository / "simple" / "1" / "model.onnx").read_bytes())
    wait_until(lambda: http.is_model_ready("added") and grpc.is_model_ready("added"),
               "the poll to load 'added' from the bucket (ready over HTTP and gRPC)")
    assert http.get_model_config("added")["max_batch_size"] == 8

    s3.put_object(Bucket=BUCKET, Key="repository/added/config.pbtxt",
                  Body=config.replace('name: "simple"', 'name: "added"').replace("max_batch_size: 8", "max_batch_size: 4"))
    wait_until(lambda: http.get_model_config("added")["max_batch_size"] == 4,
               "the poll to reload 'added' after its config object changed")

    for key in ("repository/added/config.pbtxt", "repository/added/1/model.onnx"):
        s3.delete_object(Bucket=BUCKET, Key=key)
    wait_until(lambda: not http.is_model_ready("added") and not grpc.is_model_ready("added"),
               "the poll to unload 'added' after its objects were deleted")
    assert http.is_model_ready("simple")
