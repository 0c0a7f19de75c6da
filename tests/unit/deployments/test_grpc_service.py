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

from rayinfer.deployments import grpc_service
from rayinfer.deployments.grpc_service import SERVICER_FUNCTION, ModelForwarder


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

        def new_handle(deployment: str, app: str) -> _Handle:
            assert (app, deployment) == ("m", "m_v1")
            return made.pop(0)

        monkeypatch.setattr(grpc_service, "serve", SimpleNamespace(get_deployment_handle=new_handle))
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
