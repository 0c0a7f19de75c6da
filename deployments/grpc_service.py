"""Triton's ``inference.GRPCInferenceService`` on Ray Serve replicas.

Serve runs a gRPC server in every ingress replica (registered through :data:`SERVICER_FUNCTION`)
and calls the replica's method named after the RPC. The front (:mod:`front`) relays the model
RPCs it can route straight to a replica of the model version (its own listener, not Serve's gRPC
server); everything else reaches the ``/v2`` application, whose :class:`GrpcInferenceService` is
below: server RPCs answered by :class:`~rayinfer.deployments.v2_api.V2Api`, model RPCs the front
could not route forwarded to the model's replicas by
:class:`~rayinfer.deployments.model_forwarder.ModelForwarder`.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from rayinfer.protocol.limits import DEFAULT_CONNECTION_LIMITS
from rayinfer.protocol.errors import (
    UNPARSABLE_REQUEST,
    InternalError,
    ServingError,
    UnavailableError,
    as_serving_error,
    grpc_status_name,
)
from rayinfer.protocol import log_settings
from rayinfer.protocol.grpc_wire import SERVICE
from rayinfer.protocol.restricted_api import Restrictions, grpc_message, missing_header
from rayinfer.protocol.grpc_codec import index_to_grpc, parameters_from_grpc, statistics_to_grpc
from rayinfer.protocol.shared_memory import CUDA, SYSTEM
from rayinfer.serving.stream_infer import Unparsable, answer_stream, ends_on_error
from rayinfer.serving.trace import parse_update

if TYPE_CHECKING:
    from rayinfer.deployments.model_forwarder import ModelForwarder
    from rayinfer.deployments.v2_api import V2Api

logger = logging.getLogger(__name__)

SERVICER_FUNCTION = "rayinfer.deployments.grpc_service.add_servicer_to_server"
_SERVICE_NAME = "inference.GRPCInferenceService"
_SERVICE_DESCRIPTOR = pb.DESCRIPTOR.services_by_name[_SERVICE_NAME.rpartition(".")[2]]
# The front's own way to the ``/v2`` replica's gRPC server (:func:`want_loopback_port`): asked
# for by the replica before Serve starts that server, the port known once it has.
_LOOPBACK = {"wanted": False, "port": None}


def want_loopback_port() -> None:
    """Have this process's Serve gRPC server (the ``/v2`` replica's, started after its
    constructor) listen on a port of 127.0.0.1 too, for the front on this machine: its calls
    then reach the replica without Serve's ingress HAProxy, which Serve replaces on every change
    of applications (a stream sent across a replacement could be refused)."""
    _LOOPBACK["wanted"] = True


def loopback_port() -> int | None:
    """The port :func:`want_loopback_port` got, once Serve's gRPC server has it."""
    return _LOOPBACK["port"]


def add_servicer_to_server(servicer: Any, server: Any) -> None:
    """Serve's ``grpc_servicer_functions`` entry: registers GRPCInferenceService on a replica's
    (or Serve's proxy's) gRPC server.

    tritonclient's generated messages name their modules after the .proto files
    (``grpc_service_pb2``, ``model_config_pb2``), which are not importable under those names;
    Ray Serve's gRPC proxy pickles requests it forwards (its fallback while a replica starts or
    drains), and pickle needs them. So those names are made to point at tritonclient's modules.
    """
    from tritonclient.grpc import model_config_pb2

    sys.modules.setdefault(pb.DESCRIPTOR.name.replace(".proto", "_pb2"), pb)
    sys.modules.setdefault(model_config_pb2.DESCRIPTOR.name.replace(".proto", "_pb2"), model_config_pb2)
    handlers = _method_handlers(servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(_SERVICE_NAME, handlers)
    if _LOOPBACK["wanted"]:
        try:
            _LOOPBACK["port"] = server.add_insecure_port("127.0.0.1:0") or None
        except RuntimeError as exc:  # the front goes on through Serve's ingress
            logger.warning("the /v2 replica's gRPC server cannot listen on 127.0.0.1 for the front: %s", exc)


def _lenient(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError:
            return Unparsable()

    return parse


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _method_handlers(servicer: Any) -> dict[str, grpc.RpcMethodHandler]:
    """The service's method handlers (as its generated ``add_..._to_server`` builds them, from
    the service's descriptor) with :func:`_lenient` request deserializers: Serve's gRPC server
    keeps a handler's deserializer when it takes the call over."""
    handlers = {}
    for method in _SERVICE_DESCRIPTOR.methods:
        request, response = getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)
        kind = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(getattr(servicer, method.name), request_deserializer=_lenient(request.FromString),
                                     response_serializer=response.SerializeToString)
    return handlers


def set_error(grpc_context: Any, exc: BaseException) -> ServingError:
    """Put a Triton error on the call's context: its gRPC status code and message."""
    error = as_serving_error(exc)
    if grpc_context is not None:
        grpc_context.set_code(getattr(grpc.StatusCode, grpc_status_name(error.code)))
        grpc_context.set_details(error.message)
    return error


def restricted(restrictions: tuple[Restrictions, Restrictions] | None, method: str, grpc_context: Any) -> bool:
    """--grpc-restricted-protocol at Serve's gRPC ingress, as the front checks it: a call of a
    restricted group without its header gets UNAVAILABLE and Triton's message (True then)."""
    if not restrictions or not any(restrictions) or grpc_context is None:
        return False
    metadata = {str(k).lower().encode(): v.encode() if isinstance(v, str) else v
                for k, v in grpc_context.invocation_metadata()}
    key = missing_header(*restrictions, SERVICE + method, metadata, SERVICE)
    if key is None:
        return False
    set_error(grpc_context, UnavailableError(grpc_message(key)))
    return True


async def answer(grpc_context: Any, call: Awaitable[Any], empty: type) -> Any:
    """The response of ``call``, or an empty ``empty`` message with the error's status set."""
    try:
        return await call
    except Exception as exc:
        set_error(grpc_context, exc)
        return empty()


# The RPCs of GRPCInferenceService, by name.
RPC_NAMES = frozenset(_SERVICE_DESCRIPTOR.methods_by_name)


class GrpcInferenceService:
    """The RPCs of the ``/v2`` application: ServerDeployment holds one and hands Serve its
    checked RPCs (:meth:`rpc`) by name.

    Model RPCs arrive here only when the front could not route them to a replica of the model
    (unknown or unavailable model, a compressed message, a stream, no running replica registered
    yet): they are answered with Triton's error or forwarded by deployment handle.
    """

    def __init__(self, api: V2Api, forwarder: ModelForwarder,
                 restrictions: tuple[Restrictions, Restrictions] | None = None,
                 max_queued_responses: int = DEFAULT_CONNECTION_LIMITS.max_queued_responses) -> None:
        """``restrictions``: --http-restricted-api and --grpc-restricted-protocol, checked again
        on every call; ``max_queued_responses``: a stream request's responses waiting to be sent
        (--max-queued-responses)."""
        self._api = api
        self._max_queued_responses = max_queued_responses
        self._forwarder = forwarder
        self._restrictions = restrictions
        self._rpcs = {name: self._checked(name) for name in RPC_NAMES}

    def rpc(self, name: str) -> Callable[..., Any]:
        """The RPC ``name`` as Serve calls it: a unary RPC first refuses a restricted call
        without its header (UNAVAILABLE) and a request that did not parse (Triton's INTERNAL
        "Unable to parse request"); ModelStreamInfer checks each message itself."""
        return self._rpcs[name]

    def _checked(self, name: str) -> Callable[..., Any]:
        method = getattr(self, name)
        descriptor = _SERVICE_DESCRIPTOR.methods_by_name[name]
        if descriptor.client_streaming:
            return method
        takes_context = "grpc_context" in inspect.signature(method).parameters
        empty = getattr(pb, descriptor.output_type.name)

        async def checked(request: Any, grpc_context: Any = None) -> Any:
            if restricted(self._restrictions, name, grpc_context):
                return empty()
            if isinstance(request, Unparsable):
                set_error(grpc_context, InternalError(UNPARSABLE_REQUEST))
                return empty()
            return await (method(request, grpc_context) if takes_context else method(request))

        checked.__name__ = checked.__qualname__ = name
        checked.__doc__ = method.__doc__
        return checked

    # ---- server ---------------------------------------------------------------------------

    async def ServerLive(self, request: pb.ServerLiveRequest) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await self._api.ready())

    async def ServerMetadata(self, request: pb.ServerMetadataRequest) -> pb.ServerMetadataResponse:
        doc = self._api.server_metadata()
        return pb.ServerMetadataResponse(name=doc["name"], version=doc["version"], extensions=doc["extensions"])

    # ---- model RPCs the front could not route ----------------------------------------------

    async def ModelReady(self, request: pb.ModelReadyRequest, grpc_context: Any = None) -> Any:
        if await self._forwarder.route(request.name, request.version) is None:
            return pb.ModelReadyResponse(ready=False)
        call = self._forwarder.forward("ModelReady", request.name, request.version, request)
        return await answer(grpc_context, call, pb.ModelReadyResponse)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, grpc_context: Any = None) -> Any:
        call = self._forwarder.forward("ModelMetadata", request.name, request.version, request)
        return await answer(grpc_context, call, pb.ModelMetadataResponse)

    async def ModelConfig(self, request: pb.ModelConfigRequest, grpc_context: Any = None) -> Any:
        call = self._forwarder.forward("ModelConfig", request.name, request.version, request)
        return await answer(grpc_context, call, pb.ModelConfigResponse)

    async def ModelInfer(self, request: pb.ModelInferRequest, grpc_context: Any = None) -> Any:
        call = self._forwarder.forward("ModelInfer", request.model_name, request.model_version, request)
        return await answer(grpc_context, call, pb.ModelInferResponse)

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], grpc_context: Any = None
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Each request goes to its model by handle, whose responses (zero to many for a
        decoupled model) stream back as they come (:func:`~rayinfer.serving.stream_infer.answer_stream`)."""
        if restricted(self._restrictions, "ModelStreamInfer", grpc_context):
            return
        # A client's W3C trace context (the opentelemetry trace mode), from the stream's metadata.
        metadata = dict(grpc_context.invocation_metadata()) if grpc_context is not None else {}
        trace_context = metadata.get("traceparent")

        def forward(request: pb.ModelInferRequest, read: tuple[int, int]) -> AsyncIterator[Any]:
            return self._forwarder.stream(request, trace_context, read, metadata)

        try:
            async for response in answer_stream(requests, forward, _error_response, self._api.traces.sent,
                                                ends_on_error(metadata.items()),
                                                max_queued_responses=self._max_queued_responses):
                yield response
        except ServingError as exc:  # the client asked that an error end the stream (triton_grpc_error)
            set_error(grpc_context, exc)

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, grpc_context: Any = None) -> Any:
        """Answered from the statistics model replicas report here (the front relays calls that
        name a served model to one of its replicas, which reports its latest figures first)."""
        call = self._api.model_stats(request.name, request.version)
        return await answer(grpc_context, _map(call, statistics_to_grpc), pb.ModelStatisticsResponse)

    # ---- repository ------------------------------------------------------------------------

    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, grpc_context: Any = None) -> Any:
        return index_to_grpc(await self._api.index(request.ready))

    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest, grpc_context: Any = None) -> Any:
        call = self._api.change_model("load", request.model_name, parameters_from_grpc(request.parameters))
        return await answer(grpc_context, _then(call, pb.RepositoryModelLoadResponse), pb.RepositoryModelLoadResponse)

    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, grpc_context: Any = None
    ) -> Any:
        call = self._api.change_model("unload", request.model_name, parameters_from_grpc(request.parameters))
        return await answer(grpc_context, _then(call, pb.RepositoryModelUnloadResponse),
                            pb.RepositoryModelUnloadResponse)

    # ---- shared memory ---------------------------------------------------------------------

    async def SystemSharedMemoryStatus(self, request: Any, grpc_context: Any = None) -> Any:
        response = pb.SystemSharedMemoryStatusResponse()
        try:
            for region in self._api.shm.status(request.name):
                response.regions[region["name"]].CopyFrom(
                    pb.SystemSharedMemoryStatusResponse.RegionStatus(**region))
        except ServingError as exc:
            set_error(grpc_context, exc)
            return pb.SystemSharedMemoryStatusResponse()
        return response

    async def SystemSharedMemoryRegister(self, request: Any, grpc_context: Any = None) -> Any:
        try:
            self._api.shm_register(request.name, request.key, request.offset, request.byte_size)
        except ServingError as exc:
            set_error(grpc_context, exc)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(self, request: Any, grpc_context: Any = None) -> Any:
        await self._api.shm_unregister(request.name, SYSTEM)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def CudaSharedMemoryStatus(self, request: Any, grpc_context: Any = None) -> Any:
        response = pb.CudaSharedMemoryStatusResponse()
        try:
            for region in self._api.shm.status(request.name, CUDA):
                response.regions[region["name"]].CopyFrom(pb.CudaSharedMemoryStatusResponse.RegionStatus(**region))
        except ServingError as exc:
            set_error(grpc_context, exc)
            return pb.CudaSharedMemoryStatusResponse()
        return response

    async def CudaSharedMemoryRegister(self, request: Any, grpc_context: Any = None) -> Any:
        try:
            self._api.shm_register_cuda(request.name, request.raw_handle, request.device_id, request.byte_size)
        except ServingError as exc:
            set_error(grpc_context, exc)
        return pb.CudaSharedMemoryRegisterResponse()

    async def CudaSharedMemoryUnregister(self, request: Any, grpc_context: Any = None) -> Any:
        await self._api.shm_unregister(request.name, CUDA)
        return pb.CudaSharedMemoryUnregisterResponse()

    async def TraceSetting(self, request: Any, grpc_context: Any = None) -> Any:
        """The trace extension: change the settings given (an empty value clears one), answer all."""
        doc: dict[str, Any] = {}
        for key, setting in request.settings.items():
            values = list(setting.value)
            doc[key] = None if not values else values if key == "trace_level" else values[0]
        try:
            settings = await self._api.trace_setting(request.model_name, parse_update(doc) if doc else None)
        except ServingError as exc:
            set_error(grpc_context, exc)
            return pb.TraceSettingResponse()
        response = pb.TraceSettingResponse()
        for key, value in settings.items():
            response.settings[key].value.extend(value if isinstance(value, list) else [value])
        return response

    async def LogSettings(self, request: Any, grpc_context: Any = None) -> Any:
        """The logging extension: change the settings given, answer all of them."""
        try:
            settings = self._api.set_log_settings(log_settings.update_from_grpc(self._api.log_settings,
                                                                                request.settings))
        except ServingError as exc:
            set_error(grpc_context, exc)
            return pb.LogSettingsResponse()
        response = pb.LogSettingsResponse()
        for key, value in settings.items():
            kind = {bool: "bool_param", int: "uint32_param", str: "string_param"}[type(value)]
            setattr(response.settings[key], kind, value)
        return response


async def _map(call: Awaitable[Any], convert: Callable[[Any], Any]) -> Any:
    return convert(await call)


async def _then(call: Awaitable[Any], response: type) -> Any:
    await call
    return response()


def _error_response(message: str) -> pb.ModelStreamInferResponse:
    return pb.ModelStreamInferResponse(error_message=message)
