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
from rayinfer.deployments.replica_listener import ReplicaListener
from rayinfer.protocol.errors import Code, ServingError, UnavailableError
from rayinfer.protocol.listener_client import ListenerClient
from rayinfer.protocol.types import InferInput, InferRequest, RequestedOutput
from rayinfer.serving import model_http
from rayinfer.serving.model_core import ModelCore
from rayinfer.serving.routes import parse_model_route


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

    return ReplicaListener(grpc, http)


def test_tensors_travel_binary_both_ways_over_one_kept_connection(cores):
    async def run() -> None:
        listener = serve(cores)
        address = ("127.0.0.1", await listener.start("127.0.0.1"))
        client = ListenerClient()
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
