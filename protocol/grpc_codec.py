"""KServe v2 gRPC codec: Triton's ``inference.GRPCInferenceService`` messages to and from the
protocol-neutral types, plus the small builders for metadata, statistics and the index.

Tensor data comes either as ``raw_input_contents`` (one little-endian buffer per input, BYTES
as 4-byte length-prefixed elements, exactly the HTTP binary extension's layout) or as typed
``contents``; outputs always go back as ``raw_output_contents``, as Triton sends them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import service_pb2 as pb

from rayinfer.protocol.dtypes import (
    WIRE_DATATYPES,
    array_from_buffer,
    element_count,
    numpy_dtype,
    serialize_bytes_tensor,
)
from rayinfer.protocol.errors import InvalidArgError
from rayinfer.protocol.shared_memory import (
    REGION,
    TENSOR_PARAMETERS,
    SharedMemoryRegistry,
    place_output,
    read_input,
    tensor_location,
    write_output,
)
from rayinfer.protocol.types import InferInput, InferRequest, InferResponse, RequestedOutput

# Typed ``InferTensorContents`` field for each datatype (FP16 and BF16 only travel raw).
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


# ---- parameters --------------------------------------------------------------------------------

def parameters_from_grpc(params: Any) -> dict[str, Any]:
    """A ``map<string, InferParameter>`` (or ``ModelRepositoryParameter``) as a plain dict."""
    out = {}
    for key, param in params.items():
        choice = param.WhichOneof("parameter_choice")
        out[key] = getattr(param, choice) if choice is not None else None
    return out


def parameters_to_grpc(values: dict[str, Any], target: Any) -> None:
    """Fill a ``map<string, InferParameter>`` from a plain dict (bools before ints: bool is an int)."""
    for key, value in values.items():
        param = target[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            if value >= 2**63:
                param.uint64_param = value
            else:
                param.int64_param = value
        elif isinstance(value, float):
            param.double_param = value
        else:
            param.string_param = str(value)


# ---- inference ---------------------------------------------------------------------------------

def request_from_grpc(message: pb.ModelInferRequest, shm: SharedMemoryRegistry | None = None) -> InferRequest:
    """Decode a ``ModelInferRequest``; errors name the offending input (and the model). Inputs
    in shared memory are read from ``shm``'s regions (and outputs there checked against them)."""
    model = message.model_name
    raw = message.raw_input_contents
    in_shm = [REGION in tensor.parameters for tensor in message.inputs]
    if raw and len(raw) != len(message.inputs) - sum(in_shm):
        raise InvalidArgError(
            f"expected {len(message.inputs) - sum(in_shm)} raw_input_contents (one per input not in shared "
            f"memory) for model '{model}', got {len(raw)}"
        )
    inputs = []
    position = 0
    for tensor, shared in zip(message.inputs, in_shm):
        name, datatype = tensor.name, tensor.datatype
        if datatype not in WIRE_DATATYPES:
            raise InvalidArgError(f"input '{name}' has invalid datatype '{datatype}' for model '{model}'")
        shape = tuple(tensor.shape)
        if any(d < 0 for d in shape):
            raise InvalidArgError(f"input '{name}' has invalid shape {list(shape)} for model '{model}'")
        count = element_count(shape, name, datatype)
        parameters = parameters_from_grpc(tensor.parameters)
        if not shared and parameters and any(key in parameters for key in TENSOR_PARAMETERS):
            tensor_location(parameters, f"input '{name}'")  # Triton's error: a size or offset needs a region
        if shared or raw:
            if tensor.HasField("contents"):
                raise InvalidArgError(
                    f"unexpected explicit tensor data for input tensor '{name}' for model '{model}', "
                    "binary data was already supplied."
                )
            if shared:
                shared_bytes = read_input(shm, parameters, f"input '{name}'")
                assert shared_bytes is not None  # the parameters name a region
                buffer = shared_bytes
                parameters = {k: v for k, v in parameters.items() if k not in TENSOR_PARAMETERS}
            else:
                buffer = raw[position]
                position += 1
            data = array_from_buffer(
                buffer, datatype, shape, name, f"input '{name}' for model '{model}'",
                lambda got, expected, name=name: f"input byte size mismatch for input '{name}' for model '{model}'. "
                f"Expected {expected}, got {got}",
            )
        else:
            data = _array_from_contents(name, model, datatype, shape, count, tensor)
        inputs.append(InferInput(name, datatype, shape, data, parameters))
    outputs = [_requested_output(out, shm) for out in message.outputs] or None
    parameters = parameters_from_grpc(message.parameters)
    if "priority" in parameters or "timeout" in parameters:
        _check_schedule_parameters(message.parameters, parameters)
    if "sequence_id" in parameters or "sequence_start" in parameters or "sequence_end" in parameters:
        _check_sequence_parameters(message.parameters)
        if isinstance(parameters.get("sequence_id"), int) and parameters["sequence_id"] < 0:
            parameters["sequence_id"] += 1 << 64  # an int64 id taken as unsigned, as in Triton
    return InferRequest(
        model_name=model,
        model_version=message.model_version,
        id=message.id or None,
        inputs=inputs,
        outputs=outputs,
        parameters=parameters,
    )


def _requested_output(out: Any, shm: SharedMemoryRegistry | None) -> RequestedOutput:
    output = RequestedOutput(out.name, None, _output_parameters(out.parameters))
    if any(key in output.parameters for key in TENSOR_PARAMETERS):
        place_output(output, shm)
    return output


def _check_schedule_parameters(message_parameters: Any, parameters: dict[str, Any]) -> None:
    """Triton's rules for ``priority`` (int64 >= 0 or uint64) and ``timeout`` (int64, in
    microseconds; a negative one sets no timeout of the request's own)."""
    if "priority" in parameters:
        kind = message_parameters["priority"].WhichOneof("parameter_choice")
        if kind not in ("int64_param", "uint64_param"):
            raise InvalidArgError("invalid value type for 'priority' parameter, expected int64_param or uint64_param.")
        if parameters["priority"] < 0:
            raise InvalidArgError("invalid value for 'priority', expected value >= 0.")
    if "timeout" in parameters:
        if message_parameters["timeout"].WhichOneof("parameter_choice") != "int64_param":
            raise InvalidArgError("invalid value type for 'timeout' parameter, expected int64_param.")
        parameters["timeout"] = max(parameters["timeout"], 0)


def _output_parameters(message_parameters: Any) -> dict[str, Any]:
    """A requested output's parameters, with Triton's checks of ``classification``."""
    parameters = parameters_from_grpc(message_parameters)
    if "classification" in parameters:
        if message_parameters["classification"].WhichOneof("parameter_choice") != "int64_param":
            raise InvalidArgError("invalid value type for 'classification' parameter, expected int64_param")
        if parameters["classification"] < 1:
            raise InvalidArgError("invalid value for 'classification' parameter, expected >= 1")
    return parameters


def _check_sequence_parameters(message_parameters: Any) -> None:
    """Triton's rules: ``sequence_id`` an int64 or a string, ``sequence_start`` and
    ``sequence_end`` booleans."""
    if "sequence_id" in message_parameters:
        if message_parameters["sequence_id"].WhichOneof("parameter_choice") not in ("int64_param", "string_param"):
            raise InvalidArgError("invalid value type for 'sequence_id' parameter, expected int64_param or string_param.")
    for key in ("sequence_start", "sequence_end"):
        if key in message_parameters and message_parameters[key].WhichOneof("parameter_choice") != "bool_param":
            raise InvalidArgError(f"invalid value type for '{key}' parameter, expected bool_param.")


def _array_from_contents(name: str, model: str, datatype: str, shape: tuple[int, ...], count: int,
                         tensor: Any) -> np.ndarray:
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidArgError(
            f"input '{name}' for model '{model}': {datatype} data must be sent in raw_input_contents"
        )
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise InvalidArgError(
            f"unexpected number of elements for input '{name}' for model '{model}': expected {count} "
            f"for shape {list(shape)}, got {len(values)} in contents.{field}"
        )
    if datatype == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = list(values)
    else:
        array = np.array(values, dtype=numpy_dtype(datatype))
    return array.reshape(shape)


def response_to_grpc(response: InferResponse, request: InferRequest | None = None,
                     shm: SharedMemoryRegistry | None = None) -> pb.ModelInferResponse:
    """Encode a response with every output's data in ``raw_output_contents``; an output the
    request placed in shared memory is written to ``shm`` (its raw contents left empty, so
    that the others keep their positions)."""
    wanted = {o.name: o.shm for o in request.outputs if o.shm is not None} if request and request.outputs else {}
    message = pb.ModelInferResponse(model_name=response.model_name, model_version=response.model_version)
    if response.id is not None:
        message.id = response.id
    if response.parameters:
        parameters_to_grpc(response.parameters, message.parameters)
    raw = message.raw_output_contents
    for out in response.outputs:
        tensor = message.outputs.add(name=out.name, datatype=out.datatype, shape=out.shape)
        if out.parameters:
            parameters_to_grpc(out.parameters, tensor.parameters)
        location = wanted.get(out.name)
        if location is not None:
            assert shm is not None  # the request was decoded against it
            write_output(shm, location, out.name, out.datatype, out.data)
            raw.append(b"")
        elif out.datatype == "BYTES":
            raw.append(serialize_bytes_tensor(out.data))
        else:
            raw.append(np.ascontiguousarray(out.data).tobytes())
    return message


# ---- metadata, statistics and the repository ---------------------------------------------------

def metadata_to_grpc(doc: dict[str, Any]) -> pb.ModelMetadataResponse:
    """The HTTP metadata document (name, versions, platform, inputs, outputs) as its gRPC twin."""
    return json_format.ParseDict(doc, pb.ModelMetadataResponse())


def statistics_to_grpc(model_stats: list[dict[str, Any]]) -> pb.ModelStatisticsResponse:
    """``model_stats`` entries in Triton's JSON form as a ``ModelStatisticsResponse``."""
    return json_format.ParseDict({"model_stats": model_stats}, pb.ModelStatisticsResponse())


def index_to_grpc(rows: list[dict[str, Any]]) -> pb.RepositoryIndexResponse:
    """Repository index rows (name, version, state, reason) as a ``RepositoryIndexResponse``."""
    message = pb.RepositoryIndexResponse()
    for row in rows:
        message.models.add(
            name=row["name"], version=row.get("version", ""), state=row["state"], reason=row.get("reason", "")
        )
    return message
