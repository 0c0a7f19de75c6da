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

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from rayinfer.protocol.compression import decompress_off_loop
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
        body = await decompress_off_loop(body, encoding.decode("latin-1") if encoding else None, max_input_size)
        spec = core.spec
        request = generate_request(body, core.name, core.version,
                                   [(t.name, t.datatype, t.dims) for t in spec.inputs], spec.max_batch_size > 0)
        prepared = core.prepare(request)
    except Exception as exc:
        return error_response(exc)
    try:
        if stream:
            return await _events(core.stream(prepared))
        if core.decoupled:
            response: Any = await _one_response(core.stream(prepared))
        else:
            response = await core.infer(prepared)
        return 200, [_JSON], encode(generate_answer(response))
    except Exception as exc:
        return error_response(exc)


async def _one_response(results: AsyncIterator[InferResponse | ServingError]) -> InferResponse:
    """A decoupled model's one response; Triton's error once it sends a second one (the
    request is then cancelled) or ends with none."""
    found: InferResponse | None = None
    async with contextlib.aclosing(results) as responses:  # type: ignore[type-var]
        async for result in responses:
            if isinstance(result, ServingError):
                raise result
            if found is not None:
                raise InvalidArgError(NOT_ONE_RESPONSE)
            found = result
    if found is None:
        raise InvalidArgError(NOT_ONE_RESPONSE)
    return found


async def _events(results: Any) -> tuple[int, Headers, AsyncIterator[bytes]]:
    """The stream's status (its first response's) and its events; ``results``: the model's
    responses (an async generator, closed when the events end or are given up)."""
    try:
        first = await anext(results, None)
    except BaseException:
        await results.aclose()
        raise
    status = http_status(first.code) if isinstance(first, ServingError) else 200

    async def events() -> AsyncIterator[bytes]:
        try:
            result = first
            while result is not None:
                yield _event(result)
                result = await anext(results, None)
        except Exception as exc:  # the stream failed after its first event: its last event says so
            yield error_event(as_serving_error(exc).message)
        finally:
            await results.aclose()  # a client gone: the model's request is cancelled

    return status, list(_SSE), events()


def _event(result: InferResponse | ServingError) -> bytes:
    if isinstance(result, ServingError):
        return error_event(result.message)
    try:
        return event(generate_answer(result))
    except Exception as exc:  # an output JSON cannot hold
        return error_event(as_serving_error(exc).message)
