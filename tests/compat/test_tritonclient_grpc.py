"""Unmodified ``tritonclient.grpc`` (sync, callback, stream and ``grpc.aio``) against the real
server: every RPC of ``inference.GRPCInferenceService``, through the gRPC front on 8001."""

from __future__ import annotations

import asyncio
import json
import queue
import re

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from conftest import front_folder, front_stat, read_map
from model_factory import on_demand
from stream_answers import stream_answers
from waiting import wait_until


@pytest.fixture(scope="module")
def client(server):
    c = grpcclient.InferenceServerClient(server["grpc_url"])
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(server):
    """The generated stub itself, for messages tritonclient never builds (typed contents)."""
    channel = grpc.insecure_channel(server["grpc_url"])
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def add_sub_inputs(a: np.ndarray, b: np.ndarray, datatype: str = "INT32") -> list:
    inputs = [grpcclient.InferInput("INPUT0", list(a.shape), datatype),
              grpcclient.InferInput("INPUT1", list(b.shape), datatype)]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs


A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)


def error_of(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


# ---- server and model RPCs ---------------------------------------------------------------------

def test_server_live_ready_and_metadata(client):
    assert client.is_server_live()
    # The test repository holds broken models: live, not ready (strict readiness), as over HTTP.
    assert not client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta.name == "triton" and "statistics" in meta.extensions


def test_model_ready(client):
    assert client.is_model_ready("simple")
    assert client.is_model_ready("versioned", "1") and client.is_model_ready("versioned", "2")
    assert not client.is_model_ready("versioned", "7")
    assert not client.is_model_ready("broken_config")
    assert not client.is_model_ready("no_such_model")


def test_model_metadata_and_config(client):
    meta = client.get_model_metadata("simple", as_json=True)
    assert meta["name"] == "simple" and meta["versions"] == ["1"] and meta["platform"] == "onnxruntime_onnx"
    assert [(i["name"], i["datatype"], i["shape"]) for i in meta["inputs"]] == [
        ("INPUT0", "INT32", ["-1", "16"]), ("INPUT1", "INT32", ["-1", "16"])]
    config = client.get_model_config("simple").config
    assert config.max_batch_size == 8 and [o.name for o in config.output] == ["OUTPUT0", "OUTPUT1"]
    assert list(config.input[0].dims) == [16]
    assert client.get_model_metadata("versioned", "1").versions == ["1", "2"]


def test_infer_with_raw_contents(client):
    result = client.infer("simple", add_sub_inputs(A, B), request_id="req-7",
                          outputs=[grpcclient.InferRequestedOutput("OUTPUT1")])
    assert result.get_response().id == "req-7"
    assert result.get_response().model_name == "simple" and result.get_response().model_version == "1"
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)
    assert result.as_numpy("OUTPUT0") is None  # only the requested output comes back


def test_infer_with_typed_contents(stub):
    request = service_pb2.ModelInferRequest(model_name="simple", id="typed")
    for name, values in (("INPUT0", A), ("INPUT1", B)):
        tensor = request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        tensor.contents.int_contents.extend(values.reshape(-1).tolist())
    response = stub.ModelInfer(request)
    assert response.id == "typed" and [o.name for o in response.outputs] == ["OUTPUT0", "OUTPUT1"]
    out0 = np.frombuffer(response.raw_output_contents[0], dtype=np.int32).reshape(1, 16)
    np.testing.assert_array_equal(out0, A + B)


def test_infer_strings(client):
    a = np.array([[str(i) for i in range(16)]], dtype=object)
    b = np.array([["1"] * 16], dtype=object)
    result = client.infer("simple_string", add_sub_inputs(a, b, "BYTES"))
    assert [int(x) for x in result.as_numpy("OUTPUT0").reshape(-1)] == [i + 1 for i in range(16)]


def test_versions_are_routed(client):
    v1 = client.infer("versioned", add_sub_inputs(A, B), model_version="1").as_numpy("OUTPUT0")
    v2 = client.infer("versioned", add_sub_inputs(A, B), model_version="2").as_numpy("OUTPUT0")
    default = client.infer("versioned", add_sub_inputs(A, B)).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(v1, A + B)
    np.testing.assert_array_equal(v2, A * B)
    np.testing.assert_array_equal(default, v2)
    err = error_of(lambda: client.infer("versioned", add_sub_inputs(A, B), model_version="9"))
    assert err.status() == "StatusCode.NOT_FOUND"
    assert "Request for unknown model: 'versioned' version 9 is not found" in err.message()


def test_large_tensors_have_no_4mb_cap(client):
    # ONNX string tensors hold UTF-8 text: random letters, 12 MB each way.
    payload = np.random.default_rng(0).integers(97, 123, 6_000_000, dtype=np.uint8).tobytes()
    x = np.array([[payload, payload[::-1]]], dtype=object)
    inp = grpcclient.InferInput("INPUT0", list(x.shape), "BYTES")
    inp.set_data_from_numpy(x)
    out = client.infer("simple_identity", [inp]).as_numpy("OUTPUT0")
    assert out.shape == (1, 2) and out[0, 0] == payload and out[0, 1] == payload[::-1]


def test_callback_and_aio_clients(client, server):
    done: queue.Queue = queue.Queue()
    client.async_infer("simple", add_sub_inputs(A, B), callback=lambda result, error: done.put((result, error)))
    result, error = done.get(timeout=60)
    assert error is None
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)

    async def run() -> list[np.ndarray]:
        aio = grpcaio.InferenceServerClient(server["grpc_url"])
        try:
            assert await aio.is_server_live() and await aio.is_model_ready("simple")
            inputs = [grpcaio.InferInput("INPUT0", [1, 16], "INT32"), grpcaio.InferInput("INPUT1", [1, 16], "INT32")]
            inputs[0].set_data_from_numpy(A)
            inputs[1].set_data_from_numpy(B)
            results = await asyncio.gather(*(aio.infer("batched", inputs) for _ in range(8)))
            return [r.as_numpy("OUTPUT0") for r in results]
        finally:
            await aio.close()

    for out in asyncio.run(run()):
        np.testing.assert_array_equal(out, A + B)


def test_compressed_messages_are_served(client):
    # A compressed message hides the model name from the front: the /v2 replica forwards it.
    for algorithm in ("gzip", "deflate"):
        result = client.infer("simple", add_sub_inputs(A, B), compression_algorithm=algorithm)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)


def test_client_headers_are_accepted(client):
    result = client.infer("simple", add_sub_inputs(A, B), headers={"x-team": "search", "authorization": "t"})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)


# ---- errors carry Triton's codes and name what is wrong ----------------------------------------

@pytest.mark.parametrize("model, inputs, code, message", [
    ("no_such_model", lambda: add_sub_inputs(A, B), "NOT_FOUND", "Request for unknown model: 'no_such_model' is not found"),
    ("broken_config", lambda: add_sub_inputs(A, B), "NOT_FOUND", "'broken_config' has no available versions"),
    ("simple", lambda: add_sub_inputs(A.astype(np.float32), B.astype(np.float32), "FP32"), "INVALID_ARGUMENT",
     "inference input 'INPUT0' data-type is 'FP32', but model 'simple' expects 'INT32'"),
    ("simple", lambda: add_sub_inputs(A[:, :8], B[:, :8]), "INVALID_ARGUMENT",
     "unexpected shape for input 'INPUT0' for model 'simple'. Expected [-1,16], got [1,8]"),
    ("simple", lambda: add_sub_inputs(np.zeros((9, 16), np.int32), np.zeros((9, 16), np.int32)), "INVALID_ARGUMENT",
     "inference request batch-size must be <= 8 for 'simple'"),
    ("simple", lambda: add_sub_inputs(A, B)[:1], "INVALID_ARGUMENT", "missing required input(s) ['INPUT1']"),
], ids=["unknown-model", "broken-model", "dtype", "shape", "batch", "missing-input"])
def test_errors(client, model, inputs, code, message):
    err = error_of(lambda: client.infer(model, inputs()))
    assert err.status() == f"StatusCode.{code}"
    assert message in err.message()


@pytest.mark.parametrize(("method", "message"), [
    ("ModelInfer", b"\xff\xff\xff\xff\x0f\x01\x02"),  # no model name the front can read: through Serve
    ("ModelInfer", b"\x0a\x06simple" + b"\xff\xff\xff\xff\x0f"),  # routed to simple's replica
    ("ModelConfig", b"\x0a\x06simple\x12"),  # routed, truncated
    ("RepositoryIndex", b"\x0a\xff\xff\xff\xff\x0f"),  # a server RPC
], ids=["infer-unrouted", "infer-routed", "config-routed", "repository-index"])
def test_a_message_that_does_not_parse_gets_tritons_internal_error(server, method, message):
    """tritonserver 2.51 answers INTERNAL "Unable to parse request" (checked against the anchor)."""
    with grpc.insecure_channel(server["grpc_url"]) as channel:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")  # raw bytes both ways
        with pytest.raises(grpc.RpcError) as info:
            call(message, timeout=30)
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INTERNAL, "Unable to parse request")


def test_a_stream_message_that_does_not_parse_is_answered_in_the_stream(server):
    with grpc.insecure_channel(server["grpc_url"]) as channel:
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                       response_deserializer=service_pb2.ModelStreamInferResponse.FromString)
        responses = list(stream(iter([b"\xff\xff\xff\xff\x0f"]), timeout=30))
    assert [r.error_message for r in responses] == ["Unable to parse request"]

def test_malformed_tensor_data(stub):
    request = service_pb2.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        request.raw_input_contents.append(b"\0" * 60)
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input byte size mismatch for input 'INPUT0' for model 'simple'. Expected 64, got 60" in info.value.details()
    del request.raw_input_contents[1]
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request)
    assert "expected 2 raw_input_contents" in info.value.details()


# ---- streaming ---------------------------------------------------------------------------------

def test_stream_answers_in_order_and_survives_errors(client):
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        plan = ["simple", "no_such_model", "batched", "simple", "versioned"]
        for i, model in enumerate(plan):
            client.async_stream_infer(model, add_sub_inputs(A, B), request_id=f"s{i}")
        got = [responses.get(timeout=60) for _ in plan]
    finally:
        client.stop_stream()
    assert [r.get_response().id if r is not None else None for r, _ in got] == ["s0", None, "s2", "s3", "s4"]
    assert "Request for unknown model: 'no_such_model' is not found" in got[1][1].message()
    np.testing.assert_array_equal(got[4][0].as_numpy("OUTPUT0"), A * B)


# ---- statistics, index and model control -------------------------------------------------------

def test_statistics_count_exactly(client):
    def stats():
        return client.get_inference_statistics("nobatch", as_json=True)["model_stats"][0]

    before = stats()
    a = np.arange(16, dtype=np.int32)
    for _ in range(3):
        client.infer("nobatch", add_sub_inputs(a, a))
    after = stats()

    def count(doc, key):
        return int(doc["inference_stats"][key].get("count", 0))

    assert count(after, "success") - count(before, "success") == 3
    assert int(after.get("execution_count", 0)) - int(before.get("execution_count", 0)) == 3
    names = {(m["name"], m["version"]) for m in client.get_inference_statistics(as_json=True)["model_stats"]}
    assert ("versioned", "1") in names and ("simple", "1") in names
    assert error_of(lambda: client.get_inference_statistics("no_such_model")).status() == "StatusCode.NOT_FOUND"


def test_repository_index(client):
    rows = {(m.name, m.version): m for m in client.get_model_repository_index().models}
    assert rows[("simple", "1")].state == "READY"
    assert rows[("broken_config", "")].state == "UNAVAILABLE" and "config.pbtxt" in rows[("broken_config", "")].reason
    ready = {(m.name, m.version) for m in client.get_model_repository_index().models if m.state == "READY"}
    assert {(m["name"], m.get("version", "")) for m in
            client.get_model_repository_index(as_json=True)["models"] if m["state"] == "READY"} == ready


def test_load_override_and_unload(client):
    model = on_demand("grpc_override")
    assert not client.is_model_ready(model)
    try:
        client.load_model(model)
        assert client.is_model_ready(model)
        np.testing.assert_array_equal(client.infer(model, add_sub_inputs(A, B)).as_numpy("OUTPUT0"), A + B)
        config = client.get_model_config(model, as_json=True)["config"]
        config["max_batch_size"] = 2
        client.load_model(model, config=json.dumps(config))
        assert client.get_model_config(model).config.max_batch_size == 2
        err = error_of(lambda: client.infer(model, add_sub_inputs(np.zeros((3, 16), np.int32),
                                                                  np.zeros((3, 16), np.int32))))
        assert "batch-size must be <= 2" in err.message()
    finally:
        client.unload_model(model)
    wait_until(lambda: not client.is_model_ready(model), f"'{model}' to be no longer ready", timeout_s=60)
    err = error_of(lambda: client.load_model("no_such_model"))
    assert err.status() == "StatusCode.INTERNAL"
    assert "failed to load 'no_such_model', failed to poll from model repository" in err.message()


def test_load_with_files_a_partial_override_and_bad_paths(client, model_repository):
    name = on_demand("grpc_files")
    model = (model_repository / name / "1" / "model.onnx").read_bytes()
    try:
        # Triton's own model-control example sends only max_batch_size; the rest is auto-completed.
        client.load_model(name, config='{"max_batch_size":"16"}')
        assert client.get_model_config(name).config.max_batch_size == 16
        client.load_model(name, config=json.dumps({"backend": "onnxruntime", "max_batch_size": 3}),
                          files={"file:1/model.onnx": model})
        assert client.get_model_config(name).config.max_batch_size == 3
        np.testing.assert_array_equal(client.infer(name, add_sub_inputs(A, B)).as_numpy("OUTPUT1"), A - B)
    finally:
        client.unload_model(name)
    assert not client.is_model_ready(name)
    err = error_of(lambda: client.load_model(name, config="{}", files={"file:" + "A" * 256: b"a"}))
    assert err.status() == "StatusCode.INVALID_ARGUMENT" and "Invalid file path" in err.message()
    assert client.is_server_live()


def test_the_front_routes_served_versions_to_their_replicas(client, server):
    """The front's maps (what HAProxy routes by, without any Python process) list each served
    version's replica listeners, and a listener answers a relayed call itself."""
    import socket

    front = front_folder(server)

    def routes() -> dict[str, str] | None:
        counts = read_map(front / "replicas.map")
        return counts if "versioned/1" in counts else None

    counts = wait_until(routes, "the front's routes to list 'versioned/1'", timeout_s=10)
    listeners = read_map(front / "listeners.map")
    assert counts["simple/"] == counts["simple/1"] == counts["versioned/1"] == "1"
    assert listeners["simple//0"] == listeners["simple/1/0"]
    assert listeners["versioned//0"] == listeners["versioned/2/0"] != listeners["versioned/1/0"]
    # The listener speaks gRPC over HTTP/1.1, as HAProxy relays it (with the front key, which
    # HAProxy's configuration holds): the version-1 replica of "versioned" answers its own
    # ModelReady, and a status trailer for a version it does not serve; without the key, 403.
    host, listener_port = listeners["versioned/1/0"].split("|")
    key = re.search(r"set-header rayinfer-front-key (\S+)", (front / "haproxy.cfg").read_text()).group(1)
    for version, trailer, key_field in (("1", b"grpc-status: 0", b"rayinfer-front-key: %b\r\n" % key.encode()),
                                        ("2", b"grpc-status: 5", b"rayinfer-front-key: %b\r\n" % key.encode()),
                                        ("1", b"", b"")):
        message = service_pb2.ModelReadyRequest(name="versioned", version=version).SerializeToString()
        frame = b"\x00" + len(message).to_bytes(4, "big") + message
        with socket.create_connection((host, int(listener_port)), 5) as sock:
            sock.sendall(b"POST /inference.GRPCInferenceService/ModelReady HTTP/1.1\r\nhost: x\r\n%b"
                         b"content-type: application/grpc\r\ncontent-length: %d\r\n\r\n%b"
                         % (key_field, len(frame), frame))
            reply = b""
            while not reply.endswith(b"\r\n\r\n") or trailer not in reply:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                reply += chunk
        if key_field:
            assert reply.startswith(b"HTTP/1.1 200 OK") and trailer in reply, reply
        else:
            assert reply.startswith(b"HTTP/1.1 403"), reply
    assert not [key for key in counts if key.startswith(("broken_config/", "no_such_model/"))]


def test_streams_and_server_calls_go_to_the_v2_replica_without_serves_ingress(client, server):
    """The /v2 application's gRPC calls (a stream, ServerMetadata) reach the /v2 replica's own
    gRPC server from the front, not through Serve's ingress HAProxy (replaced on every load)."""
    front = front_folder(server)
    wait_until(lambda: front_stat(front, "serve_grpc")["v2"]["status"] == "UP",
               "the front's way to the /v2 replica's gRPC server to be up", timeout_s=10)
    before = front_stat(front, "serve_grpc")
    received: queue.Queue = queue.Queue()
    stream = grpcclient.InferenceServerClient(server["grpc_url"])
    stream.start_stream(callback=lambda result, error: received.put((result, error)))
    try:
        stream.async_stream_infer("simple", add_sub_inputs(np.ones((1, 16), np.int32), np.ones((1, 16), np.int32)))
        ((result, error),) = stream_answers(received, 1, server)
        assert error is None and result.as_numpy("OUTPUT0").tolist() == [[2] * 16]
    finally:
        stream.stop_stream()
        stream.close()
    assert client.get_server_metadata().name == "triton"
    after = front_stat(front, "serve_grpc")
    assert int(after["v2"]["stot"]) >= int(before["v2"]["stot"]) + 2
    assert after["serve"]["stot"] == before["serve"]["stot"]
