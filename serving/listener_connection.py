"""One HTTP/1.1 connection of a model replica's listener (:mod:`replica_listener`): from the
front's HAProxy, or a client's own from the front's acceptor. It parses requests with httptools,
bounds a client's request head (:mod:`rayinfer.protocol.limits`) and a body while they arrive,
answers its replica's requests in order, relays a client's other requests to the front's
HAProxy, and gives a client's connection back to the acceptor between two requests.

A client's connection also keeps the listener's :class:`~rayinfer.protocol.limits.ConnectionLimits`
(:mod:`listener_limits`; HAProxy keeps its own on the connections it relays).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from typing import Any

import httptools

from rayinfer.serving import handoff
from rayinfer.serving.client_relay import RelayedRequest
from rayinfer.serving.listener_limits import SLICE_BYTES, SERVICE_PATH, ClientLimits
from rayinfer.serving.listener_responses import StreamedResponse, http_response
from rayinfer.protocol.limits import (
    GRPC_MAX_MESSAGE_SIZE,
    HEAD_TOO_LARGE,
    MAX_REQUEST_HEAD_BYTES,
    MAX_REQUEST_HEADERS,
    TOO_MANY_HEADERS,
    inflight_limit_message,
)
from rayinfer.serving.protocol_stamps import PROTOCOL_STAMPS, TRACEPARENT, ProtocolStamps
from rayinfer.serving.routes import REQUEST_HEADERS
from rayinfer.serving.version_split import ConnectionTurn

# The replica's ReplicaListener (replica_listener imports this module, so its type is not named here).
ReplicaListener = Any

logger = logging.getLogger(__name__)

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_BAD_REQUEST = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 29\r\n"
                b"connection: close\r\n\r\n{\"error\":\"malformed request\"}")
# Request headers kept while parsing: the serving core's, and the relay's own.
_KEPT_HEADERS = REQUEST_HEADERS | {b"grpc-encoding", b"expect", TRACEPARENT}
# A client's connection from the front's acceptor is given back to the acceptor after this long, between
# two requests, which gives it to a replica again (rebalancing): connections spread over replicas that
# started since (a scale-up, a replacement).
_REBALANCE_S = 2.0


class ListenerConnection(ClientLimits, asyncio.Protocol):
    """One HTTP/1.1 connection from the front, or (``direct``: the relay socket of the front's
    HAProxy and the route key it was given for) a client's from the front's acceptor; requests are
    answered in the order received."""

    def __init__(self, listener: ReplicaListener, direct: tuple[str, str] | None = None, run_left: int = 0) -> None:
        self._listener = listener
        self._direct = direct
        self._parser = httptools.HttpRequestParser(self)
        self._transport: Any = None
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._all_headers: list[tuple[bytes, bytes]] = []  # a client's, kept to relay the request
        self._body: list[bytes] = []
        # (path, headers, body, keep the connection open afterwards, method, received from, to,
        #  for a client's request that is not this replica's: (url, all headers) to relay it)
        self._pending: deque[tuple[bytes, dict[bytes, bytes], bytes, bool, bytes, int, int,
                                   tuple[bytes, list[tuple[bytes, bytes]]] | None]] = deque()
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
        self._turn = ConnectionTurn(run_left)  # a client's, at a rollout's split (:mod:`version_split`)
        self._relayed: RelayedRequest | None = None  # a request of a client's being relayed
        self._init_limits()  # a client's connection: its limits' timer and flow control

    # asyncio.Protocol

    def connection_made(self, transport: Any) -> None:
        self._transport = transport
        self._listener._connections.add(self)
        if self._direct is not None:
            transport.set_write_buffer_limits(high=self._listener.limits.connection_buffer_bytes)
            self._recv_start = time.perf_counter_ns()  # the first request's head counts from here
            self._check_limits()

    def connection_lost(self, exc: Exception | None) -> None:
        self._listener._connections.discard(self)
        self._transport = None
        self._stop_limits()
        if self._task is not None:  # the client went away: its request is cancelled
            self._task.cancel()

    def pause_writing(self) -> None:
        """A client's answers over ``connection_buffer_bytes`` not taken yet: stop reading and
        answering until it takes them (:meth:`resume_writing`), or the send timeout ends it."""
        if self._direct is None or self._transport is None:
            return
        self._writing_paused = True
        self._send_mark_ns, self._send_mark_bytes = time.perf_counter_ns(), self._transport.get_write_buffer_size()
        self._pause_reading()

    def resume_writing(self) -> None:
        if not self._writing_paused:
            return
        self._writing_paused = False
        self._resumed_ns = time.perf_counter_ns()
        self._send_mark_ns = 0
        self._wake_writer()
        self._resume_reading()

    def data_received(self, data: bytes | memoryview) -> None:
        if self._refused:  # the rest of a body refused for its size: dropped
            return
        if len(data) > SLICE_BYTES and self._direct is not None:
            self._receive_in_slices(data)
            return
        in_head, self._began = self._in_head, False
        if self._reading and not in_head:  # a body on its way: its silence is timed (_check_limits)
            self._body_read_ns = time.perf_counter_ns()
        try:
            self._parser.feed_data(data)
            if in_head and self._in_head and not self._began and self._direct is not None and not self._refused:
                # httptools keeps a header until its value ends: a head that does not end is
                # bounded by its chunks (the one it began in, part of it another request's, aside).
                self._head_chunks_bytes += len(data)
                if self._head_chunks_bytes > MAX_REQUEST_HEAD_BYTES:
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
        place = self._turn.next_place()
        move_to = f"{self._direct[1]}{place}" if place else ""
        try:
            given = handoff.give_back(self._folder_name(), [fd],
                                         handoff.returned(self._listener.handoff_name, self._listener.closing, move_to))
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
        return os.path.basename(os.path.dirname(self._direct[0])) if self._direct is not None else ""

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

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._body_size = b"", {}, [], 0
        self._reading = self._in_head = self._began = True
        self._head_bytes = self._head_chunks_bytes = 0
        if self._direct is not None:
            self._all_headers = []
        self._recv_start = time.perf_counter_ns()

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._direct is not None and self._head_bytes > MAX_REQUEST_HEAD_BYTES and not self._refused:
            self._refuse_head(HEAD_TOO_LARGE)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._direct is not None:
            self._all_headers.append((name, value))
            self._head_bytes += len(name) + len(value) + 4
            if self._refused:
                return
            if len(self._all_headers) > MAX_REQUEST_HEADERS or self._head_bytes > MAX_REQUEST_HEAD_BYTES:
                self._refuse_head(TOO_MANY_HEADERS if len(self._all_headers) > MAX_REQUEST_HEADERS
                                  else HEAD_TOO_LARGE)
                return
        name = name.lower()
        if name in _KEPT_HEADERS or name in self._listener.restricted_headers:
            self._headers[name] = value
        elif name == b"content-length" and value.isdigit() and int(value) > self._limit():
            self._refuse(int(value))

    def on_headers_complete(self) -> None:
        self._in_head = False
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

    def on_message_complete(self) -> None:
        self._reading = False
        if self._refused:
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        path = self._url.partition(b"?")[0]
        method = self._parser.get_method()
        relay = None
        if self._direct is not None and not self._listener.serves(method.decode("latin-1"), path.decode("latin-1"),
                                                                self._direct[1], self._turn, self._all_headers):
            relay = (self._url, self._all_headers)
        self._pending.append((path, self._headers, body, self._parser.should_keep_alive(), method,
                              self._recv_start, time.perf_counter_ns(), relay))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._answer_pending())
        elif self._direct is not None and len(self._pending) > self._listener.limits.max_pipelined_requests:
            self._pause_reading()  # the answer task reads again once the pipeline has room

    async def _answer_pending(self) -> None:
        try:
            while self._pending:
                path, headers, body, keep_alive, method, recv_start, recv_end, relay = self._pending.popleft()
                if self._reading_paused:  # a full pipeline, or a client that does not take its answers
                    await self._flow_control()
                if relay is not None:
                    self._relayed = RelayedRequest(self._direct[0], method, *relay, body)  # type: ignore[index]
                    try:
                        keep_alive = await self._relayed.answer(self._transport, keep_alive, self._writable)
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
                stamps = ProtocolStamps(self._listener.model, path.startswith(SERVICE_PATH), recv_start, recv_end,
                                        headers.get(TRACEPARENT))
                PROTOCOL_STAMPS.set(stamps)
                response: bytes | StreamedResponse
                if self._direct is not None and self._listener.in_flight >= self._listener.max_inflight:
                    response = http_response(503, [(b"content-type", b"application/json")], _busy(self._listener))
                else:
                    response = await self._listener.respond(path, headers, body, method)
                if self._transport is None:
                    if stamps.finish is not None:  # traced, though the answer goes nowhere
                        stamps.finish(0, 0)
                    return
                self._sent_ns = send_start = time.perf_counter_ns()
                if isinstance(response, StreamedResponse):
                    if not await response.write(self._transport, self._writable):
                        return
                else:
                    self._transport.write(response)
                if stamps.finish is not None:  # a traced request: its trace ends here
                    stamps.finish(send_start, time.perf_counter_ns())
                if not keep_alive:
                    self._transport.close()
                    return
                if (self._direct is not None and not self._pending and not self._reading
                        and (self._listener.closing or self._turn.move_to or time.monotonic() >= self._rebalance_at)
                        and self.hand_back()):
                    return
        finally:
            self._task = None


def _busy(listener: ReplicaListener) -> bytes:
    return b'{"error":"%b"}' % inflight_limit_message(listener.max_inflight).encode()
