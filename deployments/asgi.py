"""Minimal ASGI plumbing for the v2 endpoints: body reading and JSON/binary responses.

A model replica's Serve ingress speaks ASGI directly (its routes are the model's, parsed by
:func:`~rayinfer.serving.routes.parse_model_route`); the ``/v2`` replica's go through a
Starlette router (:mod:`v2_http`). Both answer with these helpers.
"""

from __future__ import annotations

import json
from typing import Any
from collections.abc import AsyncIterator, Awaitable, Callable

from rayinfer.protocol.errors import ServingError
from rayinfer.protocol.grpc_wire import SERVICE
from rayinfer.protocol.http_codec import error_response
from rayinfer.protocol.limits import DEFAULT_HTTP_MAX_INPUT_SIZE, body_too_large
from rayinfer.protocol.restricted_api import Restrictions, http_message, missing_header

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_JSON = (b"content-type", b"application/json")


async def read_body(receive: Receive, limit: int = DEFAULT_HTTP_MAX_INPUT_SIZE,
                    too_large: Callable[[int], Exception] = body_too_large) -> bytes:
    """The whole request body; ``too_large(limit)`` (:class:`BodyTooLarge`) raised as soon as it
    passes ``limit`` bytes."""
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def header(scope: Scope, name: bytes) -> bytes | None:
    """Value of a request header (``name`` lower-case)."""
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


async def send_bytes(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """Send a complete response."""
    all_headers = [(b"content-length", str(len(body)).encode())]
    if headers:
        all_headers.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": all_headers})
    await send({"type": "http.response.body", "body": body})


async def send_chunks(send: Send, status: int, chunks: AsyncIterator[bytes],
                      headers: list[tuple[bytes, bytes]]) -> None:
    """Send a response whose body comes in chunks, each as it is made."""
    await send({"type": "http.response.start", "status": status, "headers": headers})
    try:
        async for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()
    await send({"type": "http.response.body", "body": b""})


async def send_json(send: Send, status: int, doc: Any) -> None:
    await send_bytes(send, status, json.dumps(doc, separators=(",", ":")).encode(), [_JSON])


async def send_error(send: Send, error: ServingError) -> None:
    """Triton's error response: the code's HTTP status and ``{"error": message}``."""
    status, headers, body = error_response(error)
    await send_bytes(send, status, body, headers)


async def refuse_restricted(send: Send, restrictions: tuple[Restrictions, Restrictions] | None, path: str,
                            headers: list[tuple[bytes, bytes]]) -> bool:
    """--http-restricted-api at Serve's HTTP ingress, as the front checks it: a request to a
    restricted group without its header gets 403 and Triton's message (True when answered)."""
    if not restrictions or not any(restrictions):
        return False
    key = missing_header(*restrictions, path, dict(headers), SERVICE)
    if key is None:
        return False
    await send_json(send, 403, {"error": http_message(key)})
    return True


async def send_empty(send: Send, status: int) -> None:
    await send_bytes(send, status, b"")


async def handle_lifespan(receive: Receive, send: Send) -> None:
    """Answer ASGI lifespan events (nothing to start or stop)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def asgi3(handler: Callable[[Scope, Receive, Send], Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """Wrap a bound method so uvicorn recognises it as an ASGI 3 application."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await handler(scope, receive, send)

    return app
