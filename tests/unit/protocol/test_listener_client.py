"""The listener client against a real replica listener serving a real ONNX Runtime model (no Ray):
tensors both ways in binary, BYTES included, errors with their codes, kept connections."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto

from rayinfer.adapters.loader import load_runner
from rayinfer.cluster.example_repository import SIMPLE_CONFIG, SIMPLE_STRING_CONFIG, add_sub_model, write_model
from rayinfer.transport.replica_listener import ReplicaListener
from rayinfer.protocol.errors import Code, ServingError, UnavailableError
from rayinfer.protocol.listener_client import ListenerClient, front_key_header
from rayinfer.protocol.types import InferInput, InferRequest, RequestedOutput
from rayinfer.serving import model_http
from rayinfer.serving.model_core import ModelCore
from rayinfer.serving.routes import parse_model_route
from waiting import wait_until_async

KEY = "5e" * 32
# What a model replica calls other replicas' listeners with: the server's front key.
PEER = (front_key_header(KEY),)


@pytest.fixture(scope="module")
def cores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelCore]:
    root = tmp_path_factory.mktemp("repo")
    write_model(root, "simple", SIMPLE_CONFIG, add_sub_model(TensorProto.INT32))
    write_model(root, "simple_string", SIMPLE_STRING_CONFIG, add_sub_model(TensorProto.STRING))
    return {name: ModelCore(load_runner(Path(root), name, 1)[0], [1]) for name in ("simple", "simple_string")}


def serve(cores: dict[str, ModelCore]) -> ReplicaListener:
    async def http(method: str, path: str, headers: dict[bytes, bytes], body: bytes):
        route = parse_model_route(path, encoded=True)
        return await model_http.respond(cores[route.model], method, route, headers, body)

    async def grpc(method: str, payload: bytes) -> bytes:
        raise AssertionError("no gRPC here")

    return ReplicaListener(grpc, http, front_key=KEY)


def test_tensors_travel_binary_both_ways_over_one_kept_connection(cores):
    async def run() -> None:
        listener = serve(cores)
        address = ("127.0.0.1", await listener.start("127.0.0.1"))
        client = ListenerClient(PEER)
        a = np.arange(32, dtype=np.int32).reshape(2, 16)
        b = np.full((2, 16), 5, dtype=np.int32)
        for _ in range(3):
            response = await client.infer(address, InferRequest(
                "simple", inputs=[InferInput("INPUT0", "INT32", (2, 16), a), InferInput("INPUT1", "INT32", (2, 16), b)],
                outputs=[RequestedOutput("OUTPUT1")], id="r1"))
            assert [o.name for o in response.outputs] == ["OUTPUT1"] and response.id == "r1"
            np.testing.assert_array_equal(response.outputs[0].data, a - b)
        assert len(listener._connections) == 1  # the connection was kept and reused
        text = np.array([[str(i).encode() for i in range(16)]], dtype=object)
        response = await client.infer(address, InferRequest(
            "simple_string", inputs=[InferInput("INPUT0", "BYTES", (1, 16), text), InferInput("INPUT1", "BYTES", (1, 16), text)]))
        sums = {o.name: o.data for o in response.outputs}["OUTPUT0"]
        assert sums.reshape(-1).tolist() == [str(2 * i).encode() for i in range(16)]
        with pytest.raises(ServingError) as raised:
            await client.infer(address, InferRequest("simple", inputs=[InferInput("INPUT0", "INT32", (2, 16), a)]))
        assert raised.value.code == Code.INVALID_ARG and "missing required input(s) ['INPUT1']" in raised.value.message
        await listener.close(1.0)
        with pytest.raises(UnavailableError, match="model 'simple' could not be reached"):
            await client.infer(address, InferRequest(
                "simple", inputs=[InferInput("INPUT0", "INT32", (2, 16), a), InferInput("INPUT1", "INT32", (2, 16), b)]))
        client.close()

    asyncio.run(run())


REPEAT_CONFIG = """name: "repeat"
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
"""
REPEAT_MODEL = '''import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            for value in pb_utils.get_input_tensor_by_name(request, "IN").as_numpy():
                if value < 0:
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"negative: {value}")))
                else:
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


def test_a_decoupled_models_responses_stream_back_one_by_one(tmp_path: Path) -> None:
    """A request another replica sent on to a decoupled model's replica (the stream header):
    each response comes back as it is sent (an error as that response's error), the stream
    ends with the model's final flag, and a request refused before the model is one error."""
    from rayinfer.cluster.model_files import write_python_model
    from rayinfer.protocol.listener_client import STREAM_HEADER
    from rayinfer.serving.sequence_routing import FORWARDED_HEADER

    write_python_model(tmp_path, "repeat", REPEAT_CONFIG, REPEAT_MODEL)
    core = ModelCore(load_runner(tmp_path, "repeat", 1)[0], [1])
    forwarded = ((FORWARDED_HEADER, b"1"),)

    async def http(method: str, path: str, headers: dict[bytes, bytes], body: bytes):
        assert STREAM_HEADER in headers and FORWARDED_HEADER in headers
        return await model_http.stream_forwarded(core, headers, body, 1 << 20)

    async def grpc(method: str, payload: bytes) -> bytes:
        raise AssertionError("no gRPC here")

    def request(values: list[int], name: str = "IN") -> InferRequest:
        data = np.array(values, np.int32)
        return InferRequest("repeat", inputs=[InferInput(name, "INT32", data.shape, data)])

    async def run() -> None:
        listener = ReplicaListener(grpc, http, front_key=KEY)
        address = ("127.0.0.1", await listener.start("127.0.0.1"))
        client = ListenerClient(PEER)
        results = [r async for r in client.stream(address, request([3, -1, 5]), forwarded)]
        assert [r.outputs[0].data.tolist() if not isinstance(r, ServingError) else r.message for r in results] == \
            [[3], "negative: -1", [5]]
        refused = [r async for r in client.stream(address, request([1], name="NOPE"), forwarded)]
        assert len(refused) == 1 and isinstance(refused[0], ServingError)
        assert refused[0].code == Code.INVALID_ARG and "NOPE" in refused[0].message
        # A caller that stops listening closes its connection: the listener lets it go.
        stream = client.stream(address, request(list(range(50))), forwarded)
        first = await stream.__anext__()
        assert not isinstance(first, ServingError) and first.outputs[0].data.tolist() == [0]
        await stream.aclose()
        await wait_until_async(lambda: not listener._connections, "the listener to let the connection go", timeout_s=5)
        await listener.close(1.0)
        with pytest.raises(UnavailableError, match="could not be reached"):
            [r async for r in client.stream(address, request([1]), forwarded)]

    asyncio.run(run())
    core.close()


def test_a_replicas_own_calls_carry_the_restricted_inference_header(cores):
    """With the inference group restricted, a listener refuses a call without the header; the
    client a replica calls other replicas with (an ensemble's steps, a sequence sent on) sends
    it, so those calls are served."""
    from rayinfer.protocol.restricted_api import inference_headers, parse_restrictions

    restrictions = parse_restrictions(["inference:infer-key=secret"], "--http-restricted-api")

    async def run() -> None:
        listener = serve(cores)
        listener.restrict(restrictions, {})
        address = ("127.0.0.1", await listener.start("127.0.0.1"))
        a = np.ones((1, 16), dtype=np.int32)
        request = InferRequest("simple", inputs=[InferInput("INPUT0", "INT32", (1, 16), a),
                                                 InferInput("INPUT1", "INT32", (1, 16), a)])
        plain, peer = ListenerClient(PEER), ListenerClient((*PEER, *inference_headers(restrictions)))
        with pytest.raises(ServingError, match="This API is restricted, expecting header 'infer-key'"):
            await plain.infer(address, request)
        response = await peer.infer(address, request)
        np.testing.assert_array_equal({o.name: o.data for o in response.outputs}["OUTPUT0"], a + a)
        plain.close()
        peer.close()
        await listener.close(1.0)

    asyncio.run(run())


def test_a_listener_serves_only_clients_with_the_front_key(cores):
    """Over its port a listener serves the server's parts only: a client without the front key, or
    with another one, is refused (403, its message naming the key's header) and its
    connection closed; the key's client is served."""

    async def run() -> None:
        listener = serve(cores)
        address = ("127.0.0.1", await listener.start("127.0.0.1"))
        a = np.ones((1, 16), dtype=np.int32)
        request = InferRequest("simple", inputs=[InferInput("INPUT0", "INT32", (1, 16), a),
                                                 InferInput("INPUT1", "INT32", (1, 16), a)])
        for headers in ((), (front_key_header("ab" * 32),)):
            client = ListenerClient(headers)
            with pytest.raises(ServingError, match="rayinfer-front-key"):
                await client.infer(address, request)
            client.close()
        client = ListenerClient(PEER)
        response = await client.infer(address, request)
        np.testing.assert_array_equal({o.name: o.data for o in response.outputs}["OUTPUT0"], a + a)
        client.close()
        await listener.close(1.0)

    asyncio.run(run())
