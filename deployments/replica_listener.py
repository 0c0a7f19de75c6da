"""A model replica's own listener for the inference calls the front relays to it.

Ray Serve answers a request in a replica through uvicorn or grpcio's Python server plus its own
per-request wrapper; on small machines that costs more CPU than the model (see
docs/benchmarks.md). The front (HAProxy, :mod:`front`) instead hands the calls it routes to
this listener as HTTP/1.1:

- KServe v2 ``POST .../infer`` requests, as the client sent them;
- gRPC calls: HAProxy turns the HTTP/2 call into an HTTP/1.1 request with the gRPC-framed
  message as its body, and turns the chunked HTTP/1.1 response with ``grpc-status`` and
  ``grpc-message`` trailers back into a gRPC response.

Parsing is httptools (the parser uvicorn uses); there is no HTTP/2, no ASGI and no gRPC library
on the replica's side of the call.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import grpc
import httptools

from rayinfer.protocol.compression import inflate
from rayinfer.protocol.errors import InternalError, NotFoundError, UnsupportedError, as_serving_error, grpc_status_name
from rayinfer.protocol.http_codec import error_response
from rayinfer.protocol.limits import DEFAULT_HTTP_MAX_INPUT_SIZE, GRPC_MAX_MESSAGE_SIZE, body_too_large, message_too_large
from rayinfer.serving.routes import REQUEST_HEADERS
from rayinfer.serving.trace import PROTOCOL_STAMPS, ProtocolStamps

logger = logging.getLogger(__name__)

SERVICE_PATH = b"/inference.GRPCInferenceService/"
_RESPONSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\ntransfer-encoding: chunked\r\n\r\n"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"

# (method name, serialized request message) -> serialized response message; raises on error.
GrpcHandler = Callable[[str, bytes], Awaitable[bytes]]
# (method, path, lower-case request headers, body) -> (status, extra response headers, body).
HttpHandler = Callable[[str, str, dict[bytes, bytes], bytes], Awaitable[tuple[int, list[tuple[bytes, bytes]], bytes]]]
_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}
# Request headers kept while parsing: the serving core's, and the relay's own.
_KEPT_HEADERS = REQUEST_HEADERS | {b"grpc-encoding", b"expect"}
# How long a connection whose request was refused for its size still reads (and drops) the rest
# of the body after the answer, so that the front reads the answer before the connection closes.
_DRAIN_S = 5.0


def http_response(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """A complete HTTP/1.1 response with a content-length."""
    head = b"".join(b"%b: %b\r\n" % header for header in headers)
    return b"HTTP/1.1 %d %b\r\ncontent-length: %d\r\n%b\r\n%b" % (
        status, _REASONS.get(status, b"Status"), len(body), head, body
    )


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


def grpc_error(exc: BaseException) -> bytes:
    """A failed call: no message; Triton's status for ``exc`` (or the gRPC status it names) and
    its message as trailers."""
    error = as_serving_error(exc)
    status = grpc.StatusCode[getattr(error, "grpc_status", None) or grpc_status_name(error.code)].value[0]
    return b"%b0\r\ngrpc-status: %d\r\ngrpc-message: %b\r\n\r\n" % (
        _RESPONSE_HEAD, status, grpc_message_header(error.message)
    )


def unframe(body: bytes, encoding: bytes | None) -> bytes:
    """The one message of a unary call's body (gRPC length-prefixed framing)."""
    if len(body) < 5:
        raise InternalError("malformed gRPC request: incomplete message frame")
    compressed, length = body[0], int.from_bytes(body[1:5], "big")
    if len(body) != 5 + length:
        raise InternalError("malformed gRPC request: expected exactly one message")
    message = body[5:]
    if not compressed:
        return message
    name = (encoding or b"identity").decode("latin-1")
    if name not in ("gzip", "deflate"):
        raise UnsupportedError(f"gRPC message compression '{name}' is not supported")
    try:
        inflated = inflate(message, 31 if name == "gzip" else 15, GRPC_MAX_MESSAGE_SIZE)
    except zlib.error as exc:
        raise InternalError(f"malformed gRPC request: cannot decompress ({exc})") from None
    if inflated is None:
        raise message_too_large(GRPC_MAX_MESSAGE_SIZE + 1)
    return inflated


class ReplicaListener:
    """Listens on ``host`` (an ephemeral port); answers unary GRPCInferenceService calls relayed
    as HTTP/1.1 with ``grpc_handler`` and every other request with ``http_handler``. A body over
    ``max_input_size`` bytes (gRPC: over gRPC's maximum message) is refused while it arrives."""

    def __init__(self, grpc_handler: GrpcHandler, http_handler: HttpHandler | None = None,
                 max_input_size: int = DEFAULT_HTTP_MAX_INPUT_SIZE, model: str = "") -> None:
        """``model``: the model whose serving core traces this listener's requests with their
        protocol timestamps (:class:`~rayinfer.serving.trace.ProtocolStamps`)."""
        self._grpc_handler = grpc_handler
        self.model = model
        self._http_handler = http_handler
        self.max_input_size = max_input_size
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[_Connection] = set()
        self.in_flight = 0
        self.port = 0

    async def start(self, host: str) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, 0, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def respond(self, path: bytes, headers: dict[bytes, bytes], body: bytes, method: bytes = b"POST") -> bytes:
        """The whole HTTP/1.1 response to one relayed request."""
        self.in_flight += 1
        try:
            if not path.startswith(SERVICE_PATH):
                return await self._respond_http(method, path, headers, body)
            message = unframe(body, headers.get(b"grpc-encoding"))
            return grpc_response(await self._grpc_handler(path[len(SERVICE_PATH):].decode("latin-1"), message))
        except Exception as exc:
            return grpc_error(exc)
        finally:
            self.in_flight -= 1

    async def _respond_http(self, method: bytes, path: bytes, headers: dict[bytes, bytes], body: bytes) -> bytes:
        try:
            if self._http_handler is None:
                raise NotFoundError(f"Not Found: {path.decode('latin-1')}")
            return http_response(*await self._http_handler(method.decode("latin-1"), path.decode("latin-1"),
                                                           headers, body))
        except Exception as exc:
            return http_response(*error_response(exc))

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

    def __init__(self, listener: ReplicaListener) -> None:
        self._listener = listener
        self._parser = httptools.HttpRequestParser(self)
        self._transport: Any = None
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        # (path, headers, body, keep the connection open afterwards, method, received from, to)
        self._pending: deque[tuple[bytes, dict[bytes, bytes], bytes, bool, bytes, int, int]] = deque()
        self._task: asyncio.Task | None = None
        self._body_size = 0
        self._refused = False
        self._recv_start = 0

    # asyncio.Protocol

    def connection_made(self, transport: Any) -> None:
        self._transport = transport
        self._listener._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._listener._connections.discard(self)
        self._transport = None
        if self._task is not None:  # the client went away: its request is cancelled
            self._task.cancel()

    def data_received(self, data: bytes) -> None:
        if self._refused:  # the rest of a body refused for its size: dropped
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            logger.warning("malformed request from the front: %s", exc)
            if self._transport is not None:
                self._transport.write(_BAD_REQUEST)
                self._transport.close()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._body_size = b"", {}, [], 0
        self._recv_start = time.perf_counter_ns()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in _KEPT_HEADERS:
            self._headers[name] = value
        elif name == b"content-length" and value.isdigit() and int(value) > self._limit():
            self._refuse(int(value))

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        if self._headers.get(b"expect", b"").lower() == b"100-continue" and self._transport is not None:
            self._transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        self._body_size += len(body)
        if self._body_size > self._limit():
            self._refuse(None)
            return
        self._body.append(body)

    def _limit(self) -> int:
        return GRPC_MAX_MESSAGE_SIZE + 5 if self._url.startswith(SERVICE_PATH) else self._listener.max_input_size

    def _refuse(self, size: int | None) -> None:
        """Answer a body over the limit at once, drop the rest of it, then close the connection."""
        self._refused = True
        self._body = []
        if self._transport is None:
            return
        if self._url.startswith(SERVICE_PATH):
            answer = grpc_error(message_too_large(size if size is not None else self._body_size,
                                                  GRPC_MAX_MESSAGE_SIZE))
        else:
            status, headers, body = error_response(body_too_large(self._listener.max_input_size, size))
            answer = http_response(status, headers, body)
        # The connection is not used again: the rest of the body still arrives on it.
        self._transport.write(answer.replace(b"\r\n", b"\r\nconnection: close\r\n", 1))
        if self._task is not None:
            self._task.cancel()
        asyncio.get_running_loop().call_later(_DRAIN_S, self.close)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        path = self._url.partition(b"?")[0]
        self._pending.append((path, self._headers, body, self._parser.should_keep_alive(), self._parser.get_method(),
                              self._recv_start, time.perf_counter_ns()))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._answer_pending())

    async def _answer_pending(self) -> None:
        try:
            while self._pending:
                path, headers, body, keep_alive, method, recv_start, recv_end = self._pending.popleft()
                stamps = ProtocolStamps(self._listener.model, path.startswith(SERVICE_PATH), recv_start, recv_end)
                PROTOCOL_STAMPS.set(stamps)
                response = await self._listener.respond(path, headers, body, method)
                if self._transport is None:
                    if stamps.finish is not None:  # traced, though the answer goes nowhere
                        stamps.finish(0, 0)
                    return
                send_start = time.perf_counter_ns()
                self._transport.write(response)
                if stamps.finish is not None:  # a traced request: its trace ends here
                    stamps.finish(send_start, time.perf_counter_ns())
                if not keep_alive:
                    self._transport.close()
                    return
        finally:
            self._task = None
