"""Triton's example model repository in explicit mode, on a server of its own: readiness counts
only the models rayinfer was asked to load, and Triton's model-control examples
(simple_http_model_control.py, simple_grpc_model_control.py), in this test's own words, pass;
the example's text pipeline (an ensemble asked for with --load-model, its members loading with
it) answers as its members do.

The repository is the project's example repository (ONNX versions of Triton's simple,
simple_string and simple_identity) plus Triton's other example folders as a fresh checkout has
them: densenet_onnx and inception_graphdef without version folders (their weights come from
Triton's fetch script), and simple_sequence with sequence batching.
"""

from __future__ import annotations

import json
import queue
import re
import shutil
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import HTTP_PORT, LOAD_TIMEOUT_S, ReadinessWatch, port_flags, start_server, stop_server, stop_shared_server, tensor
from otlp_receiver import OtlpReceiver
from rayinfer.cluster.example_repository import write_example_repository
from waiting import wait_until

pytestmark = pytest.mark.own_cluster

PORT = HTTP_PORT + 500
STARTUP_MODELS = ["simple", "nlp_ensemble"]
REPOSITORY_KEY = {"repo-key": "r3po"}  # --http-restricted-api model-repository
FETCHED_LATER = {
    "densenet_onnx": """name: "densenet_onnx"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "data_0" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 3, 224, 224 ] reshape { shape: [ 1, 3, 224, 224 ] } } ]
output [ { name: "fc6_1" data_type: TYPE_FP32 dims: [ 1000 ] reshape { shape: [ 1, 1000, 1, 1 ] } label_filename: "densenet_labels.txt" } ]
""",
    "inception_graphdef": """name: "inception_graphdef"
platform: "tensorflow_graphdef"
max_batch_size: 128
input [ { name: "input" data_type: TYPE_FP32 format: FORMAT_NHWC dims: [ 299, 299, 3 ] } ]
output [ { name: "InceptionV3/Predictions/Softmax" data_type: TYPE_FP32 dims: [ 1001 ] label_filename: "inception_labels.txt" } ]
""",
}
SEQUENCE = """name: "simple_sequence"
platform: "tensorflow_graphdef"
max_batch_size: 8
sequence_batching {
  max_sequence_idle_microseconds: 5000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY fp32_false_true: [ 0, 1 ] } ] }
  ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


@pytest.fixture(scope="module")
def otlp():
    """The OTLP receiver the server exports its traces to (--trace-config mode=opentelemetry)."""
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def example_server(tmp_path_factory, otlp):
    stop_shared_server()  # one Ray cluster at a time on a small machine
    repo = tmp_path_factory.mktemp("triton_examples")
    write_example_repository(repo)
    for name, config in FETCHED_LATER.items():
        (repo / name).mkdir()
        (repo / name / "config.pbtxt").write_text(config)
    # Triton's own simple_sequence (a TensorFlow model) in place of the project's ONNX one.
    shutil.rmtree(repo / "simple_sequence")
    (repo / "simple_sequence" / "1").mkdir(parents=True)
    (repo / "simple_sequence" / "config.pbtxt").write_text(SEQUENCE)
    (repo / "simple_sequence" / "1" / "model.graphdef").write_bytes(b"\0")
    log = tmp_path_factory.mktemp("triton_examples_server") / "rayinfer.log"
    log_file = log.with_name("log-file.log")
    watch = ReadinessWatch(PORT, STARTUP_MODELS)
    watch.start()
    proc = start_server(repo, log, [
        "--model-control-mode", "explicit", *[arg for m in STARTUP_MODELS for arg in ("--load-model", m)],
        "--http-restricted-api", "statistics,logging:stats-key=s3cr3t",
        "--http-restricted-api", "model-repository:repo-key=r3po",
        "--grpc-restricted-protocol", "statistics:stats-key=s3cr3t",
        # Triton's OpenTelemetry mode (the rate traces none of the other tests' requests).
        "--trace-config", "mode=opentelemetry", "--trace-config", f"opentelemetry,url={otlp.url}",
        "--trace-config", "opentelemetry,resource=service.name=rayinfer-examples",
        "--trace-config", "opentelemetry,bsp_schedule_delay=200", "--trace-config", "level=TIMESTAMPS",
        "--trace-config", "rate=1000000",
        "--log-file", str(log_file),
        *port_flags(PORT),
    ])
    watch.stop(first_ready_within_s=30)  # (the server says it started as it gets ready)
    try:
        yield log, watch.models_ready, log_file
    finally:
        stop_server(proc)


def test_ready_only_once_the_models_named_at_start_are(example_server):
    """Polled from before the server started: /v2/health/ready first answered 200 when every model
    named with --load-model answered ready too (not while they were still being deployed)."""
    ready = example_server[1]
    assert ready is not None, "/v2/health/ready never answered 200 within 30 s of the server saying it started"
    assert [model for model, ok in ready.items() if not ok] == []


def test_restricted_groups_need_their_header_over_both_protocols(example_server):
    """--http-restricted-api / --grpc-restricted-protocol reach the front from the command line:
    statistics (and, over HTTP, logging) answer only with the header; the rest stays open."""
    http = httpclient.InferenceServerClient(f"127.0.0.1:{PORT}")
    with pytest.raises(InferenceServerException) as error:
        http.get_inference_statistics("simple")
    assert error.value.status() == "403"
    assert "This API is restricted, expecting header 'stats-key'" in error.value.message()
    with pytest.raises(InferenceServerException, match="expecting header 'stats-key'"):
        http.get_log_settings()
    stats = http.get_inference_statistics("simple", headers={"stats-key": "s3cr3t"})
    assert stats["model_stats"][0]["name"] == "simple"
    assert http.is_model_ready("simple")  # health is not restricted
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{PORT + 1}")
    with pytest.raises(InferenceServerException) as error:
        grpc.get_inference_statistics("simple")
    assert error.value.status() == "StatusCode.UNAVAILABLE"
    assert error.value.message() == "This protocol is restricted, expecting header 'triton-grpc-protocol-stats-key'"
    stats = grpc.get_inference_statistics("simple", headers={"triton-grpc-protocol-stats-key": "s3cr3t"})
    assert stats.model_stats[0].name == "simple"
    assert grpc.get_log_settings()  # logging is restricted over HTTP only
    http.close()
    grpc.close()


def test_serves_own_ingress_ports_check_the_restricted_groups_too(example_server):
    """A client that reaches Ray Serve's own HTTP and gRPC ingress (--serve-http-port,
    --serve-grpc-port), not the front, gets the same refusals: the model's replica (Serve routes
    a model's HTTP routes to its application) and the /v2 replica check them again."""
    for path in ("/v2/models/simple/stats", "/v2/logging"):
        request = urllib.request.Request(f"http://127.0.0.1:{PORT + 10}{path}")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 403, path
        assert json.loads(refused.value.read()) == {"error": "This API is restricted, expecting header 'stats-key'"}
        request.add_header("stats-key", "s3cr3t")
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200, path
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT + 10}/v2/models/simple/ready", timeout=30) as response:
        assert response.status == 200  # health is not restricted
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{PORT + 11}")
    to_server = {"application": "rayinfer"}  # Serve's gRPC ingress routes by this metadata
    with pytest.raises(InferenceServerException) as error:
        grpc.get_inference_statistics("simple", headers=to_server)
    assert error.value.status() == "StatusCode.UNAVAILABLE"
    assert error.value.message() == "This protocol is restricted, expecting header 'triton-grpc-protocol-stats-key'"
    stats = grpc.get_inference_statistics(
        "simple", headers={**to_server, "triton-grpc-protocol-stats-key": "s3cr3t"})
    assert stats.model_stats[0].name == "simple"
    assert grpc.is_server_live(headers=to_server)
    grpc.close()


def test_the_openai_apis_routes_are_in_their_restricted_groups(example_server):
    """/v1/models belongs to the model-repository group (as in Triton's OpenAI frontend): without
    its header, 401 and OpenAI's error, from the front and from Serve's own ingress port alike;
    the inference routes are not restricted here."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="not-checked", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as error:
        client.models.list()
    assert error.value.body["message"] == "This API is restricted, expecting header 'repo-key' with valid value"
    assert {"simple", "nlp_ensemble"} <= {m.id for m in client.models.list(extra_headers=REPOSITORY_KEY)}
    with pytest.raises(openai.BadRequestError, match="model 'simple' is not a language model"):
        client.chat.completions.create(model="simple", messages=[{"role": "user", "content": "hi"}])
    client.close()
    request = urllib.request.Request(f"http://127.0.0.1:{PORT + 10}/v1/models")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 401
    assert json.loads(refused.value.read())["error"]["code"] == "invalid_auth"


def test_ready_with_models_it_was_not_asked_to_load(example_server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{PORT}")
    assert client.is_server_ready()
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v2/health/ready", timeout=30) as response:
        assert response.status == 200  # what a readiness probe (curl) sees
    index = {row["name"]: row for row in client.get_model_repository_index(headers=REPOSITORY_KEY)}
    assert index["simple"]["state"] == "READY"
    for name in ("densenet_onnx", "inception_graphdef", "simple_sequence"):
        assert index[name]["state"] == "UNAVAILABLE" and index[name]["reason"]
    assert index["simple_string"]["reason"] == "unloaded"


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_tritons_model_control_example(example_server, module):
    if module is grpcclient:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{PORT + 1}")
        key = None  # restricted over HTTP only
    else:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{PORT}", network_timeout=LOAD_TIMEOUT_S)
        key = REPOSITORY_KEY
    assert client.is_server_live() and client.is_server_ready()
    client.load_model("simple", headers=key)
    assert client.is_model_ready("simple")
    client.unload_model("simple", headers=key)
    assert not client.is_model_ready("simple")
    assert client.is_server_ready()  # no model it was asked to serve is failing
    with pytest.raises(InferenceServerException) as error:
        client.load_model("wrong_model_name", headers=key)
    assert "failed to load" in error.value.message()
    client.load_model("simple", headers=key)  # as it was, for the next protocol
    assert client.is_model_ready("simple")


def test_a_model_asked_for_that_cannot_load_makes_the_server_unready(example_server):
    client = httpclient.InferenceServerClient(f"127.0.0.1:{PORT}")
    # (a TensorFlow GraphDef whose file is not one: the error names the file)
    with pytest.raises(InferenceServerException,
                       match="failed to load .simple_sequence.: failed to load GraphDef .*simple_sequence/1/model.graphdef"):
        client.load_model("simple_sequence", headers=REPOSITORY_KEY)
    assert not client.is_server_ready()
    client.unload_model("simple_sequence", headers=REPOSITORY_KEY)
    assert client.is_server_ready()


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_the_text_pipeline_matches_its_members_called_one_by_one(example_server, module):
    """nlp_ensemble (a Python tokenizer, an ONNX encoder, a Python head), loaded at start with
    its members by --load-model nlp_ensemble: text in, a label and a confidence out, the same as
    calling the three models in turn."""
    from rayinfer.cluster.example_nlp import LABELS

    client = module.InferenceServerClient(f"127.0.0.1:{PORT + (1 if module is grpcclient else 0)}")
    assert all(client.is_model_ready(m) for m in ("nlp_tokenizer", "nlp_encoder", "nlp_head", "nlp_ensemble"))
    text = np.array([["I love this great movie".encode()], ["this was terrible and I hate it".encode()]], dtype=object)
    result = client.infer("nlp_ensemble", [tensor(module, "raw_text", text, "BYTES")])
    labels, confidence = result.as_numpy("sentiment_label"), result.as_numpy("confidence")
    assert labels.shape == (2, 1) and confidence.shape == (2, 1)
    assert {label.decode() for label in labels.reshape(-1)} <= set(LABELS)
    assert ((confidence > 0) & (confidence <= 1)).all()
    tokens = client.infer("nlp_tokenizer", [tensor(module, "raw_text", text, "BYTES")])
    embedding = client.infer("nlp_encoder", [tensor(module, name, tokens.as_numpy(name), "INT64")
                                             for name in ("input_ids", "attention_mask")]).as_numpy("embedding")
    head = client.infer("nlp_head", [tensor(module, "embedding", embedding, "FP32")])
    np.testing.assert_array_equal(head.as_numpy("sentiment_label"), labels)
    np.testing.assert_allclose(head.as_numpy("confidence"), confidence, rtol=1e-5)


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_a_clients_trace_context_is_traced_and_exported_over_otlp(example_server, otlp, module):
    """Triton's opentelemetry mode with the client's W3C traceparent (a header over HTTP,
    metadata over gRPC): traced though the rate would not, exported by the replicas to the OTLP
    receiver in the client's trace. simple: InferRequest > simple > compute; the text
    pipeline: InferRequest > nlp_ensemble > each member > its compute, as Triton nests them."""
    trace_id = "0af7651916cd43dd8448eb211c12666c" if module is httpclient else "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {"traceparent": f"00-{trace_id}-b7ad6b7169242424-01"}
    client = module.InferenceServerClient(f"127.0.0.1:{PORT + (1 if module is grpcclient else 0)}")
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    client.infer("simple", [tensor(module, "INPUT0", a, "INT32"), tensor(module, "INPUT1", a, "INT32")],
                 headers=headers)
    text = np.array([["I love this great movie".encode()]], dtype=object)
    client.infer("nlp_ensemble", [tensor(module, "raw_text", text, "BYTES")], headers=headers)

    def spans() -> list[dict]:
        return [span for span in otlp.taken() if span["trace_id"] == trace_id]

    wait_until(lambda: len(spans()) >= 11, "the eleven spans of two traced requests", timeout_s=30, interval_s=0.3)
    taken = spans()
    by_id = {span["span_id"]: span for span in taken}
    children: dict[str, list[str]] = {}
    for span in taken:
        parent = by_id.get(span["parent"])
        if parent is not None:
            children.setdefault(parent["name"], []).append(span["name"])
    assert {name: sorted(names) for name, names in children.items()} == {
        "InferRequest": ["nlp_ensemble", "simple"], "simple": ["compute"],
        "nlp_ensemble": ["nlp_encoder", "nlp_head", "nlp_tokenizer"],
        "nlp_tokenizer": ["compute"], "nlp_encoder": ["compute"], "nlp_head": ["compute"]}
    roots = [span for span in taken if span["name"] == "InferRequest"]
    assert len(roots) == 2 and {root["parent"] for root in roots} == {"b7ad6b7169242424"}
    prefix = "GRPC" if module is grpcclient else "HTTP"
    simple_root = by_id[next(s["parent"] for s in taken if s["name"] == "simple")]
    assert simple_root["events"] == [f"{prefix}_RECV_START" if prefix == "HTTP" else "GRPC_WAITREAD_START",
                                     f"{prefix}_RECV_END" if prefix == "HTTP" else "GRPC_WAITREAD_END",
                                     "INFER_RESPONSE_COMPLETE", f"{prefix}_SEND_START", f"{prefix}_SEND_END"]
    assert all(span["resource"]["service.name"] == "rayinfer-examples" for span in taken)


def test_a_streams_trace_context_is_traced_too(example_server, otlp):
    """A gRPC stream opened with the client's traceparent: its request to simple is traced in the
    client's trace (InferRequest > simple > compute)."""
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{PORT + 1}")
    client.start_stream(callback=lambda result, error: answers.put(error or result),
                        headers={"traceparent": f"00-{trace_id}-b7ad6b7169242424-01"}, stream_timeout=60)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    client.async_stream_infer("simple", [tensor(grpcclient, "INPUT0", a, "INT32"), tensor(grpcclient, "INPUT1", a, "INT32")])
    answer = answers.get(timeout=60)
    client.stop_stream()
    assert not isinstance(answer, Exception), answer
    spans = wait_until(lambda: len(s := [x for x in otlp.taken() if x["trace_id"] == trace_id]) >= 3 and s,
                       "the stream request's three spans", timeout_s=30, interval_s=0.3)
    by_id = {span["span_id"]: span for span in spans}
    assert sorted((span["name"], by_id[span["parent"]]["name"] if span["parent"] in by_id else span["parent"])
                  for span in spans) == [("InferRequest", "b7ad6b7169242424"), ("compute", "simple"),
                                         ("simple", "InferRequest")]
    # When the /v2 replica, which reads the stream, began and ended reading the request.
    root = next(span for span in spans if span["name"] == "InferRequest")
    assert root["events"][:2] == ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END"], root["events"]


def test_the_log_file_holds_the_servers_and_the_model_replicas_lines(example_server):
    """--log-file (tritonserver's flag): the CLI's lines and every model replica's, in Triton's
    format, go to the file; the logging extension reports it (behind its restriction here)."""
    log_file = example_server[2]
    text = wait_until(lambda: "loaded model 'nlp_head'" in (t := log_file.read_text()) and t,
                      "the model replicas' lines in the log file", timeout_s=30, interval_s=0.3)
    line = r"^I\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ %s\.py:\d+\] %s"
    for source, message in (("loader", "loaded model 'simple' version 1"), ("loader", "loaded model 'nlp_tokenizer'"),
                            ("control", "model 'simple' is ready")):
        assert re.search(line % (source, re.escape(message)), text, re.M), message
    with httpclient.InferenceServerClient(f"127.0.0.1:{PORT}") as client:
        assert client.get_log_settings(headers={"stats-key": "s3cr3t"})["log_file"] == str(log_file)
