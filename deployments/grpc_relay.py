"""A model replica's own listener for the gRPC calls the gRPC front relays to it.

Ray Serve answers gRPC in each replica with grpcio's Python server, which costs about twice
the CPU of the replica's whole HTTP path per call (see docs/benchmarks.md). The gRPC front
(HAProxy) instead hands a routed call to this listener as HTTP/1.1: HAProxy turns the HTTP/2
call into an HTTP/1.1 request with the gRPC-framed message as its body, and turns the chunked
HTTP/1.1 response with ``grpc-status`` and ``grpc-message`` trailers back into a gRPC response.
Parsing is httptools (the parser uvicorn uses); there is no HTTP/2 and no gRPC library on the
replica's side of the call.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import httptools

from rayinfer.protocol.errors import ServingError, as_serving_error, grpc_status_name

logger = logging.getLogger(__name__)

SERVICE_PATH = b"/inference.GRPCInferenceService/"
# Numeric gRPC status codes (https://grpc.github.io/grpc/core/md_doc_statuscodes.html).
_STATUS_NUMBERS = {
    "OK": 0, "CANCELLED": 1, "UNKNOWN": 2, "INVALID_ARGUMENT": 3, "DEADLINE_EXCEEDED": 4, "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6, "PERMISSION_DENIED": 7, "RESOURCE_EXHAUSTED": 8, "FAILED_PRECONDITION": 9,
    "ABORTED": 10, "OUT_OF_RANGE": 11, "UNIMPLEMENTED": 12, "INTERNAL": 13, "UNAVAILABLE": 14,
    "DATA_LOSS": 15, "UNAUTHENTICATED": 16,
}
_RESPONSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\ntransfer-encoding: chunked\r\n\r\n"
_BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"

# (method name, serialized request message) -> serialized response message; raises on error.
Handler = Callable[[str, bytes], Awaitable[bytes]]


def grpc_message_header(message: str) -> bytes:
    """``grpc-message``'s value: UTF-8, percent-encoded outside printable ASCII and for ``%``."""
    return b"".join(
        bytes([b]) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in message.encode()
    )


def grpc_response(message: bytes) -> bytes:
    """A successful call: one uncompressed message frame, then ``grpc-status: 0``."""
    frame_length = 5 + len(message)
    return b"%b%x\r\n\x00%b%b\r\n0\r\ngrpc-status: 0\r\n\r\n" % (
        _RESPONSE_HEAD, frame_length, len(message).to_bytes(4, "big"), message
    )


def grpc_error(status: str, message: str) -> bytes:
    """A failed call: no message, the status and message as trailers."""
    return b"%b0\r\ngrpc-status: %d\r\ngrpc-message: %b\r\n\r\n" % (
        _RESPONSE_HEAD, _STATUS_NUMBERS[status], grpc_message_header(message)
    )


def unframe(body: bytes, encoding: bytes | None) -> bytes:
    """The one message of a unary call's body (gRPC length-prefixed framing)."""
    if len(body) < 5:
        raise _CallError("INTERNAL", "malformed gRPC request: incomplete message frame")
    compressed, length = body[0], int.from_bytes(body[1:5], "big")
    if len(body) != 5 + length:
        raise _CallError("INTERNAL", "malformed gRPC request: expected exactly one message")
    message = body[5:]
    if not compressed:
        return message
    name = (encoding or b"identity").decode("latin-1")
    try:
        if name == "gzip":
            return zlib.decompress(message, wbits=31)
        if name == "deflate":
            return zlib.decompress(message)
    except zlib.error as exc:
        raise _CallError("INTERNAL", f"malformed gRPC request: cannot decompress ({exc})") from None
    raise _CallError("UNIMPLEMENTED", f"gRPC message compression '{name}' is not supported")


class _CallError(Exception):
    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class GrpcRelayListener:
    """Listens on ``host`` (an ephemeral port) and answers unary GRPCInferenceService calls
    relayed as HTTP/1.1 by calling ``handler``."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self.in_flight = 0
        self.port = 0

    async def start(self, host: str) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, 0, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def respond(self, path: bytes, encoding: bytes | None, body: bytes) -> bytes:
        """The whole HTTP/1.1 response to one relayed call."""
        self.in_flight += 1
        try:
            if not path.startswith(SERVICE_PATH):
                raise _CallError("UNIMPLEMENTED", f"unknown gRPC method '{path.decode('latin-1')}'")
            message = unframe(body, encoding)
            return grpc_response(await self._handler(path[len(SERVICE_PATH):].decode("latin-1"), message))
        except _CallError as exc:
            return grpc_error(exc.status, exc.message)
        except Exception as exc:
            error: ServingError = as_serving_error(exc)
            return grpc_error(grpc_status_name(error.code), error.message)
        finally:
            self.in_flight -= 1

    async def close(self, grace_s: float) -> None:
        """Stop accepting, let calls in flight finish (up to ``grace_s``), close connections."""
        if self._server is not None:
            self._server.close()
        deadline = asyncio.get_running_loop().time() + grace_s
        while self.in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        for connection in list(self._connections):
            connection.close()


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection from the front; requests are answered in the order received."""

    def __init__(self, listener: GrpcRelayListener) -> None:
        self._listener = listener
        self._parser = httptools.HttpRequestParser(self)
        self._transport: Any = None
        self._url = b""
        self._encoding: bytes | None = None
        self._body: list[bytes] = []
        self._pending: deque[tuple[bytes, bytes | None, bytes]] = deque()
        self._task: asyncio.Task | None = None

    # asyncio.Protocol

    def connection_made(self, transport: Any) -> None:
        self._transport = transport
        self._listener._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._listener._connections.discard(self)
        self._transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            logger.warning("malformed request from the gRPC front: %s", exc)
            if self._transport is not None:
                self._transport.write(_BAD_REQUEST)
                self._transport.close()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._url, self._encoding, self._body = b"", None, []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"grpc-encoding":
            self._encoding = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._pending.append((self._url, self._encoding, body))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._answer_pending())

    async def _answer_pending(self) -> None:
        try:
            while self._pending:
                response = await self._listener.respond(*self._pending.popleft())
                if self._transport is None:
                    return
                self._transport.write(response)
        finally:
            self._task = None
