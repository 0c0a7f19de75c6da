"""One HTTP/1.1 connection of a model replica's listener (:mod:`replica_listener`): over its port
(from the front's HAProxy or another replica), or a client's own from the front's acceptor. It
parses requests with httptools, bounds a request head (:mod:`rayinfer.protocol.limits`) and a
body while they arrive, answers its replica's requests in order, relays a client's other
requests to the front's HAProxy, and gives a client's connection back to the acceptor between
two requests.

A request over the listener's port is served only with the server's front key
(:mod:`rayinfer.protocol.front_key`), checked once its head is whole: without it, a 403 and the
connection closed, before its body is read. The server's internal headers (a stream's, a
sequence's request sent on, a trace's parent, the key) are taken from those requests only; a
client's connection drops them.

Every connection keeps the listener's :class:`~rayinfer.protocol.limits.ConnectionLimits` (over
the port with room for the few headers the front adds to a client's head):

- a request head not received whole within ``request_head_timeout_s`` (from its first byte, or
  for the first request from the connection's start) is answered 408 and the connection closed;
- a connection idle between two requests for ``keepalive_timeout_s`` is closed, and so is one
  whose request body stops arriving for as long (a client gone without closing);
- reading pauses while more than ``max_pipelined_requests`` requests wait behind the one being
  answered (the slice of a read being parsed then is parsed whole: httptools cannot stop within
  it), and while the client has not taken ``connection_buffer_bytes`` of its answers (writing
  paused; no next answer begins); a client that takes none of them for ``send_timeout_s`` is
  disconnected (reset: the answers it left are dropped).

One timer per connection checks these: it keeps the time each deadline counts from (a
request's first byte, the last answer, reading resumed) and re-arms itself, so that the
request path only stores timestamps it takes anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import re
import struct
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import httptools

from rayinfer.transport import handoff
from rayinfer.transport.handoff_messages import GiveBack
from rayinfer.transport.client_connection import WriteFlow
from rayinfer.transport.client_relay import RelayedRequest
from rayinfer.transport.listener_responses import StreamedResponse, grpc_error, http_response
from rayinfer.protocol.errors import UnavailableError
from rayinfer.protocol.front_key import FRONT_KEY_HEADER, forbidden_body
from rayinfer.protocol.http_codec import error_response
from rayinfer.protocol.limits import (
    HEAD_TOO_LARGE,
    MAX_REQUEST_HEAD_BYTES,
    MAX_REQUEST_HEADERS,
    TOO_MANY_HEADERS,
    bad_head_answer,
    body_too_large,
    load_too_large,
    inflight_limit_message,
    message_too_large,
    request_timeout_answer,
)
from rayinfer.protocol.grpc_wire import SERVICE
from rayinfer.protocol.listener_client import STREAM_HEADER, TRACE_PARENT_HEADER
from rayinfer.serving.protocol_stamps import PROTOCOL_STAMPS, TRACEPARENT, ProtocolStamps
from rayinfer.serving.routes import REQUEST_HEADERS
from rayinfer.serving.sequence_routing import FORWARDED_HEADER
from rayinfer.transport.replica_routes import ConnectionRoute

# The replica's ReplicaListener (replica_listener imports this module, so its type is not named here).
ReplicaListener = Any

logger = logging.getLogger(__name__)

SERVICE_PATH = SERVICE.encode()
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# A model load's path: its body over the limit is answered as Triton answers it (500).
_LOAD_PATH = re.compile(rb"^/v2/repository/models/[^/]+/load$")
_BAD_REQUEST = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 29\r\n"
                b"connection: close\r\n\r\n{\"error\":\"malformed request\"}")
# The server's own request headers: taken only from a request over the listener's port (with the
# front key); a client's connection drops them, as the front's HAProxy does.
_INTERNAL_HEADERS = frozenset({STREAM_HEADER, TRACE_PARENT_HEADER, FORWARDED_HEADER, FRONT_KEY_HEADER})
# Request headers kept while parsing: the serving core's, and the relay's own.
_KEPT_HEADERS = REQUEST_HEADERS | {b"grpc-encoding", b"expect", TRACEPARENT, FRONT_KEY_HEADER}
_CLIENT_KEPT_HEADERS = _KEPT_HEADERS - _INTERNAL_HEADERS
# A request head over the listener's port: a client's (checked by HAProxy, or by the replica
# that relayed it) with what the front and a relay add (the key, Content-Length, gRPC's headers).
_ADDED_HEADERS = 8
_ADDED_HEAD_BYTES = 1024
_FORBIDDEN = http_response(403, [(b"content-type", b"application/json"), (b"connection", b"close")], forbidden_body())
# A client's connection from the front's acceptor is given back to the acceptor after this long, between
# two requests, which gives it to a replica again (rebalancing): connections spread over replicas that
# started since (a scale-up, a replacement).
_REBALANCE_S = 2.0
# How long a connection whose request was refused for its size still reads (and drops) the rest
# of the body after the answer, so that the front reads the answer before the connection closes.
_DRAIN_S = 5.0
# A client's reads longer than this are parsed a slice at a time (a request head's limit: it costs
# large bodies nothing measurable), so that reading can pause between two slices.
_SLICE_BYTES = MAX_REQUEST_HEAD_BYTES
# SO_LINGER on, for 0 s: closing the socket resets the connection.
_NO_LINGER = struct.pack("ii", 1, 0)
# The shortest wait of a connection's limits timer (limits of 0 do not make it spin).
_MIN_TIMER_NS = 1_000_000


@dataclass(slots=True)
class PendingRequest:
    """A request read whole, waiting for its answer (requests are answered in order)."""

    path: bytes
    headers: dict[bytes, bytes]  # those kept (:data:`_KEPT_HEADERS`)
    body: bytes
    keep_alive: bool  # the connection stays open after its answer
    method: bytes
    received_ns: int  # its first byte (perf_counter_ns)
    read_ns: int  # its last byte
    # A client's request that is not this replica's: (its URL, all its headers) to relay it.
    relay: tuple[bytes, list[tuple[bytes, bytes]]] | None


class ListenerConnection(asyncio.Protocol):
    """One HTTP/1.1 connection over the listener's port (the front's, another replica's), or
    (``relay``: the front HAProxy's socket that takes a client's other requests; ``route``: which
    requests are this replica's) a client's from the front's acceptor; requests are answered in
    the order received."""

    def __init__(self, listener: ReplicaListener, relay: str | None = None, route: ConnectionRoute | None = None) -> None:
        self._listener = listener
        self._direct = relay  # a client's connection: the front's relay socket; None over the port
        self._route = route
        # Over the listener's port: each request needs the front key and may carry internal headers.
        self._tcp = relay is None
        self._kept = _KEPT_HEADERS if self._tcp else _CLIENT_KEPT_HEADERS
        self._max_head_bytes = MAX_REQUEST_HEAD_BYTES + (_ADDED_HEAD_BYTES if self._tcp else 0)
        self._max_headers = MAX_REQUEST_HEADERS + (_ADDED_HEADERS if self._tcp else 0)
        self._content_length = b""  # the request's, checked against the limit once its head is whole
        self._parser = httptools.HttpRequestParser(self)
        self._transport: Any = None
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._all_headers: list[tuple[bytes, bytes]] = []  # counted; a client's relayed with its request
        self._body: list[bytes] = []
        self._pending: deque[PendingRequest] = deque()
        self._task: asyncio.Task | None = None
        self._body_size = 0
        self._refused = False
        self._reading = False  # between a request's first byte and its end
        self._in_head = False  # between a request's first byte and the end of its headers
        self._head_bytes = 0  # a client's request line and headers parsed so far
        self._head_chunks_bytes = 0  # the chunks wholly in a client's request head so far
        self._began = False  # a request began in the chunk being parsed
        self._recv_start = 0
        self._rebalance_at = time.monotonic() + _REBALANCE_S
        self._relayed: RelayedRequest | None = None  # a request of a client's being relayed
        # The connection's limits' timer and flow control (see the module's docstring).
        self._timer: asyncio.TimerHandle | None = None
        self._sent_ns = 0  # when the last answer began to be written (perf_counter_ns)
        self._body_read_ns = 0  # when the last bytes of a body being read arrived
        self._resumed_ns = 0  # when reading last resumed after a pause
        self._reading_paused = False  # by a full pipeline or by writing paused
        self._unparsed = b""  # read before reading paused, parsed when it resumes
        # Paused while the client has not taken connection_buffer_bytes of its answers.
        self._flow = WriteFlow()

    # asyncio.Protocol

    def connection_made(self, transport: Any) -> None:
        if not self._listener.admit(self):  # over --replica-max-connections
            transport.abort()
            return
        self._transport = transport
        transport.set_write_buffer_limits(high=self._listener.limits.connection_buffer_bytes)
        self._recv_start = time.perf_counter_ns()  # the first request's head counts from here
        self._check_limits()

    def connection_lost(self, exc: Exception | None) -> None:
        self._listener.release(self)
        self._transport = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._flow.wake()
        if self._task is not None:  # the client went away: its request is cancelled
            self._task.cancel()

    def pause_writing(self) -> None:
        """Answers over ``connection_buffer_bytes`` not taken yet: stop reading and answering until
        the peer takes them (:meth:`resume_writing`), or the send timeout ends it."""
        if self._transport is None:
            return
        self._flow.pause(self._transport.get_write_buffer_size())
        self._pause_reading()

    def resume_writing(self) -> None:
        if not self._flow.paused:
            return
        self._flow.resume()
        self._resumed_ns = time.perf_counter_ns()
        self._resume_reading()

    def data_received(self, data: bytes | memoryview) -> None:
        if self._refused:  # the rest of a body refused for its size: dropped
            return
        if len(data) > _SLICE_BYTES:
            self._receive_in_slices(data)
            return
        in_head, self._began = self._in_head, False
        if self._reading and not in_head:  # a body on its way: its silence is timed (_check_limits)
            self._body_read_ns = time.perf_counter_ns()
        try:
            self._parser.feed_data(data)
            if in_head and self._in_head and not self._began and not self._refused:
                # httptools keeps a header until its value ends: a head that does not end is
                # bounded by its chunks (the one it began in, part of it another request's, aside).
                self._head_chunks_bytes += len(data)
                if self._head_chunks_bytes > self._max_head_bytes:
                    self._refuse_head(HEAD_TOO_LARGE)
        except httptools.HttpParserError as exc:
            logger.warning("malformed request from the %s: %s", "client" if self._direct else "front", exc)
            if self._transport is not None:
                self._transport.write(_BAD_REQUEST)
                self._transport.close()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    @property
    def direct(self) -> bool:
        """A client's connection from the front's acceptor."""
        return self._direct is not None

    @property
    def idle(self) -> bool:
        """Between two requests: nothing of the next one read, no answer being written."""
        return self._transport is not None and not self._reading and not self._pending and self._task is None

    def hand_back(self) -> bool:
        """Give a client's connection that is between two requests back to the front's acceptor
        (the listener stops, or the connection is due to be rebalanced); False if it stays here."""
        transport = self._transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is None or self._direct is None or transport.get_write_buffer_size():
            return False
        transport.pause_reading()
        fd = os.dup(sock.fileno())
        # At a rollout's split: where the acceptor places the connection's next version-less
        # request of the model (the other version once its run here ended, else the rest of it).
        move_to = self._route.next_place() if self._route is not None else ""
        try:
            given = handoff.give_back(self._folder_name(), [fd],
                                      GiveBack(self._listener.handoff_name, self._listener.closing, move_to))
        finally:
            os.close(fd)
        if not given:
            transport.resume_reading()
            self._rebalance_at = time.monotonic() + _REBALANCE_S
            return False
        self._direct = None  # the acceptor has it now: closing this descriptor leaves the client's open
        transport.close()
        return True

    def _folder_name(self) -> str:
        """The folder name of the front whose acceptor gave this connection."""
        return os.path.basename(os.path.dirname(self._direct)) if self._direct is not None else ""

    def hand_over_relay(self) -> bool:
        """The listener stops while this connection waits for the front's answer to a relayed
        request: the acceptor copies that answer to the client (:mod:`client_relay`)."""
        relayed, transport = self._relayed, self._transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if relayed is None or sock is None or not relayed.hand_over(sock.fileno(), self._folder_name()):
            return False
        self._direct = None  # the acceptor has it now: closing this descriptor leaves the client's open
        transport.close()
        return True

    # limits and flow control

    def _receive_in_slices(self, data: bytes | memoryview) -> None:
        """Parse a read a slice at a time while reading is not paused, and keep the rest
        unparsed until it resumes: httptools cannot stop within what it is given, so a read of
        many pipelined requests leaves at most a slice's worth parsed past the pipeline's limit."""
        view = memoryview(data)
        for start in range(0, len(view), _SLICE_BYTES):
            if self._reading_paused:
                self._unparsed = bytes(view[start:])
                return
            if self._refused or self._transport is None or self._transport.is_closing():
                return
            self.data_received(view[start:start + _SLICE_BYTES])

    def _check_limits(self) -> None:
        """The connection's timer: close it past a deadline of the listener's current limits,
        else re-arm for the nearest one, at most the shortest timeout away (a deadline that
        begins meanwhile is then not missed). Deadlines count from timestamps the request path
        keeps: a request's first byte, the last answer begun, reading resumed."""
        self._timer = None
        transport = self._transport
        if transport is None or self._refused:
            return
        limits = self._listener.limits
        now = time.perf_counter_ns()
        due = now + _ns(min(limits.request_head_timeout_s, limits.keepalive_timeout_s, limits.send_timeout_s))
        buffered = transport.get_write_buffer_size()
        # Answers the client has not taken, and none being written (the buffer only shrinks):
        # the send timeout counts from when it last took some.
        send_due = self._flow.send_deadline(now, buffered, self._flow.paused or bool(buffered and self._task is None),
                                            limits.send_timeout_s)
        if send_due is not None:
            if now >= send_due:
                logger.info("a %s took none of its answers for %g s (--client-send-timeout): "
                            "disconnected", self._peer, limits.send_timeout_s)
                self._reset(transport)
                return
            due = min(due, send_due)
        if self._task is None and not self._reading_paused and not buffered:  # nothing being answered
            since = max(self._recv_start, self._sent_ns, self._resumed_ns)
            if self._in_head or not (self._reading or self._sent_ns):  # a head, or the first request's
                if now >= (head_due := since + _ns(limits.request_head_timeout_s)):
                    self._time_out_head(limits.request_head_timeout_s)
                    return
                due = min(due, head_due)
            elif not self._reading:  # between two requests
                if now >= (idle_due := since + _ns(limits.keepalive_timeout_s)):
                    transport.close()
                    return
                due = min(due, idle_due)
            else:  # a body on its way: a client that stops sending it (half-open) is dropped
                if now >= (body_due := max(since, self._body_read_ns) + _ns(limits.keepalive_timeout_s)):
                    logger.info("a %s sent nothing of a request body for %g s (--http-keepalive-timeout): "
                                "closed", self._peer, limits.keepalive_timeout_s)
                    transport.close()
                    return
                due = min(due, body_due)
        self._timer = asyncio.get_running_loop().call_later(max(due - now, _MIN_TIMER_NS) / 1e9, self._check_limits)

    @staticmethod
    def _reset(transport: Any) -> None:
        """Drop the connection and what it holds: a reset (no linger) frees the answers the
        client did not take, where a close would wait for the client to take them."""
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _NO_LINGER)
        transport.abort()

    def _time_out_head(self, timeout_s: float) -> None:
        """Answer a request head not received within the timeout with a 408, drop the rest."""
        logger.info("a %s's request head did not arrive within %g s (--http-request-timeout)", self._peer, timeout_s)
        self._answer_and_close(request_timeout_answer(timeout_s))

    def _pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None:
            self._reading_paused = True
            self._transport.pause_reading()

    def _resume_reading(self) -> None:
        """Read again unless writing is paused or more than ``max_pipelined_requests`` requests
        still wait for their answers."""
        if (self._reading_paused and not self._flow.paused and self._transport is not None
                and len(self._pending) <= self._listener.limits.max_pipelined_requests):
            self._reading_paused = False
            self._resumed_ns = time.perf_counter_ns()
            if self._unparsed:  # what was read before the pause comes first; it may pause again
                unparsed, self._unparsed = self._unparsed, b""
                self.data_received(unparsed)
            if not self._reading_paused and self._transport is not None:
                self._transport.resume_reading()

    async def _flow_control(self) -> None:
        """Before the next pipelined request is answered: wait while writing is paused, then
        read again if the pipeline has room."""
        while self._transport is not None and (paused := self._flow.writable()) is not None:
            await paused
        self._resume_reading()

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._body_size = b"", {}, [], 0
        self._reading = self._in_head = self._began = True
        self._head_bytes = self._head_chunks_bytes = 0
        self._all_headers, self._content_length = [], b""
        self._recv_start = time.perf_counter_ns()

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > self._max_head_bytes and not self._refused:
            self._refuse_head(HEAD_TOO_LARGE)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._all_headers.append((name, value))
        self._head_bytes += len(name) + len(value) + 4
        if self._refused:
            return
        if len(self._all_headers) > self._max_headers or self._head_bytes > self._max_head_bytes:
            self._refuse_head(TOO_MANY_HEADERS if len(self._all_headers) > self._max_headers else HEAD_TOO_LARGE)
            return
        name = name.lower()
        if name in self._kept or (name in self._listener.restricted_headers and name not in _INTERNAL_HEADERS):
            self._headers[name] = value
        elif name == b"content-length":
            self._content_length = value

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._refused:
            return
        # Over the listener's port, the server's parts only: the key, then dropped.
        if self._tcp and not self._listener.front_key_matches(self._headers.pop(FRONT_KEY_HEADER, None)):
            self._listener.refused("requests without the front key on the listener's port", self._peer_address())
            self._answer_and_close(_FORBIDDEN)
            return
        if self._content_length.isdigit() and int(self._content_length) > self._limit():
            self._refuse(int(self._content_length))
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

    def _grpc_form(self) -> bool:
        """A gRPC call as the front relays it (over the listener's port); on a client's HTTP
        connection a gRPC method's path is a path like any other."""
        return self._tcp and self._url.startswith(SERVICE_PATH)

    def _limit(self) -> int:
        return self._listener.limits.max_message_bytes + 5 if self._grpc_form() else self._listener.max_input_size

    @property
    def _peer(self) -> str:
        return "client" if self._direct is not None else "peer"

    def _peer_address(self) -> str:
        peer = self._transport.get_extra_info("peername") if self._transport is not None else None
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "?"

    def _refuse_head(self, reason: str) -> None:
        """Answer a request head over a limit (:mod:`limits`) with a 400, drop the rest."""
        self._answer_and_close(bad_head_answer(reason))

    def _answer_and_close(self, answer: bytes) -> None:
        """Answer a request before it is read whole (its head refused), drop what follows, close
        the connection once the peer has had time to read the answer."""
        self._refused = True
        self._all_headers, self._body = [], []
        if self._task is not None:  # the answers before it are dropped with the connection
            self._task.cancel()
        if self._transport is not None:
            self._transport.write(answer)
            self._transport.write_eof()
            self._drain_then_close()

    def _drain_then_close(self) -> None:
        """Read and drop what the client still sends for a while, then close: a connection closed
        with unread data is reset, and the client could lose the answer written before."""
        if self._reading_paused and self._transport is not None:
            self._reading_paused = False
            self._transport.resume_reading()
        asyncio.get_running_loop().call_later(_DRAIN_S, self._close_drained)

    def _close_drained(self) -> None:
        """Close after the drain; reset the connection if the peer has still not taken its answer."""
        if self._transport is not None:
            if self._transport.get_write_buffer_size():
                self._reset(self._transport)
            else:
                self._transport.close()

    def _refuse(self, size: int | None) -> None:
        """Answer a body over the limit at once, drop the rest of it, then close the connection."""
        if self._refused:  # answered already (a head over the limits)
            return
        self._refused = True
        self._body = []
        if self._transport is None:
            return
        if self._grpc_form():
            answer = grpc_error(message_too_large(size if size is not None else self._body_size,
                                                  self._listener.limits.max_message_bytes))
        else:
            too_large = load_too_large if _LOAD_PATH.match(self._url.partition(b"?")[0]) else body_too_large
            status, headers, body = error_response(too_large(self._listener.max_input_size, size))
            answer = http_response(status, headers, body)
        # The connection is not used again: the rest of the body still arrives on it.
        self._transport.write(answer.replace(b"\r\n", b"\r\nconnection: close\r\n", 1))
        if self._task is not None:
            self._task.cancel()
        self._drain_then_close()

    def on_message_complete(self) -> None:
        self._reading = False
        if self._refused:
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        path = self._url.partition(b"?")[0]
        method = self._parser.get_method()
        relay = None
        if self._route is not None and not self._route.http(method.decode("latin-1"), path.decode("latin-1"),
                                                            self._all_headers):
            relay = (self._url, self._all_headers)  # client_relay.relayed_fields drops the internal headers
        self._pending.append(PendingRequest(path, self._headers, body, self._parser.should_keep_alive(), method,
                                            self._recv_start, time.perf_counter_ns(), relay))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._answer_pending())
        elif len(self._pending) > self._listener.limits.max_pipelined_requests:
            self._pause_reading()  # the answer task reads again once the pipeline has room

    async def _answer_pending(self) -> None:
        try:
            while self._pending:
                request = self._pending.popleft()
                path, headers, keep_alive, relay = request.path, request.headers, request.keep_alive, request.relay
                if self._reading_paused:  # a full pipeline, or a client that does not take its answers
                    await self._flow_control()
                if relay is not None:
                    self._relayed = RelayedRequest(self._direct, request.method, *relay, request.body)  # type: ignore[arg-type]
                    try:
                        keep_alive = await self._relayed.answer(self._transport, keep_alive, self._flow.writable)
                    finally:
                        self._relayed = None
                    self._sent_ns = time.perf_counter_ns()
                    if not keep_alive or self._transport is None:
                        if self._transport is not None:
                            self._transport.close()
                        return
                    # Not this replica's request: the acceptor places the connection again by its
                    # next one (a client that asked for readiness first, then infers).
                    if not self._pending and not self._reading and self.hand_back():
                        return
                    continue
                stamps = ProtocolStamps(self._listener.model, path.startswith(SERVICE_PATH), request.received_ns,
                                        request.read_ns, headers.get(TRACEPARENT))
                PROTOCOL_STAMPS.set(stamps)
                response: bytes | StreamedResponse
                if self._listener.in_flight >= self._listener.max_inflight:  # every connection's calls count
                    response = _busy(self._listener, self._tcp and path.startswith(SERVICE_PATH))
                else:
                    response = await self._listener.respond(path, headers, request.body, request.method)
                if self._transport is None:
                    if stamps.finish is not None:  # traced, though the answer goes nowhere
                        stamps.finish(0, 0)
                    return
                self._sent_ns = send_start = time.perf_counter_ns()
                if isinstance(response, StreamedResponse):
                    # An open stream counts in flight (--max-inflight-requests) until it is written.
                    self._listener.in_flight += 1
                    try:
                        written = await response.write(self._transport, self._flow.writable)
                    finally:
                        self._listener.in_flight -= 1
                    if not written:
                        return
                else:
                    self._transport.write(response)
                if stamps.finish is not None:  # a traced request: its trace ends here
                    stamps.finish(send_start, time.perf_counter_ns())
                if not keep_alive:
                    self._transport.close()
                    return
                if (self._direct is not None and not self._pending and not self._reading
                        and (self._listener.closing or (self._route is not None and self._route.run_ended)
                             or time.monotonic() >= self._rebalance_at)
                        and self.hand_back()):
                    return
        finally:
            self._task = None


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _busy(listener: ReplicaListener, grpc: bool) -> bytes:
    """The answer to a request over ``--max-inflight-requests``: 503, or the gRPC form's UNAVAILABLE."""
    message = inflight_limit_message(listener.max_inflight)
    if grpc:
        return grpc_error(UnavailableError(message))
    return http_response(503, [(b"content-type", b"application/json")], b'{"error":"%b"}' % message.encode())
