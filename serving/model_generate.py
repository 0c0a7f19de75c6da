"""Triton's generate extension over a :class:`ModelCore` (:mod:`rayinfer.protocol.generate_codec`).

``generate`` answers one JSON object: a model's one response (a decoupled model's too, when it
sends exactly one; else Triton's error). ``generate_stream`` answers server-sent events, one per
response as the model sends it: a decoupled model's each, any other model's one. Its status is
the first response's (200, or the error's); an error after that is an event
(``data: {"error": ...}``) and the stream goes on. A request refused before the model (bad JSON,
a missing input) is a plain JSON error, as for ``infer``. A client that goes away cancels the
request: the model's ``is_cancelled()`` says so (:meth:`ModelCore.stream`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from rayinfer.protocol.compression import decompress_body
from rayinfer.protocol.errors import InvalidArgError, ServingError, as_serving_error, http_status
from rayinfer.protocol.generate_codec import (
    NOT_ONE_RESPONSE,
    SSE_CONTENT_TYPE,
    encode,
    error_event,
    event,
    generate_answer,
    generate_request,
)
from rayinfer.protocol.http_codec import error_response
from rayinfer.protocol.types import InferResponse
from rayinfer.serving.model_core import ModelCore

Headers = list[tuple[bytes, bytes]]
_JSON = (b"content-type", b"application/json")
_SSE = [(b"content-type", SSE_CONTENT_TYPE), (b"cache-control", b"no-cache")]


async def generate(core: ModelCore, headers: dict[bytes, bytes], body: bytes, max_input_size: int,
                   stream: bool) -> tuple[int, Headers, bytes | AsyncIterator[bytes]]:
    """The answer to a generate request (``stream``: ``generate_stream``'s events)."""
    try:
        encoding = headers.get(b"content-encoding")
        body = decompress_body(body, encoding.decode("latin-1") if encoding else None, max_input_size)
        spec = core.spec
        request = generate_request(body, core.name, core.version,
                                   [(t.name, t.datatype, t.dims) for t in spec.inputs], spec.max_batch_size > 0)
        prepared = core.prepare(request)
    except Exception as exc:
        return error_response(exc)
    if stream:
        return await _events(core.stream(prepared))
    try:
        if core.decoupled:
            results = [result async for result in core.stream(prepared)]
            errors = [result for result in results if isinstance(result, ServingError)]
            if errors:
                raise errors[0]
            if len(results) != 1:
                raise InvalidArgError(NOT_ONE_RESPONSE)
            response: Any = results[0]
        else:
            response = await core.infer(prepared)
        return 200, [_JSON], encode(generate_answer(response))
    except Exception as exc:
        return error_response(exc)


async def _events(results: AsyncIterator[InferResponse | ServingError]) -> tuple[int, Headers, AsyncIterator[bytes]]:
    """The stream's status (its first response's) and its events."""
    first = await anext(results, None)
    status = http_status(first.code) if isinstance(first, ServingError) else 200

    async def events() -> AsyncIterator[bytes]:
        result = first
        while result is not None:
            yield _event(result)
            result = await anext(results, None)

    return status, list(_SSE), events()


def _event(result: InferResponse | ServingError) -> bytes:
    if isinstance(result, ServingError):
        return error_event(result.message)
    try:
        return event(generate_answer(result))
    except Exception as exc:  # an output JSON cannot hold
        return error_event(as_serving_error(exc).message)
