"""Serve's servicer function for GRPCInferenceService, and the ``/v2`` replica's forwarding of
model RPCs by deployment handle (no Ray cluster: a stand-in handle)."""

from __future__ import annotations

import asyncio
import pickle
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from unittest.mock import Mock

import grpc
import pytest
from ray.serve._private.utils import import_attr
from tritonclient.grpc import service_pb2 as pb

from rayinfer.deployments import grpc_service, model_forwarder
from rayinfer.deployments.grpc_service import SERVICER_FUNCTION
from rayinfer.deployments.model_forwarder import ModelForwarder


def test_servicer_function_registers_the_service_and_makes_messages_picklable():
    server = grpc.server(ThreadPoolExecutor(1))
    add = import_attr(SERVICER_FUNCTION)  # the way Serve resolves grpc_servicer_functions
    add(Mock(), server)
    # Serve's gRPC proxy pickles the requests it forwards.
    request = pb.ModelInferRequest(model_name="m", raw_input_contents=[b"\1\2"])
    assert pickle.loads(pickle.dumps(request)) == request
    config = pb.ModelConfigResponse()
    config.config.max_batch_size = 4
    assert pickle.loads(pickle.dumps(config)).config.max_batch_size == 4
    server.stop(None)


class _Handle:
    """A deployment handle's ``grpc_forwarded.remote`` that answers or fails with ``error``."""

    def __init__(self, error: grpc.StatusCode | None):
        self.error = error
        self.calls: list[str] = []
        self.grpc_forwarded = self

    async def remote(self, method: str, payload: bytes) -> bytes:
        self.calls.append(method)
        if self.error is not None:
            raise grpc.aio.AioRpcError(self.error, grpc.aio.Metadata(), grpc.aio.Metadata(), "Method not found!")
        return pb.ModelStatisticsResponse(model_stats=[pb.ModelStatistics(name="m", version="1")]).SerializeToString()


class _Api:
    """The ``/v2`` replica's state as the forwarder reads it: one routed model, 'm' version 1."""

    def __init__(self) -> None:
        self.state = SimpleNamespace(route=lambda name, version: ("m", "m_v1") if name == "m" else None)


@pytest.fixture
def forwarder(monkeypatch: pytest.MonkeyPatch):
    def make(*errors: grpc.StatusCode | None) -> tuple[ModelForwarder, list[_Handle]]:
        handles = [_Handle(error) for error in errors]
        made = list(handles)

        def new_handle(route: tuple[str, str]) -> _Handle:
            assert route == ("m", "m_v1")
            return made.pop(0)

        monkeypatch.setattr(model_forwarder, "model_handle", new_handle)
        return ModelForwarder(_Api()), handles  # type: ignore[arg-type]  # a stand-in V2Api

    return make


def test_forward_retries_once_through_a_new_handle_when_the_address_is_not_a_replica(forwarder):
    server, (stale, fresh) = forwarder(grpc.StatusCode.UNIMPLEMENTED, None)
    request = pb.ModelStatisticsRequest(name="m", version="1")
    response = asyncio.run(server.forward("ModelStatistics", "m", "1", request))
    assert [s.name for s in response.model_stats] == ["m"]
    assert stale.calls == fresh.calls == ["ModelStatistics"]
    # Later calls use the new handle.
    asyncio.run(server.forward("ModelStatistics", "m", "1", request))
    assert (len(stale.calls), len(fresh.calls)) == (1, 2)


@pytest.mark.parametrize("errors", [(grpc.StatusCode.INTERNAL,), (grpc.StatusCode.UNIMPLEMENTED,) * 2],
                         ids=["other-code-not-retried", "retried-once-only"])
def test_forward_raises_what_a_retry_cannot_mend(forwarder, errors):
    server, handles = forwarder(*errors)
    with pytest.raises(grpc.aio.AioRpcError):
        asyncio.run(server.forward("ModelStatistics", "m", "1", pb.ModelStatisticsRequest(name="m")))
    assert [len(h.calls) for h in handles] == [1] * len(errors)


class _Context:
    """What Serve gives an RPC: the call's metadata, and the status it is to answer."""

    def __init__(self, metadata: list[tuple[str, str]]) -> None:
        self._metadata = metadata
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


def _restricted() -> grpc_service.GrpcInferenceService:
    """The /v2 replica's RPCs with statistics and inference restricted over gRPC."""
    from rayinfer.protocol.restricted_api import parse_restrictions

    return grpc_service.GrpcInferenceService(
        None, None, ({}, parse_restrictions(["statistics,inference:key=v"], "--grpc-restricted-protocol")))  # type: ignore[arg-type]


def test_serves_grpc_ingress_refuses_a_restricted_call_without_its_header():
    """Calls that reach the /v2 replica through Serve's gRPC ingress, not the front, are
    checked as the front checks them: UNAVAILABLE and Triton's message, the call not run."""
    service = _restricted()
    context = _Context([("application", "rayinfer")])
    answer = asyncio.run(service.rpc("ModelStatistics")(pb.ModelStatisticsRequest(name="simple"), context))
    assert answer == pb.ModelStatisticsResponse()
    assert context.code == grpc.StatusCode.UNAVAILABLE
    assert context.details == "This protocol is restricted, expecting header 'triton-grpc-protocol-key'"

    async def stream() -> list:
        async def requests():
            yield pb.ModelInferRequest(model_name="simple")

        context = _Context([("triton-grpc-protocol-key", "wrong")])
        responses = [r async for r in service.rpc("ModelStreamInfer")(requests(), context)]
        return [responses, context.code]

    assert asyncio.run(stream()) == [[], grpc.StatusCode.UNAVAILABLE]


def test_serves_grpc_ingress_answers_an_unrestricted_call():
    context = _Context([])
    assert asyncio.run(_restricted().rpc("ServerLive")(pb.ServerLiveRequest(), context)).live
    assert context.code is None


def test_every_rpc_is_handed_to_serve_by_name_with_the_context_it_takes():
    """Serve calls the deployment's method named after the RPC and passes ``grpc_context`` when
    the method's signature names it: every RPC of the service is there, and a unary one answers a
    message that did not parse with Triton's INTERNAL."""
    import inspect

    service = _restricted()
    assert grpc_service.RPC_NAMES == {m.name for m in pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods}
    for name in grpc_service.RPC_NAMES:
        rpc = service.rpc(name)
        assert rpc.__name__ == name and "grpc_context" in inspect.signature(rpc).parameters
    context = _Context([])
    assert asyncio.run(service.rpc("ServerMetadata")(grpc_service.Unparsable(), context)) == pb.ServerMetadataResponse()
    assert (context.code, context.details) == (grpc.StatusCode.INTERNAL, "Unable to parse request")


def test_the_servicer_gets_a_marker_for_a_message_that_does_not_parse():
    """add_servicer_to_server registers every RPC of the service on a real grpc server, with
    request deserializers that turn a message that does not parse into an Unparsable marker."""
    from concurrent import futures

    import grpc
    from tritonclient.grpc import service_pb2 as pb

    from rayinfer.deployments.grpc_service import Unparsable, add_servicer_to_server

    seen: list = []

    class Servicer:
        def __getattr__(self, name):
            def method(request, context):
                seen.append((name, request))
                return pb.ServerLiveResponse(live=True) if name == "ServerLive" else pb.ModelInferResponse(id="x")
            return method

    server = grpc.server(futures.ThreadPoolExecutor(2))
    add_servicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            live = channel.unary_unary("/inference.GRPCInferenceService/ServerLive")
            assert pb.ServerLiveResponse.FromString(live(b"")).live
            infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            assert pb.ModelInferResponse.FromString(infer(b"\xff\xff\xff")).id == "x"
    finally:
        server.stop(None)
    assert seen[0][0] == "ServerLive" and isinstance(seen[0][1], pb.ServerLiveRequest)
    assert seen[1][0] == "ModelInfer" and isinstance(seen[1][1], Unparsable)
