"""rayinfer on a Ray cluster started on its own (`ray start --head` with `rayinfer ray-env`'s
settings), the two ways README.md gives: `rayinfer serve --ray-address auto`, and `rayinfer
config` rendered into a Serve config for `serve deploy`. Each is checked as a user would: ready,
inference over HTTP and gRPC, `serve status` naming every model version's application, the
metrics port; and stopping leaves the cluster running.

The head runs Ray's autoscaler with its ``fake_multinode`` provider (worker nodes are Ray nodes
started on this machine): a model whose replicas do not fit the head gets a node added, and a
model asking for GPUs shows its pending demand.

A model repository on an S3-compatible server (moto's server mode, started by the tests):
``rayinfer serve --model-repository s3://host:port/bucket/path`` serves its models, a Python
model among them, over HTTP and gRPC, and in poll mode picks up objects added, changed and
removed. Explicit mode's loads are checked without Ray in tests/unit/serving."""

from __future__ import annotations

import json
import os
import secrets
import signal
import threading
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from onnx import TensorProto

from conftest import HTTP_PORT, SUITE_RAY_ENVIRONMENT, add_sub_inputs, start_server, stop_server, stop_shared_server
from rayinfer.cluster.example_repository import SIMPLE_CONFIG, add_sub_model, write_model
from rayinfer.cluster.settings import RAY_ENVIRONMENT
from rayinfer.repository.object_store import MOUNT_DIRECTORY_VARIABLE
from s3_server import CREDENTIALS, client, upload_folder
from waiting import wait_until

pytestmark = pytest.mark.own_cluster

PORT = HTTP_PORT + 400
PORT_ARGS = ["--http-port", str(PORT), "--grpc-port", str(PORT + 1), "--metrics-port", str(PORT + 2),
             "--serve-http-port", str(PORT + 10), "--serve-grpc-port", str(PORT + 11)]
BIN = Path(sys.executable).parent
# Every model version's Serve application: the default (highest) version as <model>.
APPS = ("rayinfer", "openai", "simple", "simple@v1")


# Ray's autoscaler with the fake_multinode provider: up to one CPU worker node, added on demand;
# no GPU node type, so a GPU demand stays pending.
FAKE_CLUSTER = {
    "cluster_name": "rayinfer-test", "max_workers": 1, "upscaling_speed": 1.0, "idle_timeout_minutes": 1,
    "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                 "disable_launch_config_check": True},
    "auth": {"ssh_user": "ubuntu"}, "docker": {},
    "available_node_types": {
        "ray.head.default": {"resources": {"CPU": 2}, "node_config": {}, "max_workers": 0},
        "cpu_worker": {"resources": {"CPU": 2}, "node_config": {}, "min_workers": 0, "max_workers": 1},
    },
    "head_node_type": "ray.head.default",
    **{key: [] for key in ("initialization_commands", "setup_commands", "head_setup_commands",
                           "worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands",
                           "cluster_synced_files", "rsync_exclude", "rsync_filter")},
    "file_mounts": {}, "file_mounts_sync_continuously": False,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """A one-node Ray cluster of its own, with token authentication (a token of its own, as a
    cluster whose nodes share one), and a repository holding two versions of ``simple``."""
    stop_shared_server()  # one Ray cluster at a time on a small machine
    repo = tmp_path_factory.mktemp("cluster_repo")
    write_model(repo, "simple", SIMPLE_CONFIG + "version_policy: { all { } }\n", add_sub_model(TensorProto.INT32))
    (repo / "simple" / "2").mkdir()
    (repo / "simple" / "2" / "model.onnx").write_bytes((repo / "simple" / "1" / "model.onnx").read_bytes())
    # The S3 credentials (and where to copy an s3:// repository) reach the replicas the way README
    # says: in the environment of `ray start`.
    env = {**os.environ, **RAY_ENVIRONMENT, **SUITE_RAY_ENVIRONMENT, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           **CREDENTIALS, MOUNT_DIRECTORY_VARIABLE: str(tmp_path_factory.mktemp("s3_copy"))}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)  # for `rayinfer serve`, started by conftest's helper
        autoscaling = tmp_path_factory.mktemp("autoscaler") / "cluster.json"
        autoscaling.write_text(json.dumps(FAKE_CLUSTER))
        subprocess.run([str(BIN / "ray"), "start", "--head", "--num-cpus", "2", "--disable-usage-stats",
                        "--dashboard-host", "127.0.0.1", f"--autoscaling-config={autoscaling}"],
                       env={**env, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"},
                       check=True, capture_output=True, timeout=120)
        try:
            yield repo, env
        finally:
            subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)  # nothing to drain


def serve_cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([str(BIN / "serve"), *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def served_apps(env: dict[str, str]) -> set[str]:
    """The applications `serve status` lists."""
    return set(yaml.safe_load(serve_cli(env, "status")).get("applications") or {})


def http_ready() -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v2/health/ready", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def check_serving(env: dict[str, str]) -> None:
    """Both versions answer over HTTP and gRPC; `serve status` names every application; the
    metrics port counts the inferences."""
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    http = httpclient.InferenceServerClient(f"127.0.0.1:{PORT}")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{PORT + 1}")
    for version in ("1", "2"):
        np.testing.assert_array_equal(
            http.infer("simple", add_sub_inputs(a, a), model_version=version).as_numpy("OUTPUT0"), 2 * a)
        inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(a)
        np.testing.assert_array_equal(grpc.infer("simple", inputs, model_version=version).as_numpy("OUTPUT1"), 0 * a)
    assert set(APPS) <= served_apps(env)
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT + 2}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'nv_inference_count{model="simple",version="2"} 2' in metrics
    grpc.close()


def test_rayinfer_serve_joins_the_cluster_and_leaves_it_running(cluster, tmp_path: Path):
    repo, env = cluster
    proc = start_server(repo, tmp_path / "rayinfer.log", ["--ray-address", "auto", *PORT_ARGS])
    try:
        wait_until(http_ready, "the server to be ready", timeout_s=120)
        check_serving(env)
    finally:
        stop_server(proc)
    assert proc.returncode == 0
    # Its own applications are deleted (Serve finishes deleting them after rayinfer exits), and
    # the cluster keeps running.
    wait_until(lambda: not served_apps(env) & set(APPS), "rayinfer's applications to be deleted", timeout_s=60)


def test_a_rendered_serve_config_deploys_with_serve_deploy(cluster, tmp_path: Path):
    repo, env = cluster
    # The front on the head node, as the KubeRay manifest has it (the only node here).
    rendered = subprocess.run([str(BIN / "rayinfer"), "config", "--model-repository", str(repo), *PORT_ARGS,
                               "--front-on-head"], env=env, capture_output=True, text=True, timeout=60,
                              check=True).stdout
    assert "front_on_head: true" in rendered
    (tmp_path / "serve.yaml").write_text(rendered)
    serve_cli(env, "deploy", str(tmp_path / "serve.yaml"))
    try:
        wait_until(http_ready, "the deployed server to be ready", timeout_s=240)
        check_serving(env)
    finally:
        serve_cli(env, "shutdown", "-y")


def ray_cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([str(BIN / "ray"), *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_autoscaler_adds_a_node_for_replicas_and_gpu_demand_is_reported(cluster, tmp_path: Path):
    repo, env = cluster
    wide = tmp_path / "repo"
    # Two replicas of 1.5 CPU each: the head (2 CPUs) holds one.
    write_model(wide, "wide", SIMPLE_CONFIG.replace('name: "simple"', 'name: "wide"')
                + "instance_group [ { count: 2 kind: KIND_CPU } ]\n", add_sub_model(TensorProto.INT32))
    write_model(wide, "on_gpu", SIMPLE_CONFIG.replace('name: "simple"', 'name: "on_gpu"')
                + "instance_group [ { count: 1 kind: KIND_GPU } ]\n", add_sub_model(TensorProto.INT32))
    proc = start_server(wide, tmp_path / "rayinfer.log", [
        "--ray-address", "auto", *PORT_ARGS, "--model-control-mode", "explicit", "--load-model", "wide",
        "--replica-num-cpus", "1.5", "--gpu-wait-secs", "12"])
    try:
        wait_until(http_ready, "the server to be ready (both replicas of 'wide' running)", timeout_s=120)
        replicas = json.loads(ray_cli(env, "list", "actors", "--format", "json", "--filter",
                                      "class_name=ServeReplica:wide:wide_v1", "--filter", "state=ALIVE"))
        assert len(replicas) == 2 and len({r["node_id"] for r in replicas}) == 2  # one on the added node
        http = httpclient.InferenceServerClient(f"127.0.0.1:{PORT}")
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        for _ in range(4):  # the front relays to replicas on both nodes
            np.testing.assert_array_equal(http.infer("wide", add_sub_inputs(a, a)).as_numpy("OUTPUT0"), 2 * a)

        failure: list[Exception] = []

        def load() -> None:
            try:
                httpclient.InferenceServerClient(f"127.0.0.1:{PORT}", network_timeout=120.0).load_model("on_gpu")
            except Exception as exc:  # the load's answer, checked below
                failure.append(exc)

        loading = threading.Thread(target=load)
        loading.start()
        waiting = wait_until(lambda: next((m for m in http.get_model_repository_index()
                                           if m["name"] == "on_gpu" and "waiting for GPU" in m.get("reason", "")), None),
                             "'on_gpu' to wait for GPU resources", timeout_s=30)
        assert waiting["state"] == "LOADING"
        def gpu_demand() -> str | None:
            demands = ray_cli(env, "status").split("Demands:")[-1]
            return demands if "'GPU': 1.0" in demands else None

        wait_until(gpu_demand, "`ray status` to show the pending GPU demand", timeout_s=30)
        loading.join()
        assert failure and "GPU" in str(failure[0])  # UNAVAILABLE after --gpu-wait-secs, naming the resource
        assert not http.is_model_ready("on_gpu") and http.is_model_ready("wide")
    finally:
        stop_server(proc)


def test_ctrl_c_while_a_model_waits_for_gpus_stops_the_start(cluster, tmp_path: Path):
    """SIGINT during the start (a model waiting for GPUs for up to 10 minutes) stops rayinfer at
    once and removes what it deployed, instead of waiting for the load to end."""
    _, env = cluster
    repo = tmp_path / "repo"
    write_model(repo, "on_gpu", SIMPLE_CONFIG.replace('name: "simple"', 'name: "on_gpu"')
                + "instance_group [ { count: 1 kind: KIND_GPU } ]\n", add_sub_model(TensorProto.INT32))
    log = tmp_path / "rayinfer.log"
    with log.open("w") as out:
        proc = subprocess.Popen([str(BIN / "rayinfer"), "serve", "--model-repository", str(repo), "--ray-address", "auto",
                                 *PORT_ARGS, "--gpu-wait-secs", "600"], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    try:
        wait_until(lambda: "waits for GPU resources" in log.read_text(), "'on_gpu' to wait for GPUs", timeout_s=120)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        stop_server(proc)
    assert proc.returncode == 130, log.read_text()[-2000:]
    assert "Interrupted while loading the models" in log.read_text()
    wait_until(lambda: not served_apps(env) & {"rayinfer", "on_gpu"}, "rayinfer's applications to be deleted",
               timeout_s=60)


BUCKET = "rayinfer-models"


@pytest.fixture(scope="module")
def s3_server_run(cluster, model_repository, s3_endpoint, tmp_path_factory):
    """A bucket holding ``simple`` and ``simple_identity`` under ``repository/``, and a
    poll-mode server on it, joining the cluster (whose `ray start` had the credentials)."""
    _, env = cluster
    s3 = client(s3_endpoint)
    s3.create_bucket(Bucket=BUCKET)
    for model in ("simple", "simple_identity"):
        upload_folder(s3, BUCKET, f"repository/{model}", model_repository / model)
    log = tmp_path_factory.mktemp("s3_server") / "rayinfer.log"
    proc = start_server(f"s3://{s3_endpoint}/{BUCKET}/repository", log, [
        "--ray-address", "auto", *PORT_ARGS, "--model-control-mode", "poll", "--repository-poll-secs", "1"])
    try:
        yield s3, Path(env[MOUNT_DIRECTORY_VARIABLE]), httpclient.InferenceServerClient(f"127.0.0.1:{PORT}", network_timeout=120.0), \
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
