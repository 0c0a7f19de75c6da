"""Triton's generate extension: a flat JSON object in, a flat JSON object out.

``POST /v2/models/<model>[/versions/<version>]/generate`` and ``.../generate_stream`` take a
JSON object whose members name the model's inputs or are request parameters, as Triton maps
them: a member named after an input is that input's tensor (a JSON value, or a flat array of
them, of the input's datatype, shaped by the input's dims: the batch dimension 1, the innermost
variable dimension the rest), any other member a request parameter (a string, number or
boolean); the members of ``"parameters"`` are read the same way, and ``"id"`` is the request's
id. An answer is one object: ``model_name``, ``model_version``, ``id`` when the request had one,
the response's parameters, and each output by name (one element as a JSON value, more as a flat
array). ``generate_stream`` sends each answer as a server-sent event (``data: <object>``), an
error as ``data: {"error": ...}``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from rayinfer.protocol.errors import InvalidArgError, ServingError
from rayinfer.protocol.http_codec import array_from_json, json_data, parse_json_body
from rayinfer.protocol.types import InferInput, InferRequest, InferResponse

# (name, datatype, dims) of a model's inputs, as its config gives them.
InputSpecs = Sequence[tuple[str, str, Sequence[int]]]

SSE_CONTENT_TYPE = b"text/event-stream; charset=utf-8"
# The answer to /generate for a decoupled model that sends other than one response (Triton's words).
NOT_ONE_RESPONSE = ("generate expects model to produce exactly 1 response, use generate stream for model that "
                    "generates various number of responses")


def generate_request(body: bytes, model_name: str, model_version: str, inputs: InputSpecs,
                     batched: bool) -> InferRequest:
    """The infer request of a generate request's body (``batched``: the model has a batch
    dimension, max_batch_size > 0)."""
    doc = parse_json_body(body)
    specs = {name: (datatype, [-1, *dims] if batched else list(dims)) for name, datatype, dims in inputs}
    if "parameters" in specs:
        raise InvalidArgError("Keyword 'parameters' for nested schema also given as input tensor name")
    tensors: dict[str, InferInput] = {}
    parameters: dict[str, Any] = {}
    request_id = None
    for key, value in doc.items():
        if key == "parameters":
            if not isinstance(value, dict):
                raise InvalidArgError("Expected JSON object for keyword: 'parameters'")
            for inner, inner_value in value.items():
                try:
                    _member(inner, inner_value, specs, tensors, parameters)
                except ServingError as exc:
                    raise InvalidArgError(f"Converting keyword: 'parameters': {exc.message}") from None
        elif key == "id":
            if not isinstance(value, str):
                raise InvalidArgError("Unable to parse 'id': expected a JSON string")
            request_id = value
        else:
            _member(key, value, specs, tensors, parameters)
    return InferRequest(model_name=model_name, model_version=model_version, id=request_id,
                        inputs=list(tensors.values()), parameters=parameters)


def _member(key: str, value: Any, specs: dict[str, tuple[str, list[int]]], tensors: dict[str, InferInput],
            parameters: dict[str, Any]) -> None:
    spec = specs.get(key)
    if spec is None:  # a request parameter
        if not isinstance(value, (str, int, float, bool)):
            raise InvalidArgError(f"parameter '{key}' has invalid type. It should be either 'int', 'float', "
                                  "'bool', or 'string'.")
        parameters[key] = value
        return
    if key in tensors:
        raise InvalidArgError(f"input '{key}' already exists in request")
    datatype, dims = spec
    count = len(value) if isinstance(value, list) else 1
    shape = _shape(key, dims, count)
    tensors[key] = InferInput(key, datatype, tuple(shape), array_from_json(key, datatype, shape, count, value))


def _shape(name: str, dims: list[int], count: int) -> list[int]:
    """The input's shape for ``count`` values: its fixed dims as they are, the innermost
    variable one the rest, any other variable one (the batch dimension among them) 1."""
    fixed = math.prod(d for d in dims if d >= 0)
    variable = [i for i, d in enumerate(dims) if d < 0]
    if (fixed == 0 and count) or (fixed and count % fixed) or (not variable and count != fixed):
        raise InvalidArgError(f"The schema can not convert input '{name}' to tensor with proper shape")
    shape = [d if d >= 0 else 1 for d in dims]
    if variable:
        shape[variable[-1]] = count // fixed if fixed else 0
    return shape


def generate_answer(response: InferResponse) -> dict[str, Any]:
    """The JSON object of one response."""
    doc: dict[str, Any] = {}
    for output in response.outputs:
        if output.data.size == 0:
            raise InvalidArgError(f"output '{output.name}' has no element to write")
        values = json_data(output.datatype, output.data)
        doc[output.name] = values[0] if len(values) == 1 else values
    for key, value in response.parameters.items():
        if key.startswith("triton_") or isinstance(value, (bytes, dict, list)):
            continue  # the server's own (the final-response flag), and what JSON holds no parameter as
        doc[key] = value
    doc["model_name"], doc["model_version"] = response.model_name, str(response.model_version)
    if response.id:
        doc["id"] = response.id
    return doc


def encode(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def event(doc: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``doc``."""
    return b"data: " + encode(doc) + b"\n\n"


def error_event(message: str) -> bytes:
    return event({"error": message})

