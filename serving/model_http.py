"""KServe v2 HTTP over a :class:`ModelCore`: the model routes, as (status, headers, body).

Serve's ingress in the model replica and the replica's own listener both answer through
:func:`respond`; errors come back in Triton's form (the code's status, ``{"error": ...}``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from rayinfer.protocol.compression import compress_body, decompress_off_loop, response_encoding
from rayinfer.protocol.errors import InvalidArgError, NotFoundError, ServingError, UnsupportedError
from rayinfer.protocol.http_codec import error_response, raw_request, request_from_http, response_to_http
from rayinfer.protocol.limits import DEFAULT_HTTP_MAX_INPUT_SIZE
from rayinfer.protocol.listener_client import TRACE_PARENT_HEADER, stream_frame
from rayinfer.protocol.shared_memory import RegionMissing, decode_with_regions
from rayinfer.protocol.statistics import stats_to_json
from rayinfer.protocol.types import InferRequest
from rayinfer.serving.model_core import ModelCore
from rayinfer.serving.model_generate import generate
from rayinfer.serving.routes import HEADER_LENGTH, POST_ACTIONS, ModelRoute
from rayinfer.serving.sequence_routing import FORWARDED_HEADER

HttpResponse = tuple[int, list[tuple[bytes, bytes]], bytes]
# An answer whose body comes in chunks as it is made.
StreamedAnswer = tuple[int, list[tuple[bytes, bytes]], AsyncIterator[bytes]]
_OCTET = (b"content-type", b"application/octet-stream")
_JSON = (b"content-type", b"application/json")


def _text(value: bytes | None) -> str | None:
    return value.decode("latin-1") if value is not None else None


def _json(doc: Any) -> HttpResponse:
    return 200, [_JSON], json.dumps(doc, separators=(",", ":")).encode()


def unknown_version(core: ModelCore, route: ModelRoute) -> NotFoundError | None:
    """Triton's error when ``route`` names another model or version than ``core`` serves."""
    if route.model != core.name:
        return NotFoundError(f"Request for unknown model: '{route.model}' is not found")
    if route.version and route.version != core.version:
        return NotFoundError(f"Request for unknown model: '{core.name}' version {route.version} is not found")
    return None


async def respond(core: ModelCore, method: str, route: ModelRoute, headers: dict[bytes, bytes],
                  body: bytes, max_input_size: int = DEFAULT_HTTP_MAX_INPUT_SIZE) -> HttpResponse | StreamedAnswer:
    """The answer to one model route (``headers``: those of :data:`routes.REQUEST_HEADERS`;
    ``max_input_size``: the largest body, decompressed, an infer request may have); a
    ``generate_stream``'s body comes in chunks."""
    error = unknown_version(core, route)
    if error is not None:
        return error_response(error)
    if route.action == "infer" and method == "POST":
        return await infer(core, headers, body, max_input_size)
    if route.action in POST_ACTIONS and method == "POST":  # the generate extension
        return await generate(core, headers, body, max_input_size, route.action == "generate_stream")
    if method != "GET" or route.action in POST_ACTIONS:
        return error_response(NotFoundError(f"Not Found: {method} {_path(route)}"))
    if route.action == "":
        return _json(core.metadata)
    if route.action == "ready":
        return (200 if await core.ready() else 400), [], b""
    if route.action == "config":
        return _json(core.config_json)
    # "stats"
    try:
        figures = await core.statistics(route.version)
    except Exception as exc:
        return error_response(exc)
    return _json({"model_stats": [stats_to_json(core.name, version, snap) for version, snap in figures]})


async def infer(core: ModelCore, headers: dict[bytes, bytes], body: bytes,
                max_input_size: int = DEFAULT_HTTP_MAX_INPUT_SIZE) -> HttpResponse:
    """A v2 infer request's response; a request rejected before the model is not counted."""
    try:
        if core.decoupled:
            raise UnsupportedError("HTTP end point doesn't support models with decoupled transaction policy")
        request = await _decode(core, headers, body, max_input_size)
    except Exception as exc:
        return error_response(exc)
    request.forwarded = FORWARDED_HEADER in headers  # by another replica: this one holds the sequence
    request.trace_parent = _text(headers.get(TRACE_PARENT_HEADER))  # a traced ensemble's step
    return await _answer(core, request, headers)


async def stream_forwarded(core: ModelCore, headers: dict[bytes, bytes], body: bytes, max_input_size: int
                           ) -> tuple[int, list[tuple[bytes, bytes]], bytes | AsyncIterator[bytes]]:
    """A decoupled model's request that another replica sent on (this replica holds its
    sequence): each response as it comes, a frame of a chunked body
    (:func:`~rayinfer.protocol.listener_client.stream_frame`); one error response when the
    request is refused before the model."""
    try:
        request = await _decode(core, headers, body, max_input_size)
        request.forwarded = True
        prepared = core.prepare(request)
    except Exception as exc:
        return error_response(exc)

    async def frames() -> AsyncIterator[bytes]:
        async for result in core.stream(prepared):
            try:
                if isinstance(result, ServingError):
                    raise result
                status, (payload, json_length) = 200, response_to_http(result, request, core.shm)
            except Exception as exc:  # the model's error, or an output that cannot be written
                status, _, payload = error_response(exc)
                json_length = None
            yield stream_frame(status, json_length, payload)

    return 200, [], frames()


async def _decode(core: ModelCore, headers: dict[bytes, bytes], body: bytes, max_input_size: int) -> InferRequest:
    """The request in an infer request's body (raises its error)."""
    body = await decompress_off_loop(body, _text(headers.get(b"content-encoding")), max_input_size)
    raw_length = _text(headers.get(HEADER_LENGTH))
    try:
        header_length = int(raw_length) if raw_length is not None else None
    except ValueError:
        raise InvalidArgError(f"invalid Inference-Header-Content-Length '{raw_length}'") from None
    if header_length == 0:  # a raw binary request: the body is the one input's data
        spec = core.spec
        request = raw_request(body, core.name, core.version,
                              [(t.name, t.datatype, t.dims) for t in spec.inputs], spec.max_batch_size > 0)
    else:
        try:
            request = request_from_http(body, header_length, core.name, core.version, core.shm)
        except RegionMissing:  # a shared memory region this replica has not mapped yet
            request = await decode_with_regions(
                core.shm, lambda: request_from_http(body, header_length, core.name, core.version, core.shm))
    return request


async def _answer(core: ModelCore, request: InferRequest, headers: dict[bytes, bytes]) -> HttpResponse:
    """Prepare, run and encode a decoded request."""
    try:
        prepared = core.prepare(request)
    except Exception as exc:
        return error_response(exc)
    try:
        payload, json_length = response_to_http(await core.infer(prepared), request, core.shm)
    except Exception as exc:  # execution failures are counted by the executor
        return error_response(exc)
    extra = [_JSON] if json_length is None else [_OCTET, (HEADER_LENGTH, str(json_length).encode())]
    encoding = response_encoding(_text(headers.get(b"accept-encoding")))
    if encoding is not None:
        payload = compress_body(payload, encoding)
        extra.append((b"content-encoding", encoding.encode()))
    return 200, extra, payload


def _path(route: ModelRoute) -> str:
    version = f"/versions/{route.version}" if route.version else ""
    action = f"/{route.action}" if route.action else ""
    return f"/v2/models/{route.model}{version}{action}"
