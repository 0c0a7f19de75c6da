"""The limits a model replica's listener keeps on a client's HTTP/1.1 connection (one the front's
acceptor gave it; :class:`~rayinfer.serving.listener_connection.ListenerConnection`), from the
listener's :class:`~rayinfer.protocol.limits.ConnectionLimits` (HAProxy keeps its own on the
connections it relays):

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

A client's request head over its limits, and a body over the replica's input size on any
connection, is answered at once (400, 413, or gRPC's RESOURCE_EXHAUSTED) and the rest of it read
and dropped for :data:`_DRAIN_S` before the connection closes, so that the answer is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from rayinfer.protocol.grpc_wire import SERVICE
from rayinfer.protocol.http_codec import error_response
from rayinfer.protocol.limits import (
    GRPC_MAX_MESSAGE_SIZE,
    MAX_REQUEST_HEAD_BYTES,
    bad_head_answer,
    body_too_large,
    message_too_large,
    request_timeout_answer,
)
from rayinfer.serving.listener_responses import grpc_error, http_response

logger = logging.getLogger("rayinfer.serving.listener_connection")

SERVICE_PATH = SERVICE.encode()

# How long a connection whose request was refused for its size still reads (and drops) the rest
# of the body after the answer, so that the front reads the answer before the connection closes.
_DRAIN_S = 5.0
# A client's reads longer than this are parsed a slice at a time (a request head's limit: it costs
# large bodies nothing measurable), so that reading can pause between two slices.
SLICE_BYTES = MAX_REQUEST_HEAD_BYTES
# SO_LINGER on, for 0 s: closing the socket resets the connection.
_NO_LINGER = struct.pack("ii", 1, 0)
# The shortest wait of a connection's limits timer (limits of 0 do not make it spin).
_MIN_TIMER_NS = 1_000_000


class ClientLimits:
    """The limits of ``ListenerConnection``, a part of it (its state is set in
    ``ListenerConnection.__init__``): a client's connection's, and a body's size on any."""

    _listener: Any  # the replica's ReplicaListener: its ``limits`` and ``max_input_size``
    _transport: Any
    _direct: tuple[str, str] | None  # a client's connection (else the front's)
    _task: asyncio.Task | None  # answering its requests
    _pending: deque  # requests read, waiting for their answers
    _url: bytes
    _body: list[bytes]
    _body_size: int
    _all_headers: list[tuple[bytes, bytes]]
    _refused: bool  # a request refused: the rest of what the client sends is dropped
    _reading: bool  # between a request's first byte and its end
    _in_head: bool  # between a request's first byte and the end of its headers
    _recv_start: int  # when the request being read began (perf_counter_ns)
    data_received: Callable[[bytes | memoryview], None]

    def _init_limits(self) -> None:
        self._timer: asyncio.TimerHandle | None = None  # the limits' timer
        self._sent_ns = 0  # when the last answer began to be written (perf_counter_ns)
        self._body_read_ns = 0  # when the last bytes of a body being read arrived
        self._resumed_ns = 0  # when reading last resumed after a pause
        self._reading_paused = False  # by a full pipeline or by writing paused
        self._unparsed = b""  # read before reading paused, parsed when it resumes
        self._writing_paused = False  # the client has not taken connection_buffer_bytes of answers
        self._write_resumed: asyncio.Future[None] | None = None  # awaited while writing is paused
        # When the client was last seen taking its answers, and how much of them was buffered then.
        self._send_mark_ns = 0
        self._send_mark_bytes = 0

    def _stop_limits(self) -> None:
        """The connection is gone: its timer stops, and an answer waiting to be written wakes."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._wake_writer()

    def _receive_in_slices(self, data: bytes | memoryview) -> None:
        """Parse a client's read a slice at a time while reading is not paused, and keep the rest
        unparsed until it resumes: httptools cannot stop within what it is given, so a read of
        many pipelined requests leaves at most a slice's worth parsed past the pipeline's limit."""
        view = memoryview(data)
        for start in range(0, len(view), SLICE_BYTES):
            if self._reading_paused:
                self._unparsed = bytes(view[start:])
                return
            if self._refused or self._transport is None or self._transport.is_closing():
                return
            self.data_received(view[start:start + SLICE_BYTES])

    def _check_limits(self) -> None:
        """The connection's timer: close it past a deadline of the listener's current limits,
        else re-arm for the nearest one, at most the shortest timeout away (a deadline that
        begins meanwhile is then not missed). Deadlines count from timestamps the request path
        keeps: a request's first byte, the last answer begun, reading resumed."""
        self._timer = None
        transport = self._transport
        if transport is None or self._direct is None or self._refused:
            return
        limits = self._listener.limits
        now = time.perf_counter_ns()
        due = now + _ns(min(limits.request_head_timeout_s, limits.keepalive_timeout_s, limits.send_timeout_s))
        buffered = transport.get_write_buffer_size()
        if self._writing_paused or (buffered and self._task is None):
            # Answers the client has not taken, and none being written (the buffer only shrinks):
            # the send timeout counts from when it last took some.
            if not self._send_mark_ns or buffered < self._send_mark_bytes:
                self._send_mark_ns, self._send_mark_bytes = now, buffered
            if now >= (send_due := self._send_mark_ns + _ns(limits.send_timeout_s)):
                logger.info("a client took none of its answers for %g s (--client-send-timeout): "
                            "disconnected", limits.send_timeout_s)
                self._reset(transport)
                return
            due = min(due, send_due)
        else:
            self._send_mark_ns = 0
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
                    logger.info("a client sent nothing of a request body for %g s (--http-keepalive-timeout): "
                                "closed", limits.keepalive_timeout_s)
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
        """Answer a client's request head not received within the timeout with a 408, drop the rest."""
        logger.info("a client's request head did not arrive within %g s (--http-request-timeout)", timeout_s)
        self._answer_and_close(request_timeout_answer(timeout_s))

    def _pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None:
            self._reading_paused = True
            self._transport.pause_reading()

    def _resume_reading(self) -> None:
        """Read again unless writing is paused or more than ``max_pipelined_requests`` requests
        still wait for their answers."""
        if (self._reading_paused and not self._writing_paused and self._transport is not None
                and len(self._pending) <= self._listener.limits.max_pipelined_requests):
            self._reading_paused = False
            self._resumed_ns = time.perf_counter_ns()
            if self._unparsed:  # what was read before the pause comes first; it may pause again
                unparsed, self._unparsed = self._unparsed, b""
                self.data_received(unparsed)
            if not self._reading_paused and self._transport is not None:
                self._transport.resume_reading()

    def _writable(self) -> asyncio.Future[None] | None:
        """None while the client takes its answers; else a future done once writing resumes
        (or the connection is lost)."""
        if not self._writing_paused:
            return None
        if self._write_resumed is None:
            self._write_resumed = asyncio.get_running_loop().create_future()
        return self._write_resumed

    def _wake_writer(self) -> None:
        if self._write_resumed is not None:
            if not self._write_resumed.done():
                self._write_resumed.set_result(None)
            self._write_resumed = None

    async def _flow_control(self) -> None:
        """Before the next pipelined request is answered: wait while writing is paused, then
        read again if the pipeline has room."""
        while self._transport is not None and (paused := self._writable()) is not None:
            await paused
        self._resume_reading()

    def _refuse_head(self, reason: str) -> None:
        """Answer a client's request head over a limit (:mod:`limits`) with a 400, drop the rest."""
        self._answer_and_close(bad_head_answer(reason))

    def _answer_and_close(self, answer: bytes) -> None:
        """Answer a client's request before it is read whole (its head refused), drop what
        follows, close the connection once the client has had time to read the answer."""
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
        """Close after the drain; reset a client's connection if it has still not taken its answer."""
        if self._transport is not None:
            if self._direct is not None and self._transport.get_write_buffer_size():
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
        self._drain_then_close()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
