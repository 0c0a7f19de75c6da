"""A request on a client's connection from the front's acceptor that its replica does not answer:
relayed to the front's HAProxy, and its answer streamed back to the client.

The acceptor gives a connection to a replica by its first request (:mod:`acceptor`); the client
may then ask for anything on it (readiness, another model, the repository API). The replica's
listener (:mod:`replica_listener`) sends such a request, unchanged but for its hop-by-hop
headers, to HAProxy's Unix socket with ``connection: close``, and writes the answer back with
the connection's own keep-alive. A gRPC call (:func:`relay_grpc`; at a rollout's split, every
call picked for the other version) goes as HTTP/1.1 on a connection kept for the next one. A
request that stops the replica itself (unloading its model) is answered only once the replica is
gone: a replica that stops while a relayed answer has not begun hands both connections to the
acceptor (:meth:`RelayedRequest.hand_over`), which copies the answer to the client, then
closes it.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httptools

from rayinfer.protocol.front_key import FRONT_KEY_HEADER
from rayinfer.protocol.listener_client import STREAM_HEADER, TRACE_PARENT_HEADER
from rayinfer.transport import handoff
from rayinfer.transport.handoff_messages import Splice
from rayinfer.serving.sequence_routing import FORWARDED_HEADER

# Headers of a client's request not copied when it is relayed (names compared in lower case):
# hop-by-hop ones, and those only the server's own parts may set.
_HOP_HEADERS = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"content-length", b"transfer-encoding",
                          b"expect", b"te", b"upgrade", STREAM_HEADER, TRACE_PARENT_HEADER, FORWARDED_HEADER,
                          FRONT_KEY_HEADER})
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_BAD_VALUE = re.compile(rb"[\x00\r\n]")
_GATEWAY_ERROR = b'{"error":"the front did not answer a relayed request"}'
_BAD_GATEWAY = (b"HTTP/1.1 502 Bad Gateway\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%b" % (len(_GATEWAY_ERROR), _GATEWAY_ERROR))


def relayed_fields(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The fields of a client's request that are copied when it is relayed: not hop-by-hop nor
    the server's own (case-insensitively), and only those whose name is a token and whose value
    holds no CR, LF or NUL, so that no client byte can become framing on the relay connection
    (the parsers in front of it refuse such fields already; this holds whatever reaches here)."""
    return [(name, value) for name, value in headers
            if name.lower() not in _HOP_HEADERS and _TOKEN.match(name) and not _BAD_VALUE.search(value)]


class _Upstream(asyncio.Protocol):
    """The connection to HAProxy: what it answered so far."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.buffer = bytearray()
        self.ended = False
        self.changed = asyncio.Event()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self.changed.set()

    def eof_received(self) -> bool:
        self.ended = True
        self.changed.set()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self.changed.set()

    async def wait(self) -> None:
        self.changed.clear()
        if not self.ended:
            await self.changed.wait()


class RelayedRequest:
    """One request relayed to the front's HAProxy at ``socket_path``."""

    def __init__(self, socket_path: str, method: bytes, url: bytes, headers: list[tuple[bytes, bytes]],
                 body: bytes) -> None:
        self._socket_path = socket_path
        head = [b"%b %b HTTP/1.1\r\n" % (method, url)]
        head += [b"%b: %b\r\n" % field for field in relayed_fields(headers)]
        # A request with neither Content-Length nor Transfer-Encoding has no body, so one without
        # a body gets only Connection, and one with a body has the client's Content-Length or
        # Transfer-Encoding replaced: a head at the 100-header limit stays within the 101 headers
        # Serve's ingress (HAProxy's default) takes, when the front passes the request on there.
        if body:
            head.append(b"content-length: %d\r\n" % len(body))
        head.append(b"connection: close\r\n\r\n")
        self._request = b"".join(head) + body
        self._upstream: _Upstream | None = None
        self._answering = False  # the answer's head was written to the client
        self.handed_over = False

    async def answer(self, client: Any, keep_alive: bool,
                     writable: Callable[[], Awaitable[None] | None] | None = None) -> bool:
        """Relay the request and write the answer to ``client`` (a transport); whether the
        client's connection stays open afterwards. With ``writable`` (None while the client
        takes what is written, else what to await), HAProxy's answer is not read while the
        client does not take it: what is held of it stays bounded."""
        loop = asyncio.get_running_loop()
        try:
            _, self._upstream = await loop.create_unix_connection(_Upstream, self._socket_path)
            upstream = self._upstream
            upstream.transport.write(self._request)
            while (end := upstream.buffer.find(b"\r\n\r\n")) < 0:
                if upstream.ended or self.handed_over:
                    raise ConnectionError("the front closed the connection before its answer")
                await upstream.wait()
            status_line, *lines = bytes(upstream.buffer[:end]).split(b"\r\n")
            del upstream.buffer[:end + 4]
            names = {line.partition(b":")[0].strip().lower() for line in lines}
            chunked = any(line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower()
                          for line in lines)
            keep_alive = keep_alive and (b"content-length" in names or chunked)
            lines = [line for line in lines if not line.lower().startswith((b"connection:", b"keep-alive:"))]
            if not keep_alive:
                lines.append(b"connection: close")
            client.write(b"\r\n".join([status_line, *lines]) + b"\r\n\r\n")
            self._answering = True
            while True:
                if upstream.buffer:
                    client.write(bytes(upstream.buffer))
                    upstream.buffer.clear()
                    if writable is not None and (paused := writable()) is not None:
                        upstream.transport.pause_reading()
                        await paused
                        upstream.transport.resume_reading()
                if upstream.ended:
                    break
                await upstream.wait()
        except (OSError, ConnectionError):
            if self.handed_over:
                return False
            if not self._answering:
                client.write(_BAD_GATEWAY)
            keep_alive = False
        finally:
            if self._upstream is not None and self._upstream.transport is not None:
                self._upstream.transport.close()
        return keep_alive and not self.handed_over

    def hand_over(self, client_fd: int, folder_name: str) -> bool:
        """The replica stops: give the client's connection and HAProxy's to the acceptor, which
        copies the answer to the client; False once the answer has begun (or nothing waits)."""
        upstream = self._upstream
        sock = upstream.transport.get_extra_info("socket") if upstream is not None and upstream.transport else None
        if self._answering or self.handed_over or sock is None or upstream is None or upstream.ended:
            return False
        upstream.transport.pause_reading()
        fds = [os.dup(client_fd), os.dup(sock.fileno())]
        try:
            given = handoff.give_back(folder_name, fds, Splice(bytes(upstream.buffer)))
        finally:
            for fd in fds:
                os.close(fd)
        if not given:
            upstream.transport.resume_reading()
            return False
        self.handed_over = True
        upstream.transport.close()
        return True


# gRPC's statuses for an HTTP status that came without one (gRPC's "HTTP to gRPC status code
# mapping"): INTERNAL, UNAUTHENTICATED, PERMISSION_DENIED, UNIMPLEMENTED, UNAVAILABLE.
_GRPC_FOR_HTTP = {400: 13, 401: 16, 403: 7, 404: 12, 429: 14, 502: 14, 503: 14, 504: 14}


class _RelayedCall(asyncio.Protocol):
    """A connection to HAProxy that relays gRPC calls as HTTP/1.1, one at a time, kept open
    between them: the answer of the call in flight, read by httptools (its trailers too)."""

    def __init__(self) -> None:
        self.transport: Any = None
        self._parser = httptools.HttpResponseParser(self)
        self._fields: list[tuple[bytes, bytes]] = []
        self._data: list[bytes] = []
        self._done: asyncio.Future | None = None
        self.keep_alive = False
        self.idle_since = 0.0
        self.read_any = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields.append((name.strip().lower(), value.strip()))

    def on_headers_complete(self) -> None:
        self.keep_alive = self._parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self._data.append(body)

    def on_message_complete(self) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result((self._parser.get_status_code(), b"".join(self._data), self._fields))

    def data_received(self, data: bytes) -> None:
        self.read_any = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"the front's answer is not HTTP/1.1: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.keep_alive = False
        self._fail(ConnectionError("the front closed the connection before its answer"))

    def _fail(self, exc: Exception) -> None:
        self.keep_alive = False
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    async def call(self, request: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        """Send ``request``: HAProxy's answer (status, body, header fields and trailers)."""
        self._fields, self._data, self.read_any = [], [], False
        self._done = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        try:
            return await self._done
        finally:
            self._done = None


# Connections to HAProxy kept for the next relayed call, by socket path: at most
# RELAY_IDLE_CONNECTIONS each, none idle longer than RELAY_IDLE_S (well within HAProxy's keep-alive
# timeout, its 30 s "timeout http-request"), so that a call rarely meets one HAProxy is closing.
RELAY_IDLE_CONNECTIONS = 16
RELAY_IDLE_S = 2.0
_IDLE: dict[str, list[_RelayedCall]] = {}


async def _relayed_call(socket_path: str) -> tuple[_RelayedCall, bool]:
    """A connection to HAProxy at ``socket_path`` (an idle one when there is one): whether it was."""
    idle, now = _IDLE.get(socket_path, []), time.monotonic()
    while idle:
        upstream = idle.pop()
        if now - upstream.idle_since < RELAY_IDLE_S and not upstream.transport.is_closing():
            return upstream, True
        upstream.transport.close()
    _, upstream = await asyncio.get_running_loop().create_unix_connection(_RelayedCall, socket_path)
    return upstream, False


def _keep(socket_path: str, upstream: _RelayedCall) -> None:
    idle = _IDLE.setdefault(socket_path, [])
    if upstream.keep_alive and len(idle) < RELAY_IDLE_CONNECTIONS and not upstream.transport.is_closing():
        upstream.idle_since = time.monotonic()
        idle.append(upstream)
    else:
        upstream.transport.close()


async def relay_grpc(socket_path: str, path: bytes, headers: list[tuple[bytes, bytes]],
                     body: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """A unary gRPC call on a client's HTTP/2 connection that its replica does not answer,
    relayed to the front's HAProxy at ``socket_path`` as HTTP/1.1 (as HAProxy itself relays
    calls to replicas) on a kept connection: the answer's framed messages and its trailers
    (``grpc-status`` first)."""
    head = [b"POST %b HTTP/1.1\r\n" % path]
    # HTTP/2's authority is HTTP/1.1's host (Serve's gRPC server refuses a call without one).
    authority = [(b"host", value) for name, value in headers if name == b":authority"]
    head += [b"%b: %b\r\n" % field for field in relayed_fields(authority + [f for f in headers if f[0][:1] != b":"])]
    head.append(b"te: trailers\r\ncontent-length: %d\r\n\r\n" % len(body))
    request = b"".join(head) + body
    for _ in range(2):
        upstream: _RelayedCall | None = None
        answered = False
        try:
            upstream, reused = await _relayed_call(socket_path)
            status, data, fields = await upstream.call(request)
            answered = True
        except (OSError, ConnectionError):
            # HAProxy answers every request it has read, an error included: a kept connection
            # that closed with no byte of an answer was closing before it read this one.
            if upstream is not None and reused and not upstream.read_any:
                continue
            break
        finally:
            if upstream is not None and not answered:  # failed, or the call was cancelled
                upstream.transport.close()
        _keep(socket_path, upstream)
        return _grpc_answer(status, data, fields)
    return b"", [(b"grpc-status", b"14"), (b"grpc-message", b"the front did not answer a relayed call")]


def _grpc_answer(status: int, data: bytes, fields: list[tuple[bytes, bytes]]) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The messages and trailers of HAProxy's answer to a relayed call (its status, body, and
    header fields with its trailers)."""
    trailers = [field for field in fields if field[0].startswith(b"grpc-") and field[0] != b"grpc-encoding"]
    if not any(name == b"grpc-status" for name, _ in trailers):
        code = _GRPC_FOR_HTTP.get(status, 2)  # UNKNOWN
        trailers = [(b"grpc-status", b"%d" % code), (b"grpc-message", b"HTTP status %d from the front" % status)]
    trailers.sort(key=lambda field: field[0] != b"grpc-status")
    return data, trailers
