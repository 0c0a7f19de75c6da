"""Triton's model RPCs (``inference.GRPCInferenceService``) over a :class:`ModelCore`.

The replica's listener (calls the front relays) and the ``/v2`` replica's forwarding by
deployment handle both answer through :func:`call_serialized`; errors are raised as
:class:`ServingError` for the caller to turn into a gRPC status.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from rayinfer.protocol.errors import (
    UNPARSABLE_REQUEST,
    InternalError,
    NotFoundError,
    ServingError,
    UnsupportedError,
    as_serving_error,
)
from rayinfer.protocol.grpc_codec import metadata_to_grpc, request_from_grpc, response_to_grpc, statistics_to_grpc
from rayinfer.protocol.shared_memory import RegionMissing, decode_with_regions
from rayinfer.protocol.statistics import stats_to_json
from rayinfer.serving.model_core import ModelCore
from rayinfer.serving.protocol_stamps import StreamTrace, stamp_stream_request, wall_clock_offset_ns
from rayinfer.serving.stream_infer import AS_THEY_COME, AsTheyCome

# Request and response message of each model RPC.
MODEL_RPCS: dict[str, tuple[Any, Any]] = {
    "ModelInfer": (pb.ModelInferRequest, pb.ModelInferResponse),
    "ModelReady": (pb.ModelReadyRequest, pb.ModelReadyResponse),
    "ModelMetadata": (pb.ModelMetadataRequest, pb.ModelMetadataResponse),
    "ModelConfig": (pb.ModelConfigRequest, pb.ModelConfigResponse),
    "ModelStatistics": (pb.ModelStatisticsRequest, pb.ModelStatisticsResponse),
}


def model_and_version(method: str, request: Any) -> tuple[str, str]:
    """The model and version a model RPC names (ModelInfer's fields are named differently)."""
    if method == "ModelInfer":
        return request.model_name, request.model_version
    return request.name, request.version


async def call(core: ModelCore, method: str, request: Any) -> Any:
    """The response message of one model RPC addressed to ``core``'s model."""
    name, version = model_and_version(method, request)
    if name and name != core.name:
        raise NotFoundError(f"Request for unknown model: '{name}' is not found")
    if version and version != core.version:
        raise NotFoundError(f"Request for unknown model: '{core.name}' version {version} is not found")
    if method == "ModelInfer":
        if core.decoupled:
            raise UnsupportedError("ModelInfer RPC doesn't support models with decoupled transaction policy")
        # A request rejected here never reaches the executor, so it is not counted (as in Triton).
        decoded = await _decoded(core, request)
        return response_to_grpc(await core.infer(core.prepare(decoded)), decoded, core.shm)
    if method == "ModelReady":
        return pb.ModelReadyResponse(ready=await core.ready())
    if method == "ModelMetadata":
        return metadata_to_grpc(core.metadata)
    if method == "ModelConfig":
        return pb.ModelConfigResponse(config=core.spec.config)
    if method == "ModelStatistics":
        figures = await core.statistics(version)
        return statistics_to_grpc([stats_to_json(core.name, v, snapshot) for v, snapshot in figures])
    raise UnsupportedError(f"unknown gRPC method '{method}' for model '{core.name}'")


async def _decoded(core: ModelCore, request: pb.ModelInferRequest) -> Any:
    """The request decoded, with the shared memory regions it names mapped."""
    try:
        return request_from_grpc(request, core.shm)
    except RegionMissing:  # a region this replica has not mapped yet
        return await decode_with_regions(core.shm, lambda: request_from_grpc(request, core.shm))


async def call_serialized(core: ModelCore, method: str, payload: bytes) -> bytes:
    """:func:`call` on a serialized request, answering the serialized response."""
    messages = MODEL_RPCS.get(method)
    if messages is None:
        raise UnsupportedError(f"unknown gRPC method '{method}' for model '{core.name}'")
    try:
        request = messages[0].FromString(payload)
    except DecodeError:
        raise InternalError(UNPARSABLE_REQUEST) from None
    return (await call(core, method, request)).SerializeToString()


async def stream_serialized(core: ModelCore, payload: bytes | pb.ModelInferRequest, trace_context: str | None = None,
                            read_walls: tuple[int, int] | None = None) -> AsyncIterator[bytes | ServingError | StreamTrace | AsTheyCome]:
    """One request of a ModelStreamInfer stream (serialized, or parsed): its responses (zero to
    many for a decoupled model, else one) as serialized ``ModelStreamInferResponse`` messages,
    after :data:`~rayinfer.serving.stream_infer.AS_THEY_COME` for a decoupled model; an
    error is its ServingError (:func:`~rayinfer.serving.stream_infer.answer_stream` writes it as
    the stream's rules say). ``trace_context``: the
    client's traceparent; ``read_walls``: when (wall-clock ns) the process that reads the stream
    (the replica holding the client's connection, or the ``/v2`` replica) began and ended reading
    this request (its trace's GRPC_WAITREAD_START and _END). That process writes the responses:
    when the request was traced (Triton's trace file, timestamps), a :class:`StreamTrace` after
    them names the trace, for the send stamps it takes there."""
    stamps = stamp_stream_request(core.name, trace_context, read_walls) if trace_context or read_walls else None
    if core.decoupled:  # its responses are written as they come, between the stream's others
        yield AS_THEY_COME
    try:
        async for message in _stream_serialized(core, payload):
            yield message
    finally:
        if stamps is not None and stamps.finish is not None:  # a traced request's trace ends
            stamps.finish(0, 0)
    if stamps is not None and stamps.token is not None:
        yield StreamTrace(stamps.token, wall_clock_offset_ns())


async def _stream_serialized(core: ModelCore, payload: bytes | pb.ModelInferRequest) -> AsyncIterator[bytes | ServingError]:
    try:
        try:
            request = pb.ModelInferRequest.FromString(payload) if isinstance(payload, bytes) else payload
        except DecodeError:
            raise InternalError(UNPARSABLE_REQUEST) from None
        if request.model_version and request.model_version != core.version:
            raise NotFoundError(f"Request for unknown model: '{core.name}' version {request.model_version} is not found")
        decoded = await _decoded(core, request)
        prepared = core.prepare(decoded)
    except Exception as exc:  # rejected before the model (DecodeError included)
        yield as_serving_error(exc)
        return
    # As Triton's stream does, every response says whether it is the request's last
    # (triton_final_response); with tritonclient's enable_empty_final_response, a final flag sent
    # alone is an empty response saying so.
    marks_final = _bool_parameter(request, EMPTY_FINAL_RESPONSE)
    final = False
    async for result in core.stream(prepared):
        final = not core.decoupled or (prepared.sender is not None and prepared.sender.final_yielded)
        if isinstance(result, ServingError):
            yield result
            continue
        try:
            message = pb.ModelStreamInferResponse(infer_response=response_to_grpc(result, decoded, core.shm))
        except Exception as exc:  # an output that does not fit its shared memory
            yield as_serving_error(exc)
            continue
        message.infer_response.parameters[FINAL_RESPONSE].bool_param = final
        yield message.SerializeToString()
    if marks_final and not final:
        empty = pb.ModelInferResponse(model_name=core.name, model_version=core.version, id=request.id)
        empty.parameters[FINAL_RESPONSE].bool_param = True
        yield pb.ModelStreamInferResponse(infer_response=empty).SerializeToString()


# The request parameter asking for it, and the response parameter (Triton's names).
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"
FINAL_RESPONSE = "triton_final_response"


def _bool_parameter(request: pb.ModelInferRequest, name: str) -> bool:
    return name in request.parameters and request.parameters[name].bool_param
