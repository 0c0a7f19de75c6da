"""KServe v2 HTTP codec: JSON tensors and Triton's binary tensor data extension.

A request body is a JSON header optionally followed by raw tensor bytes; the header's length is
given by the ``Inference-Header-Content-Length`` HTTP header. Responses use the same framing
when any output is binary.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from rayinfer.protocol.dtypes import (
    WIRE_DATATYPES,
    array_from_buffer,
    element_count,
    element_size_bytes,
    numpy_dtype,
    serialize_bytes_tensor,
)
from rayinfer.protocol.errors import Code, InvalidArgError, ServingError, as_serving_error, http_status
from rayinfer.protocol.json_errors import parse_failure
from rayinfer.protocol.shared_memory import (
    BYTE_SIZE,
    REGION,
    TENSOR_PARAMETERS,
    SharedMemoryRegistry,
    place_output,
    read_input,
    write_output,
)
from rayinfer.protocol.types import InferInput, InferRequest, InferResponse, RequestedOutput

HEADER_LENGTH = "inference-header-content-length"


def parse_json_body(body: bytes, what: str = "request") -> dict[str, Any]:
    """Parse a JSON object body, raising INVALID_ARG with the parser's reason in Triton's words."""
    try:
        doc = json.loads(body)
    except ValueError as exc:  # UnicodeDecodeError included
        raise InvalidArgError(f"failed to parse the {what} JSON buffer: {parse_failure(body, exc)}") from None
    except RecursionError:
        raise InvalidArgError(f"failed to parse the {what} JSON buffer: the document is nested too deeply") from None
    if not isinstance(doc, dict):
        raise InvalidArgError(f"failed to parse the {what} JSON buffer: expected a JSON object")
    return doc


def repository_index_ready(body: bytes) -> bool:
    """The ``ready`` flag of a repository index request's body, read as Triton 2.51 reads it: an
    empty body, or one that is not a JSON object, asks for every model; ``ready`` must be a
    boolean; a body that does not parse is Triton's 500 "failed to parse the request JSON buffer"."""
    if not body.strip():
        return False
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise ServingError(f"failed to parse the request JSON buffer: {parse_failure(body, exc)}", Code.INTERNAL) from None
    except RecursionError:  # Triton's parser takes any depth; Python's stops near 1,000 levels
        raise ServingError("failed to parse the request JSON buffer: the document is nested too deeply",
                           Code.INTERNAL) from None
    if not isinstance(doc, dict) or "ready" not in doc:
        return False
    if not isinstance(doc["ready"], bool):
        raise ServingError("attempt to access JSON non-boolean as boolean", Code.INTERNAL)
    return doc["ready"]


def request_from_http(
    body: bytes, header_length: int | None, model_name: str, model_version: str = "",
    shm: SharedMemoryRegistry | None = None,
) -> InferRequest:
    """Decode an HTTP infer body (JSON, or JSON + binary tensors) into an :class:`InferRequest`;
    tensors in shared memory are read from ``shm``'s regions (and outputs checked against them)."""
    if header_length is None:
        header, binary = body, memoryview(b"")
    else:
        if header_length < 0 or header_length > len(body):
            raise InvalidArgError(
                f"Inference-Header-Content-Length {header_length} is out of range for a body "
                f"of {len(body)} bytes"
            )
        view = memoryview(body)
        header, binary = bytes(view[:header_length]), view[header_length:]
    doc = parse_json_body(header)
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list):  # Triton's words; an empty array is for the model to judge
        raise ServingError("Unable to parse 'inputs': " + ("attempt to access non-existing object member 'inputs'"
                           if raw_inputs is None else "attempt to access JSON non-array as array"), Code.INTERNAL)
    offset = 0
    inputs = []
    for raw in raw_inputs:
        tensor, offset = _input_from_json(raw, binary, offset, shm, model_name)
        inputs.append(tensor)
    if offset != len(binary):
        raise InvalidArgError(
            f"unexpected {len(binary) - offset} bytes of binary data after the last input tensor"
        )
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidArgError("request 'parameters' must be a JSON object")
    if "priority" in params or "timeout" in params:
        _check_schedule_parameters(params)
    if "sequence_id" in params or "sequence_start" in params or "sequence_end" in params:
        _check_sequence_parameters(params)
    request_id = doc.get("id")
    return InferRequest(
        model_name=model_name,
        model_version=model_version,
        id=str(request_id) if request_id is not None else None,
        inputs=inputs,
        outputs=_outputs_from_json(doc.get("outputs"), params, shm),
        parameters=params,
    )


def raw_request(body: bytes, model_name: str, model_version: str,
                inputs: Sequence[tuple[str, str, Sequence[int]]], batching: bool) -> InferRequest:
    """A raw binary request (``Inference-Header-Content-Length: 0``): the whole body is the data
    of the model's one input, whose name, datatype and shape come from the model's config
    (``inputs``: (name, datatype, dims) of each; ``batching``: a batch of one row); every output
    is answered as binary data. Triton's rules and messages."""
    if len(inputs) != 1:
        raise InvalidArgError(f"Raw request must only have 1 input (found 1) to be deduced but got {len(inputs)} "
                              f"inputs in '{model_name}' model configuration")
    name, datatype, dims = inputs[0]
    if datatype == "BYTES":
        if list(dims) != [1]:
            raise InvalidArgError(f"For BYTE datatype raw input '{name}', the model must have input shape [1]")
        data = np.empty(1, dtype=object)
        data[0] = bytes(body)
        shape = [1, 1] if batching else [1]
        return _raw(model_name, model_version, name, datatype, shape, data.reshape(shape))
    shape = ([1] if batching else []) + list(dims)
    variable = [i for i, d in enumerate(shape) if d < 0]
    if len(variable) > 1:
        raise InvalidArgError(f"The shape of the raw input '{name}' can not be deduced because there are more than "
                              "one variable-sized dimension")
    if variable:
        row = math.prod(d for d in shape if d >= 0) * element_size_bytes(datatype)
        shape[variable[0]] = len(body) // row if row else 0
    data = array_from_buffer(
        body, datatype, shape, name, f"input '{name}'",
        lambda got, expected: f"input byte size mismatch for input '{name}' for model '{model_name}'. "
        f"Expected {expected}, got {got}",
    )
    return _raw(model_name, model_version, name, datatype, shape, data)


def _raw(model: str, version: str, name: str, datatype: str, shape: list[int], data: np.ndarray) -> InferRequest:
    return InferRequest(model_name=model, model_version=version, id=None,
                        inputs=[InferInput(name, datatype, tuple(shape), data, {})], outputs=None,
                        parameters={"binary_data_output": True})


def _check_schedule_parameters(params: dict[str, Any]) -> None:
    """``priority`` and ``timeout`` (microseconds) must be unsigned integers (Triton's message
    and code, INTERNAL)."""
    for key in ("priority", "timeout"):
        value = params.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ServingError(
                f"Unable to parse '{key}': attempt to access JSON non-unsigned-integer as unsigned-integer",
                Code.INTERNAL)


def _check_sequence_parameters(params: dict[str, Any]) -> None:
    """``sequence_id`` an unsigned integer or a string, ``sequence_start`` / ``sequence_end``
    booleans (Triton's messages and code, INTERNAL)."""
    sequence_id = params.get("sequence_id", 0)
    if not isinstance(sequence_id, str) and (not isinstance(sequence_id, int) or isinstance(sequence_id, bool)
                                             or sequence_id < 0):
        raise ServingError("Unable to parse 'sequence_id': attempt to access JSON non-string as string", Code.INTERNAL)
    for key in ("sequence_start", "sequence_end"):
        if not isinstance(params.get(key, False), bool):
            raise ServingError(f"Unable to parse '{key}': attempt to access JSON non-boolean as boolean", Code.INTERNAL)


def _input_from_json(raw: Any, binary: memoryview, offset: int, shm: SharedMemoryRegistry | None,
                     model: str) -> tuple[InferInput, int]:
    if not isinstance(raw, dict):
        raise InvalidArgError("each entry of 'inputs' must be a JSON object")
    name = raw.get("name")
    if not isinstance(name, str):
        raise InvalidArgError("input is missing its 'name'")
    datatype = raw.get("datatype")
    if not isinstance(datatype, str) or datatype not in WIRE_DATATYPES:
        raise InvalidArgError(f"input '{name}' has invalid datatype '{datatype}'")
    shape = raw.get("shape")
    if not isinstance(shape, list):
        raise InvalidArgError(f"input '{name}' has invalid shape {shape!r}")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):  # Triton's words
        raise ServingError("Unable to parse 'shape': attempt to access JSON non-unsigned-integer as unsigned-integer",
                           Code.INTERNAL)
    params = raw.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidArgError(f"input '{name}': 'parameters' must be a JSON object")
    _check_content(name, "data" in raw, "binary_data_size" in params, REGION in params)
    count = element_count(shape, name, datatype)
    shared = read_input(shm, params, f"input '{name}'")
    if shared is not None:
        data = array_from_buffer(
            shared, datatype, shape, name, f"input '{name}'",
            lambda got, expected: f"input byte size mismatch for input '{name}' for model '{model}'. "
            f"Expected {expected}, got {got}",
        )
        params = {k: v for k, v in params.items() if k not in TENSOR_PARAMETERS}
        return InferInput(name, datatype, tuple(shape), data, params), offset
    if "binary_data_size" in params:
        size = params["binary_data_size"]
        if not isinstance(size, int) or size < 0 or offset + size > len(binary):
            raise InvalidArgError(
                f"input '{name}': binary_data_size {size!r} exceeds the {len(binary) - offset} "
                "bytes of binary data left in the request"
            )
        data = array_from_buffer(
            binary[offset:offset + size], datatype, shape, name, f"input '{name}'",
            lambda got, expected: f"input '{name}' has {got} bytes of binary data, expected {expected} for "
            f"shape {shape} and datatype {datatype}",
        )
        params = {k: v for k, v in params.items() if k != "binary_data_size"}
        return InferInput(name, datatype, tuple(shape), data, params), offset + size
    data = array_from_json(name, datatype, shape, count, raw["data"])
    return InferInput(name, datatype, tuple(shape), data, params), offset


def _check_content(name: str, has_data: bool, has_binary: bool, has_shm: bool) -> None:
    """Triton's rule: exactly one of 'data', binary data and shared memory."""
    if has_data + has_binary + has_shm == 1:
        return
    given = [f"'{field}'" for field, present in (("data", has_data), ("binary_data_size", has_binary),
                                                 ("shared_memory_region", has_shm)) if present]
    raise InvalidArgError(
        "Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', "
        "'shared_memory_region' in 'parameters'. But " + (f"set {' '.join(given)}" if given else "no field is set")
        + f" for input '{name}'")


# Triton's HTTP_MAX_JSON_NESTING_DEPTH: how deeply a tensor's 'data' may nest its arrays.
MAX_JSON_DATA_DEPTH = 100


def _flat_data(name: str, datatype: str, data: Any) -> list[Any]:
    """'data' as a flat list, as Triton reads it: arrays nested to any depth (whatever the
    shape) are flattened in order, up to :data:`MAX_JSON_DATA_DEPTH`; INVALID_ARG beyond."""
    if not isinstance(data, list):
        return [data]
    values: list[Any] = []
    stack = [iter(data)]  # an item of stack[-1] lies len(stack) arrays deep
    while stack:
        for item in stack[-1]:
            if len(stack) >= MAX_JSON_DATA_DEPTH:
                message = f"JSON nesting depth exceeds maximum allowed limit ({MAX_JSON_DATA_DEPTH})"
                raise InvalidArgError(message if datatype == "BYTES" else f"Unable to parse 'data': {message}")
            if isinstance(item, list):
                stack.append(iter(item))
                break
            values.append(item)
        else:
            stack.pop()
    return values


def array_from_json(name: str, datatype: str, shape: list[int], count: int, data: Any) -> np.ndarray:
    if datatype == "BF16":  # Triton's words: BF16 travels as binary data only
        raise InvalidArgError("receiving BF16 data via JSON is not supported. Please use the binary data format "
                              "for input")
    try:
        if datatype in ("BYTES", "BOOL"):
            flat = _flat_data(name, datatype, data)
            if datatype == "BYTES":
                # Only strings: bytes(n) of a JSON number would be n zero bytes (n may be huge).
                if not all(isinstance(item, str) for item in flat):
                    raise ValueError("expected JSON strings")
                array = np.empty(len(flat), dtype=object)
                array[:] = [item.encode("utf-8") for item in flat]
            else:
                if not all(isinstance(v, bool) for v in flat):
                    raise ValueError("expected true or false")
                array = np.array(flat, dtype=np.bool_)
        else:
            source = data
            try:  # numpy reads evenly nested data at C speed
                raw = np.asarray(data)
                if raw.dtype == object:
                    raise ValueError("unevenly nested")
            except ValueError:  # unevenly nested, or deeper than numpy's 64 dimensions
                source = _flat_data(name, datatype, data)
                raw = np.asarray(source)
            allowed = "iuf" if datatype.startswith("FP") else "iu"
            if raw.size and raw.dtype.kind not in allowed:
                raise ValueError(f"expected JSON numbers of type {datatype}")
            array = np.asarray(source, dtype=numpy_dtype(datatype)).reshape(-1)
    except ValueError as exc:
        raise InvalidArgError(f"input '{name}': data is not valid {datatype}: {exc}") from None
    except (TypeError, OverflowError) as exc:
        raise InvalidArgError(f"input '{name}': data is not valid {datatype}: {exc}") from None
    if array.size != count:
        raise InvalidArgError(
            f"input '{name}' has {array.size} elements in 'data', expected {count} for shape {shape}"
        )
    return array.reshape(shape)


def _outputs_from_json(raw: Any, params: dict[str, Any],
                       shm: SharedMemoryRegistry | None) -> list[RequestedOutput] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise InvalidArgError("request 'outputs' must be an array")
    outputs = []
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise InvalidArgError("each requested output must be an object with a 'name'")
        oparams = dict(item.get("parameters") or {})
        binary = oparams.pop("binary_data", None)
        classes = oparams.get("classification", 0)
        if not isinstance(classes, int) or isinstance(classes, bool) or classes < 0:
            raise ServingError("Unable to set 'classification': attempt to access JSON non-unsigned-integer as "
                               "unsigned-integer", Code.INTERNAL)
        output = RequestedOutput(item["name"], None if binary is None else bool(binary), oparams)
        if any(key in oparams for key in TENSOR_PARAMETERS):
            if binary:
                raise InvalidArgError("Output can't set both 'shared_memory_region' and 'binary_data'")
            place_output(output, shm)
        outputs.append(output)
    return outputs


def response_to_http(response: InferResponse, request: InferRequest,
                     shm: SharedMemoryRegistry | None = None) -> tuple[bytes, int | None]:
    """Encode a response; returns the body and the JSON header length when binary data follows.
    Outputs the request placed in shared memory are written to ``shm``'s regions."""
    default_binary = bool(request.parameters.get("binary_data_output", False))
    wanted = {o.name: o for o in request.outputs} if request.outputs else {}
    chunks: list[bytes] = []
    out_docs = []
    for out in response.outputs:
        requested = wanted.get(out.name)
        binary = default_binary if requested is None or requested.binary is None else requested.binary
        doc: dict[str, Any] = {"name": out.name, "datatype": out.datatype, "shape": list(out.shape)}
        params = dict(out.parameters)
        if requested is not None and requested.shm is not None:
            assert shm is not None  # the request was decoded against it
            write_output(shm, requested.shm, out.name, out.datatype, out.data)
        elif binary:
            raw = (
                serialize_bytes_tensor(out.data)
                if out.datatype == "BYTES"
                else np.ascontiguousarray(out.data).tobytes()
            )
            params["binary_data_size"] = len(raw)
            chunks.append(raw)
        else:
            doc["data"] = json_data(out.datatype, out.data)
        if params:
            doc["parameters"] = params
        out_docs.append(doc)
    head: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    if response.id is not None:
        head["id"] = response.id
    if response.parameters:
        head["parameters"] = response.parameters
    head["outputs"] = out_docs
    header = json.dumps(head, separators=(",", ":")).encode()
    if not chunks:
        return header, None
    return header + b"".join(chunks), len(header)


def json_data(datatype: str, data: np.ndarray) -> list[Any]:
    if datatype == "BF16":
        raise InvalidArgError("sending BF16 data via JSON is not supported. Please use the binary data format "
                              "for output")
    flat = data.reshape(-1)
    if datatype == "BYTES":
        return [
            item.decode("utf-8", errors="replace") if isinstance(item, bytes) else str(item)
            for item in flat
        ]
    return flat.tolist()


def error_body(message: str) -> bytes:
    """Triton's HTTP error body."""
    return json.dumps({"error": message}).encode()


def error_response(exc: BaseException) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Triton's HTTP error response to ``exc``: (the code's status, headers, ``{"error": ...}``)."""
    error = as_serving_error(exc)
    return http_status(error.code), [(b"content-type", b"application/json")], error_body(error.message)
