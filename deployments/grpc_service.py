"""Triton's ``inference.GRPCInferenceService`` on Ray Serve replicas.

Serve runs a gRPC server in every ingress replica (registered through :data:`SERVICER_FUNCTION`)
and calls the replica's method named after the RPC. The front (:mod:`front`) relays the model
RPCs it can route straight to a replica of the model version (its own listener, not Serve's gRPC
server); everything else reaches the ``/v2`` application, whose :class:`ServerGrpcMethods` are
below.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from ray import serve
from tritonclient.grpc import service_pb2 as pb

import rayinfer
from rayinfer.protocol.errors import (
    InvalidArgError,
    ServingError,
    UnsupportedError,
    as_serving_error,
    grpc_status_name,
)
from rayinfer.protocol.grpc_codec import index_to_grpc, parameters_from_grpc, statistics_to_grpc

logger = logging.getLogger(__name__)

SERVICER_FUNCTION = "rayinfer.deployments.grpc_service.add_servicer_to_server"
# Request and response message of each model RPC.
RPC_MESSAGES: dict[str, tuple[type, type]] = {
    "ModelInfer": (pb.ModelInferRequest, pb.ModelInferResponse),
    "ModelReady": (pb.ModelReadyRequest, pb.ModelReadyResponse),
    "ModelMetadata": (pb.ModelMetadataRequest, pb.ModelMetadataResponse),
    "ModelConfig": (pb.ModelConfigRequest, pb.ModelConfigResponse),
    "ModelStatistics": (pb.ModelStatisticsRequest, pb.ModelStatisticsResponse),
}
# Responses of a stream computed ahead of the one being sent (they are still sent in order).
_STREAM_WINDOW = 64


def add_servicer_to_server(servicer: Any, server: Any) -> None:
    """Serve's ``grpc_servicer_functions`` entry: registers GRPCInferenceService on a replica's
    (or Serve's proxy's) gRPC server.

    tritonclient's generated messages name their modules after the .proto files
    (``grpc_service_pb2``, ``model_config_pb2``), which are not importable under those names;
    Ray Serve's gRPC proxy pickles requests it forwards (its fallback while a replica starts or
    drains), and pickle needs them. So those names are made to point at tritonclient's modules.
    """
    from tritonclient.grpc import model_config_pb2, service_pb2_grpc

    sys.modules.setdefault(pb.DESCRIPTOR.name.replace(".proto", "_pb2"), pb)
    sys.modules.setdefault(model_config_pb2.DESCRIPTOR.name.replace(".proto", "_pb2"), model_config_pb2)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)


def set_error(grpc_context: Any, exc: BaseException) -> ServingError:
    """Put a Triton error on the call's context: its gRPC status code and message."""
    error = as_serving_error(exc)
    if grpc_context is not None:
        grpc_context.set_code(getattr(grpc.StatusCode, grpc_status_name(error.code)))
        grpc_context.set_details(error.message)
    return error


async def answer(grpc_context: Any, call: Awaitable[Any], empty: type) -> Any:
    """The response of ``call``, or an empty ``empty`` message with the error's status set."""
    try:
        return await call
    except Exception as exc:
        set_error(grpc_context, exc)
        return empty()


class ServerGrpcMethods:
    """The RPCs of the ``/v2`` application (mixed into ServerDeployment).

    Model RPCs arrive here only when the front could not route them to a replica of the model
    (unknown or unavailable model, a compressed message, no running replica registered yet):
    they are answered with Triton's error or forwarded by deployment handle.
    """

    if TYPE_CHECKING:  # provided by ServerDeployment
        _server_id: str
        _routes: dict[str, tuple[str, str]]
        _handles: dict[tuple[str, str], Any]
        _ready: Callable[[], Awaitable[bool]]
        _index: Callable[[bool], Awaitable[list[dict[str, Any]]]]
        _all_stats: Callable[[], Awaitable[list[dict[str, Any]]]]
        _model_states: Callable[[], Awaitable[list[dict[str, Any]]]]
        _change_model: Callable[[str, str, dict[str, Any]], Awaitable[None]]
        _unavailable_model: Callable[[str, str | None], Awaitable[ServingError]]
        _server_metadata: Callable[[], dict[str, Any]]

    # ---- server ---------------------------------------------------------------------------

    async def ServerLive(self, request: pb.ServerLiveRequest) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await self._ready())

    async def ServerMetadata(self, request: pb.ServerMetadataRequest) -> pb.ServerMetadataResponse:
        doc = self._server_metadata()
        return pb.ServerMetadataResponse(name=doc["name"], version=doc["version"], extensions=doc["extensions"])

    # ---- model RPCs the front could not route ----------------------------------------------

    async def ModelReady(self, request: pb.ModelReadyRequest, grpc_context: Any = None) -> Any:
        if self._route(request.name, request.version) is None:
            await self._model_states()  # the model may have become ready since the last refresh
            if self._route(request.name, request.version) is None:
                return pb.ModelReadyResponse(ready=False)
        return await answer(grpc_context, self._forward("ModelReady", request.name, request.version, request),
                            pb.ModelReadyResponse)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, grpc_context: Any = None) -> Any:
        call = self._forward("ModelMetadata", request.name, request.version, request)
        return await answer(grpc_context, call, pb.ModelMetadataResponse)

    async def ModelConfig(self, request: pb.ModelConfigRequest, grpc_context: Any = None) -> Any:
        call = self._forward("ModelConfig", request.name, request.version, request)
        return await answer(grpc_context, call, pb.ModelConfigResponse)

    async def ModelInfer(self, request: pb.ModelInferRequest, grpc_context: Any = None) -> Any:
        call = self._forward("ModelInfer", request.model_name, request.model_version, request)
        return await answer(grpc_context, call, pb.ModelInferResponse)

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest]
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Each request goes to its model; responses come back in request order, and an error
        is that response's ``error_message`` (the stream stays open)."""
        window: asyncio.Queue[asyncio.Task | None] = asyncio.Queue(_STREAM_WINDOW)

        async def submit() -> None:
            try:
                async for request in requests:
                    call = self._forward("ModelInfer", request.model_name, request.model_version, request)
                    await window.put(asyncio.ensure_future(call))
            finally:
                await window.put(None)

        feeder = asyncio.ensure_future(submit())
        try:
            while (task := await window.get()) is not None:
                try:
                    yield pb.ModelStreamInferResponse(infer_response=await task)
                except Exception as exc:
                    yield pb.ModelStreamInferResponse(error_message=as_serving_error(exc).message)
            await feeder
        finally:
            feeder.cancel()

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, grpc_context: Any = None) -> Any:
        async def statistics() -> pb.ModelStatisticsResponse:
            if not request.name:
                return statistics_to_grpc(await self._all_stats())
            # Each served version's own replicas report figures that include their latest requests.
            await self._model_states()
            versions = [key.split("/", 1)[1] for key in self._routes if key.startswith(f"{request.name}/")]
            versions = [v for v in versions if v and request.version in ("", v)]
            if not versions:
                raise await self._unavailable_model(request.name, request.version or None)
            response = pb.ModelStatisticsResponse()
            for version in versions:
                one = pb.ModelStatisticsRequest(name=request.name, version=version)
                response.MergeFrom(await self._forward("ModelStatistics", request.name, version, one))
            return response

        return await answer(grpc_context, statistics(), pb.ModelStatisticsResponse)

    # ---- repository ------------------------------------------------------------------------

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, grpc_context: Any = None) -> Any:
        return index_to_grpc(await self._index(request.ready))

    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest, grpc_context: Any = None) -> Any:
        call = self._change_model("load", request.model_name, parameters_from_grpc(request.parameters))
        return await answer(grpc_context, _then(call, pb.RepositoryModelLoadResponse), pb.RepositoryModelLoadResponse)

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, grpc_context: Any = None
    ) -> Any:
        call = self._change_model("unload", request.model_name, parameters_from_grpc(request.parameters))
        return await answer(grpc_context, _then(call, pb.RepositoryModelUnloadResponse),
                            pb.RepositoryModelUnloadResponse)

    # ---- extensions not implemented --------------------------------------------------------

    async def SystemSharedMemoryStatus(self, request: Any, grpc_context: Any = None) -> Any:
        return _unimplemented(grpc_context, "system shared memory", pb.SystemSharedMemoryStatusResponse)

    async def SystemSharedMemoryRegister(self, request: Any, grpc_context: Any = None) -> Any:
        return _unimplemented(grpc_context, "system shared memory", pb.SystemSharedMemoryRegisterResponse)

    async def SystemSharedMemoryUnregister(self, request: Any, grpc_context: Any = None) -> Any:
        return _unimplemented(grpc_context, "system shared memory", pb.SystemSharedMemoryUnregisterResponse)

    async def CudaSharedMemoryStatus(self, request: Any, grpc_context: Any = None) -> Any:
        return _unimplemented(grpc_context, "CUDA shared memory", pb.CudaSharedMemoryStatusResponse)

    async def CudaSharedMemoryRegister(self, request: Any, grpc_context: Any = None) -> Any:
        return _unimplemented(grpc_context, "CUDA shared memory", pb.CudaSharedMemoryRegisterResponse)

    async def CudaSharedMemoryUnregister(self, request: Any, grpc_context: Any = None) -> Any:
        return _unimplemented(grpc_context, "CUDA shared memory", pb.CudaSharedMemoryUnregisterResponse)

    async def TraceSetting(self, request: Any, grpc_context: Any = None) -> Any:
        return _unimplemented(grpc_context, "trace settings", pb.TraceSettingResponse)

    async def LogSettings(self, request: Any, grpc_context: Any = None) -> Any:
        return _unimplemented(grpc_context, "log settings", pb.LogSettingsResponse)

    # ---- forwarding ------------------------------------------------------------------------

    def _route(self, name: str, version: str) -> tuple[str, str] | None:
        """(application, deployment) serving ``name`` at ``version`` ("" for the default)."""
        return self._routes.get(f"{name}/{version}")

    async def _forward(self, method: str, name: str, version: str, request: Any) -> Any:
        """Answer a model RPC through the model version's application (one handle hop)."""
        if not name:
            raise InvalidArgError("the request does not name a model")
        route = self._route(name, version)
        if route is None:
            await self._model_states()  # the model may have become ready since the last refresh
            route = self._route(name, version)
        if route is None:
            raise await self._unavailable_model(name, version or None)
        payload = request.SerializeToString()
        handle = self._handles.get(route) or self._new_handle(route)
        try:
            answer_bytes = await handle.grpc_forwarded.remote(method, payload)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            # Serve's router reached a gRPC server without Serve's replica service, so the replica
            # address it holds is another server's now. The call never reached a model: it is
            # sent again through a new handle, which reads the replicas afresh.
            logger.warning("%s for model '%s' reached a server that is not its replica (%s); retrying "
                           "with a new handle", method, name, exc.details())
            answer_bytes = await self._new_handle(route).grpc_forwarded.remote(method, payload)
        return RPC_MESSAGES[method][1].FromString(answer_bytes)

    def _new_handle(self, route: tuple[str, str]) -> Any:
        """A deployment handle to ``route`` (application, deployment), kept for later calls."""
        handle = self._handles[route] = serve.get_deployment_handle(route[1], route[0])
        return handle


async def _then(call: Awaitable[Any], response: type) -> Any:
    await call
    return response()


def _unimplemented(grpc_context: Any, what: str, empty: type) -> Any:
    set_error(grpc_context, UnsupportedError(f"{what} is not supported by rayinfer {rayinfer.__version__}"))
    return empty()
