"""A client's gRPC connection (HTTP/2) that the front's acceptor gave a model replica.

The acceptor (:mod:`acceptor`) reads a new connection's first call and passes the connection to a
replica of the model version it names; this protocol then answers, on the replica's event loop,
the unary model calls for that version (``ModelInfer`` and the model's metadata, readiness,
config and statistics) with no process in between. Any other unary call on the connection is
relayed to the front's HAProxy as HTTP/1.1 (:func:`client_relay.relay_grpc`), which routes it
as it routes every call; a stream (``ModelStreamInfer``) is answered here (:mod:`h2_stream`: this
model's requests in the replica, another model's by deployment handle). A call of another service
and a call that may stop this replica (a model load or unload) are not taken here: the
connection is closed to new calls (``GOAWAY`` naming the last call taken) and the client's gRPC
library sends that call again on a new connection, which the acceptor gives HAProxy.

An HTTP/2 connection cannot change hands once its header tables hold state, so a replica never
gives one back to the acceptor: it is rebalanced (when a call ends :data:`_MAX_CONNECTION_AGE_S` or more after
the connection came, so that clients spread over replicas that started since; at a rollout's
split, when the connection's run of version-less calls here ends, so that the acceptor places
the client's next connection for its next run) and stops the way HTTP/2 closes a connection
gracefully: a ``GOAWAY`` with the largest stream id and a
``PING``; once the ``PING`` is answered, every call the client sent before it has arrived, and
a second ``GOAWAY`` names the last of them; once they are answered the replica sends FIN and
reads on, dropping what arrives, until the client closes its end (:meth:`H2Connection._shut_down`).

Frames are parsed by ``hyperframe`` (plain DATA, HEADERS and WINDOW_UPDATE frames by
:func:`~rayinfer.protocol.grpc_wire.parse_frame`, by hyperframe's rules) and header blocks
decoded by ``hpack``; this module keeps the connection's state and RFC 9113's rules with the
limits of :class:`~rayinfer.protocol.limits.ConnectionLimits`: SETTINGS values checked, header
blocks (with their CONTINUATIONs) bounded, ``MAX_CONCURRENT_STREAMS`` advertised and enforced,
the client's receive windows enforced and a call's window held back while the connection holds
more than its bound, budgets for reset streams and control frames, and timeouts for a header
block, an idle connection and a client that does not read. A connection that breaks one gets a
``GOAWAY`` with the RFC's error code and is closed; its calls are cancelled. The ``h2`` library
(4.4.1, its header validation on) takes about 94 us of CPU per unary call on a 2-core machine
(60 us to read a call's frames, 34 us to send its answer), against 112 us that a replica
spends on a whole gRPC call of the Python identity model, this module's part included
(``benchmarks/cpu_per_request.py --protocols grpc --concurrency 8 --model identity_fp32``).
Every gRPC connection through HAProxy instead (as with TLS) costs HAProxy about 52 us per call
while the replica's part drops only from 96 to 92 us (the same model at concurrency 16): 6,171
infer/s against 8,589 on the same machine and sitting.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import hpack
from hyperframe.exceptions import HyperframeError, InvalidFrameError

from rayinfer.transport.client_connection import WriteFlow
from rayinfer.transport.client_relay import relay_grpc
from rayinfer.transport.h2_budgets import FrameBudgets
from rayinfer.transport.h2_stream import ServedStream
from rayinfer.protocol.errors import UnavailableError
from rayinfer.protocol.h2_fields import MalformedFields, check_request, check_trailers
from rayinfer.protocol.grpc_wire import (
    ACK, CONTINUATION, DATA, DEFAULT_FRAME_SIZE, DEFAULT_WINDOW, END_HEADERS, END_STREAM, ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, GOAWAY, HEADERS, MAX_WINDOW, NOT_DIRECT_RPCS, OK_TRAILERS, PING, PREFACE,
    PRIORITY, PROTOCOL_ERROR, PUSH_PROMISE, REFUSED_STREAM, RESPONSE_HEADERS, ROUTED_RPCS, RST_STREAM, SERVICE,
    STREAM_CLOSED,
    SETTINGS, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE, STREAM_RPC, WINDOW_UPDATE, H2ProtocolError, HeaderDecoder, check_settings, frame,
    header_frames, parse_frame,
    goaway, grpc_status, literal, message_frame, name_and_version, reset_stream, settings, trailers,
    unframe_off_loop, window_update, with_version,
)
from rayinfer.protocol.limits import ConnectionLimits, inflight_limit_message, message_too_large
from rayinfer.serving.protocol_stamps import PROTOCOL_STAMPS, ProtocolStamps
from rayinfer.transport.replica_routes import ConnectionRoute, GrpcPlace

logger = logging.getLogger(__name__)

_MAX_CONNECTION_AGE_S = 10.0
_RELAYED_MAX_AGE_S = 1.0  # the turn of a connection with a call relayed
_GOING = b"rayinfer"  # the PING of a graceful close
_PING_WAIT_S = 2.0  # a client that does not answer that PING: the second GOAWAY anyway
_LINGER_S = 5.0  # after the last GOAWAY and answer: how long the client may take to close its end
_FAIL_LINGER_S = 1.0  # a connection closed for an error: how long what the client sends is dropped


class _Call:
    """One call (stream): its request as read, and its answer while it waits for send window."""

    __slots__ = ("id", "headers", "path", "body", "size", "held", "unacked", "deferred", "recv_window", "task", "received",
                 "window", "left", "trailers", "stream", "out", "answering")

    def __init__(self, stream: int, headers: list[tuple[bytes, bytes]], window: int, recv_window: int,
                 path: str = "") -> None:
        self.id = stream
        self.headers = headers
        self.path = path  # the call's :path
        self.body: list[bytes] = []
        self.size = 0  # the message's bytes so far
        self.held = 0  # the flow-controlled bytes this call holds (released when it ends)
        self.unacked = 0  # bytes whose stream window is not given back yet
        self.deferred = 0  # of those, bytes held back while the connection holds too much
        self.recv_window = recv_window  # what the client may still send on the call
        self.task: asyncio.Task | None = None
        self.received = time.perf_counter_ns()
        self.window = window  # what the client lets this side send on the call
        self.left: memoryview | None = None  # the answer's messages not sent yet
        self.trailers = b""
        self.stream: ServedStream | None = None  # a stream (ModelStreamInfer)
        self.out = bytearray()  # a stream's answers not sent yet
        self.answering = False  # a stream's response headers are sent


class H2Connection(asyncio.Protocol):
    """One client's HTTP/2 connection; ``relay``: the Unix socket of the front's HAProxy that
    takes relayed calls; ``route``: which of its calls are this replica's. Past
    ``connection_window_bytes`` held by its calls, only its oldest call still being received
    gets more window: the others hold at most their stream window each."""

    def __init__(self, listener: Any, relay: str, route: ConnectionRoute) -> None:
        """``listener``: the replica's :class:`~rayinfer.transport.replica_listener.ReplicaListener`."""
        self._listener = listener
        self._route = route
        self._limits: ConnectionLimits = listener.limits
        self._relay = relay
        self._transport: Any = None
        self._buffer = b""
        self._preface = False
        self._decoder = HeaderDecoder(self._limits.max_header_list_bytes)
        self._calls: dict[int, _Call] = {}  # open calls: read, or being answered
        self._sending: dict[int, _Call] = {}  # of those, answers waiting for window, and streams
        # A header block in CONTINUATIONs: (stream, flags of its HEADERS, fragments, bytes, started at).
        self._block: tuple[int, bool, list[bytes], int, float] | None = None
        self._highest = 0  # the largest stream id the client opened
        self._last_taken = MAX_WINDOW  # calls above this id are not taken (a GOAWAY named it)
        self._going = 0  # 0 serving, 1 first GOAWAY and PING sent, 2 last GOAWAY sent
        self._shut = False  # all sent (the last GOAWAY, then FIN): what the client sends is dropped
        self._send_window = DEFAULT_WINDOW
        self._initial_window = DEFAULT_WINDOW  # each call's send window at its start
        self._max_frame = DEFAULT_FRAME_SIZE
        self._unacked = 0  # received bytes released, their connection window not given back yet
        # What the client may still send on the connection (its window, as this side gave it).
        self._recv_window = DEFAULT_WINDOW + max(self._limits.connection_window_bytes - DEFAULT_WINDOW, 1)
        self._held = 0  # bytes the open calls hold
        self._deferred_calls = 0  # calls whose window is held back
        self._rebalance_at = time.monotonic() + _MAX_CONNECTION_AGE_S
        self._client_window = self._limits.stream_window_bytes
        self._last_read = time.monotonic()
        self._flow = WriteFlow()  # paused while the client does not read (the write buffer is full)
        self._budgets = FrameBudgets(self._limits)
        self._last_active = self._last_read  # the client's last HEADERS or DATA (PINGs keep nothing open)
        self._timer: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()

    # the listener's view (as of its HTTP/1.1 connections)

    @property
    def direct(self) -> bool:
        return self._transport is not None

    @property
    def idle(self) -> bool:
        return True  # leaving is graceful at any time

    def hand_over_relay(self) -> bool:
        return False

    def hand_back(self) -> bool:
        """Close gracefully: no new calls once the client has seen the GOAWAY; the open ones
        are answered."""
        if self._transport is not None and not self._going:
            self._going = 1
            self._write(goaway(MAX_WINDOW) + frame(PING, 0, 0, _GOING))
            asyncio.get_running_loop().call_later(_PING_WAIT_S, self._last_goaway)
        return True

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _write(self, data: bytes) -> None:
        """Send ``data``, unless the connection is shut (FIN sent): a call that ends after that
        (one refused for its size) has nothing more to say to the client."""
        if self._transport is not None and not self._shut:
            self._transport.write(data)

    # asyncio.Protocol

    def connection_made(self, transport: Any) -> None:
        self._transport = transport
        self._listener.admit(self)
        limits = self._limits
        transport.set_write_buffer_limits(high=limits.connection_buffer_bytes)
        transport.write(settings({SETTINGS_MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams,
                                  SETTINGS_INITIAL_WINDOW_SIZE: limits.stream_window_bytes,
                                  SETTINGS_MAX_HEADER_LIST_SIZE: limits.max_header_list_bytes})
                        + window_update(0, max(limits.connection_window_bytes - DEFAULT_WINDOW, 1)))
        self._timer = asyncio.get_running_loop().call_later(self._check_every(), self._check)

    def connection_lost(self, exc: Exception | None) -> None:
        self._listener.release(self)
        self._transport = None
        if self._timer is not None:
            self._timer.cancel()
        for call in self._calls.values():  # the client went away: its calls are cancelled
            if call.task is not None:
                call.task.cancel()
        self._listener.held_bytes -= self._held
        self._held = 0
        self._calls.clear()
        self._sending.clear()

    def pause_writing(self) -> None:
        """The client does not read its answers: read no more from it until it does."""
        if self._transport is not None:
            self._flow.pause(self._transport.get_write_buffer_size())
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._flow.resume()
        if self._transport is not None:
            self._transport.resume_reading()
            self._flush()

    def data_received(self, data: bytes) -> None:
        if self._shut:
            return  # frames the client sent before it read the GOAWAY: it sends their calls again
        self._last_read = time.monotonic()
        try:
            self._read_frames(self._buffer + data if self._buffer else data)
        except H2ProtocolError as exc:
            logger.warning("closed a client's HTTP/2 connection: %s", exc)
            self._fail(exc.code)
        except InvalidFrameError as exc:
            logger.warning("closed a client's HTTP/2 connection: %s", exc)
            self._fail(FRAME_SIZE_ERROR)
        except (HyperframeError, hpack.HPACKError, ValueError) as exc:
            logger.warning("closed a client's HTTP/2 connection: %s", exc)
            self._fail(PROTOCOL_ERROR)

    def _fail(self, code: int) -> None:
        """End the connection for a client's error: ``GOAWAY`` with ``code`` and FIN, then drop
        what it still sends for :data:`_FAIL_LINGER_S` (so that it reads the GOAWAY) and close;
        its calls are cancelled."""
        if self._transport is not None and not self._shut:
            self._shut = True
            self._transport.write(goaway(self._highest, code))
            self._transport.write_eof()
            asyncio.get_running_loop().call_later(_FAIL_LINGER_S, self._transport.abort)
            for call in list(self._calls.values()):
                self._drop(call)

    # timeouts

    def _check_every(self) -> float:
        limits = self._limits
        return max(min(1.0, limits.request_head_timeout_s / 2, limits.keepalive_timeout_s / 2,
                       limits.send_timeout_s / 2), 0.05)

    def _check(self) -> None:
        """The connection's timeouts: a header block not ended, a client that does not read its
        answers, a connection idle (no call open) or silent (calls waiting for its bytes)."""
        if self._transport is None:
            return
        limits, now = self._limits, time.monotonic()
        if self._block is not None and now - self._block[4] > limits.request_head_timeout_s:
            logger.warning("closed a client's HTTP/2 connection: a header block not ended in %s s "
                           "(--http-request-timeout)", limits.request_head_timeout_s)
            self._fail(ENHANCE_YOUR_CALM)
            return
        now_ns = time.perf_counter_ns()
        send_due = self._flow.send_deadline(now_ns, self._transport.get_write_buffer_size(), self._flow.paused,
                                            limits.send_timeout_s)
        if send_due is not None and now_ns >= send_due:
            logger.warning("closed a client's HTTP/2 connection: its answers not read in %s s "
                           "(--client-send-timeout)", limits.send_timeout_s)
            self._transport.abort()
            return
        if now - self._last_active > limits.keepalive_timeout_s and not self._flow.paused:
            if not self._calls:
                self.hand_back()
            elif any(call.task is None for call in self._calls.values()):
                logger.warning("closed a client's HTTP/2 connection: a call's request not sent on for %s s "
                               "(--http-keepalive-timeout)", limits.keepalive_timeout_s)
                self._fail(ENHANCE_YOUR_CALM)
                return
        for call in self._calls.values():
            if call.stream is not None and now - call.stream.last_active > limits.stream_idle_timeout_s:
                call.stream.expire(limits.stream_idle_timeout_s)
        self._timer = asyncio.get_running_loop().call_later(self._check_every(), self._check)

    # frames in

    def _read_frames(self, data: bytes) -> None:
        at = 0
        if not self._preface:
            if len(data) < len(PREFACE):
                if not PREFACE.startswith(data):
                    raise H2ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self._buffer = data
                return
            if data[:len(PREFACE)] != PREFACE:
                raise H2ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            self._preface, at = True, len(PREFACE)
        view = memoryview(data)
        while len(data) - at >= 9 and self._transport is not None and not self._shut:
            length = int.from_bytes(view[at:at + 3], "big")
            if length > DEFAULT_FRAME_SIZE:  # the largest this side allows (it never raises it)
                raise H2ProtocolError(FRAME_SIZE_ERROR, f"a frame of {length} bytes (SETTINGS_MAX_FRAME_SIZE 16384)")
            if len(data) - at - 9 < length:
                break
            parsed = parse_frame(view, at, length)
            at += 9 + length
            self._frame(parsed, length)
        self._buffer = data[at:] if at < len(data) else b""

    def _frame(self, parsed: Any, length: int) -> None:
        kind, flags, stream = parsed.type, parsed.flags, parsed.stream_id
        if self._block is not None and kind != CONTINUATION:
            raise H2ProtocolError(PROTOCOL_ERROR, "a header block without its CONTINUATION")
        if kind == DATA:
            self._data(parsed, length, "END_STREAM" in flags)
        elif kind == HEADERS:
            ends = "END_STREAM" in flags
            if "END_HEADERS" in flags:
                self._headers(stream, ends, parsed.data)
            else:
                self._block = (stream, ends, [parsed.data], len(parsed.data), time.monotonic())
                self._check_block()
        elif kind == WINDOW_UPDATE:
            self._window_update(stream, parsed.window_increment)
        elif kind == CONTINUATION:
            if self._block is None or self._block[0] != stream:
                raise H2ProtocolError(PROTOCOL_ERROR, "a CONTINUATION of no header block")
            first, ends, fragments, size, started = self._block
            fragments.append(parsed.data)
            self._block = (first, ends, fragments, size + len(parsed.data), started)
            self._check_block()
            if "END_HEADERS" in flags:
                self._block = None
                self._headers(first, ends, b"".join(fragments))
        elif kind == SETTINGS:
            self._budgets.spend(0, 1)
            if "ACK" not in flags:
                self._settings(parsed.settings)
        elif kind == PING:  # a gRPC client's bandwidth probes follow the DATA sent to it
            self._budgets.window_update()
            if "ACK" in flags:
                if parsed.opaque_data == _GOING and self._going == 1:
                    self._last_goaway()
            else:
                self._write(frame(PING, ACK, 0, parsed.opaque_data))
        elif kind == RST_STREAM:
            self._budgets.spend(1, 0)
            if stream > self._highest:
                raise H2ProtocolError(PROTOCOL_ERROR, f"RST_STREAM on stream {stream}, which was never opened")
            call = self._calls.get(stream)
            if call is not None:
                self._drop(call)
            self._maybe_close()
        elif kind == GOAWAY:  # the client opens no more calls
            self._last_taken = min(self._last_taken, self._highest)
            self._going = 2
            self._maybe_close()
        elif kind == PUSH_PROMISE:
            raise H2ProtocolError(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        else:  # PRIORITY and frame types this side does not know: ignored, and counted
            self._budgets.spend(0, 1)
            if kind == PRIORITY and parsed.depends_on == stream:  # RFC 9113 section 5.3.1
                self._reset_stream(stream, PROTOCOL_ERROR)

    def _check_block(self) -> None:
        if self._block is not None and self._block[3] > self._limits.max_header_list_bytes:
            raise H2ProtocolError(ENHANCE_YOUR_CALM, f"a header block over {self._limits.max_header_list_bytes} "
                                  "bytes (--grpc-max-header-list-size)")

    def _settings(self, values: dict[int, int]) -> None:
        check_settings(values)
        if SETTINGS_INITIAL_WINDOW_SIZE in values:
            delta = values[SETTINGS_INITIAL_WINDOW_SIZE] - self._initial_window
            self._initial_window += delta
            for call in self._calls.values():
                call.window += delta
                if call.window > MAX_WINDOW:
                    raise H2ProtocolError(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE took a window over 2^31-1")
        if SETTINGS_MAX_FRAME_SIZE in values:
            self._max_frame = values[SETTINGS_MAX_FRAME_SIZE]
        self._write(frame(SETTINGS, ACK, 0))
        self._flush()

    def _window_update(self, stream: int, increment: int) -> None:
        """A WINDOW_UPDATE: free while it gives back window for DATA this side has sent (two
        for each DATA frame: the stream's and the connection's), else a control frame."""
        self._budgets.window_update()
        if stream > self._highest:
            raise H2ProtocolError(PROTOCOL_ERROR, f"a WINDOW_UPDATE on stream {stream}, which was never opened")
        if stream == 0:
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise H2ProtocolError(FLOW_CONTROL_ERROR, "a WINDOW_UPDATE took the connection's window over 2^31-1")
        elif (call := self._calls.get(stream)) is not None:
            call.window += increment
            if call.window > MAX_WINDOW:
                self._reset(call, FLOW_CONTROL_ERROR)
                return
        self._flush()

    def _headers(self, stream: int, ends: bool, block: bytes) -> None:
        self._last_active = self._last_read
        try:
            headers = self._decoder.decode(block)  # always: the decoder's table follows every block
        except MalformedFields as exc:
            self._malformed(stream, exc)
            return
        call = self._calls.get(stream)
        if call is not None:  # a call's trailers: one block, which ends the call
            self._budgets.spend(0, 1)
            try:
                if not ends:
                    raise MalformedFields("a second header block that does not end the stream")
                check_trailers(headers)
            except MalformedFields as exc:
                self._malformed(stream, exc)
                return
            if call.stream is not None:
                call.stream.feed(b"", True)
            elif call.task is None:
                self._start(call)
            return
        if not stream & 1:
            raise H2ProtocolError(PROTOCOL_ERROR, f"a client opened stream {stream}")
        if stream <= self._highest:
            self._budgets.spend(0, 1)
            return  # a call already answered (or refused)
        self._highest = stream
        if stream > self._last_taken:
            return  # after the GOAWAY: the client sends it again elsewhere
        try:
            check_request(headers)
        except MalformedFields as exc:
            self._malformed(stream, exc)
            return
        if len(self._calls) >= self._limits.max_concurrent_streams:
            self._budgets.spend(1, 0)
            self._write(reset_stream(stream, REFUSED_STREAM))
            return
        path = next((value for name, value in headers if name == b":path"), b"").decode("latin-1")
        if path == SERVICE + STREAM_RPC:
            self._start_stream(stream, headers, ends)
            return
        if not path.startswith(SERVICE) or path[len(SERVICE):] in NOT_DIRECT_RPCS:
            self._not_taken(stream)
            return
        call = self._calls[stream] = _Call(stream, headers, self._initial_window, self._client_window, path)
        if ends:
            self._start(call)

    def _malformed(self, stream: int, exc: MalformedFields) -> None:
        """A malformed request (RFC 9113 section 8.1.1): its stream is reset with PROTOCOL_ERROR,
        counted against the reset-stream budget, and nothing of it goes further."""
        if not stream & 1:
            raise H2ProtocolError(PROTOCOL_ERROR, f"a client opened stream {stream}")
        logger.debug("reset a client's malformed HTTP/2 request on stream %d: %s", stream, exc)
        self._highest = max(self._highest, stream)
        self._reset_stream(stream, PROTOCOL_ERROR)

    def _reset_stream(self, stream: int, code: int) -> None:
        """A stream error of the client's (RFC 9113 section 5.4.2): the stream reset with ``code``,
        its call dropped, counted against the reset-stream budget."""
        self._budgets.spend(1, 0)
        call = self._calls.get(stream)
        if call is not None:
            self._reset(call, code)
        else:
            self._write(reset_stream(stream, code))
        self._maybe_close()

    def _not_taken(self, stream: int) -> None:
        """Close the connection to new calls from ``stream`` on; the client sends them again
        on a new connection."""
        self._last_taken = stream - 2
        self._going = 2
        self._write(goaway(max(stream - 2, 0)))
        self._maybe_close()

    def _data(self, parsed: Any, length: int, ends: bool) -> None:
        self._last_active = self._last_read
        stream = parsed.stream_id
        call = self._calls.get(stream)
        self._recv_window -= length
        if self._recv_window < 0:
            raise H2ProtocolError(FLOW_CONTROL_ERROR, "DATA past the connection's flow-control window")
        self._credit(length)
        if not length and not ends:
            self._budgets.spend(0, 1)
        if call is None:
            if stream > self._highest:  # RFC 9113 section 5.1: DATA on an idle stream
                raise H2ProtocolError(PROTOCOL_ERROR, f"DATA on stream {stream}, which was never opened")
            return  # a call refused, reset or answered: its data is dropped
        if call.task is not None and call.stream is None or call.stream is not None and call.stream.client_ended:
            self._reset_stream(stream, STREAM_CLOSED)  # DATA after the client's END_STREAM (half-closed)
            return
        call.recv_window -= length
        if call.recv_window < 0:
            raise H2ProtocolError(FLOW_CONTROL_ERROR, f"DATA past stream {stream}'s flow-control window")
        self._hold(call, length)
        if call.stream is not None:  # its window comes back as its requests are taken
            if length > len(parsed.data):  # padding
                self.stream_taken(call, length - len(parsed.data))
            call.stream.feed(parsed.data, ends)
            return
        call.size += len(parsed.data)
        if call.size > self._limits.max_message_bytes + 5:
            self._send(call, b"", trailers(*grpc_status(message_too_large(call.size - 5, self._limits.max_message_bytes))))
            self._write(reset_stream(call.id))
            return
        call.body.append(parsed.data)
        if ends:
            self._start(call)
            return
        self._credit_stream(call, length)

    # flow control: a call's window given back as it is received, while the connection holds little

    def _hold(self, call: _Call, size: int) -> None:
        call.held += size
        self._held += size
        self._listener.held_bytes += size

    def _release(self, call: _Call, size: int | None = None) -> None:
        """``size`` bytes a call held (all: the call ended) are freed; calls held back get their
        windows."""
        held = call.held if size is None else min(size, call.held)
        call.held -= held
        if size is None and call.deferred:  # the call ended while held back
            self._deferred_calls -= 1
            call.deferred = 0
        if held:
            self._held -= held
            self._listener.held_bytes -= held
            if self._deferred_calls:
                for other in list(self._calls.values()):
                    if other.deferred:
                        self._credit_stream(other, 0)

    def _credit(self, size: int) -> None:
        """Give ``size`` received bytes back to the connection's window (in steps of half of it);
        what a connection holds is bounded by its calls' windows (:meth:`_credit_stream`)."""
        self._unacked += size
        if self._unacked >= self._limits.connection_window_bytes // 2:
            self._write(window_update(0, self._unacked))
            self._recv_window += self._unacked
            self._unacked = 0

    def _credit_stream(self, call: _Call, size: int) -> None:
        """Give a call's received bytes back to its window, unless the connection holds more than
        ``connection_window_bytes`` (or the replica more than ``replica_buffer_bytes``) and the
        call is not the oldest one still being received, which always may go on so that a
        message larger than the window can arrive. A call held back waits for its window until
        bytes are released (:meth:`_release`)."""
        call.unacked += size
        limits = self._limits
        if ((self._held > limits.connection_window_bytes or self._listener.held_bytes > limits.replica_buffer_bytes)
                and call is not self._oldest_receiving()):
            self._deferred_calls += not call.deferred
            call.deferred = call.unacked
            return
        if call.deferred:
            self._deferred_calls -= 1
            call.deferred = 0
        if call.unacked >= self._client_window // 2 or (size == 0 and call.unacked):
            self.give_window(call)

    def give_window(self, call: _Call) -> None:
        """Give a call's unacknowledged bytes back to its window (a WINDOW_UPDATE)."""
        self._write(window_update(call.id, call.unacked))
        call.recv_window += call.unacked
        call.unacked = 0

    def _oldest_receiving(self) -> _Call | None:
        return next((call for call in self._calls.values() if call.task is None), None)

    # calls

    def _start(self, call: _Call) -> None:
        call.task = self._loop.create_task(self._answer(call))

    def _drop(self, call: _Call) -> None:
        """The client reset a call: its work is cancelled, its bytes released."""
        self._calls.pop(call.id, None)
        self._sending.pop(call.id, None)
        if call.task is not None:
            call.task.cancel()
        self._release(call)

    def _reset(self, call: _Call, code: int) -> None:
        self._write(reset_stream(call.id, code))
        self._drop(call)

    async def _answer(self, call: _Call) -> None:
        received = time.perf_counter_ns()
        path = call.path
        method = path[len(SERVICE):]
        body = call.body[0] if len(call.body) == 1 else b"".join(call.body)
        try:
            message, own, target = b"", False, ""
            if method in ROUTED_RPCS:
                encoding = next((value for name, value in call.headers if name == b"grpc-encoding"), None)
                if encoding is not None and body[:1] == b"\1" and self._listener.in_flight >= self._listener.max_inflight:
                    # A compressed message is refused before it is inflated while the replica is full.
                    raise UnavailableError(inflight_limit_message(self._listener.max_inflight))
                message = await unframe_off_loop(body, encoding, self._limits.max_message_bytes)
                try:
                    place = self._route.grpc(*name_and_version(message), call.headers)
                    own, target = place.own, place.version
                except ValueError:  # not a message of its RPC: the core answers as Triton does
                    own, place = True, GrpcPlace(True, leave=self._route.run_ended)
                if place.leave:
                    # A rollout's run ended here, or this version has no run (its weight went to
                    # none): the acceptor places the connection the client opens next for its
                    # next run. Calls sent before the client read the GOAWAY are answered on
                    # this one.
                    self.hand_back()
            headers = call.headers
            if target:
                # A rollout's call for the other version (its sticky value's, or one after its
                # run): relayed naming that version, which the front routes without splitting it
                # again.
                body = message_frame(with_version(message, target))
                headers = [field for field in headers if field[0] != b"grpc-encoding"]
            elif not own:
                # A connection given for another call than this replica's (a client's first call
                # asked for readiness) is rebalanced soon: the acceptor places it by its next call.
                self._rebalance_at = min(self._rebalance_at, time.monotonic() + _RELAYED_MAX_AGE_S)
            if not own:
                data, fields = await relay_grpc(self._relay, path.encode("latin-1"), headers, body)
                self._send(call, data, b"".join(literal(name, value) for name, value in fields))
                return
            stamps = ProtocolStamps(self._listener.model, True, call.received, received, call.headers)
            PROTOCOL_STAMPS.set(stamps)
            if self._listener.in_flight >= self._listener.max_inflight:
                raise UnavailableError(inflight_limit_message(self._listener.max_inflight))
            reply = await self._listener.call_grpc(method, message)
            send_start = time.perf_counter_ns()
            self._send(call, message_frame(reply), OK_TRAILERS)
            if stamps.finish is not None:  # a traced request: its trace ends here
                stamps.finish(send_start, time.perf_counter_ns())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._send(call, b"", trailers(*grpc_status(exc)))

    # frames out

    def _send(self, call: _Call, data: bytes, trailer_block: bytes) -> None:
        """A call's answer: its messages (``data``, already framed) and trailers."""
        if self._calls.get(call.id) is not call or self._transport is None:
            return  # reset by the client meanwhile
        if not data:  # trailers only
            self._release(call)
            self._write(frame(HEADERS, END_HEADERS | END_STREAM, call.id, RESPONSE_HEADERS + trailer_block))
            self._ended(call)
            return
        call.left, call.trailers = memoryview(data), trailer_block
        self._flush_call(call, [frame(HEADERS, END_HEADERS, call.id, RESPONSE_HEADERS)])

    def _flush_call(self, call: _Call, out: list[bytes]) -> None:
        """Send what the windows allow of a call's answer (its trailers once all is sent)."""
        left = call.left
        assert left is not None
        # No more than the write buffer takes: a client that does not read holds one buffer.
        room = self._limits.connection_buffer_bytes - self._transport.get_write_buffer_size()
        sent = 0
        while left and min(self._send_window, call.window, room) > 0:
            size = min(len(left), self._send_window, call.window, self._max_frame)
            room -= size
            out.append(frame(DATA, 0, call.id, left[:size]))  # type: ignore[arg-type]  # bytes + memoryview
            left = left[size:]
            self._send_window -= size
            call.window -= size
            sent += 1
        self.data_sent(sent)
        call.left = left
        if left:
            self._sending[call.id] = call
        else:
            out.append(frame(HEADERS, END_HEADERS | END_STREAM, call.id, call.trailers))
            self._release(call)  # before the client can see its answer
        if out:
            self._write(b"".join(out))
        if not left:
            self._ended(call)

    def _flush(self) -> None:
        """Send what the windows now allow of the answers that wait for them."""
        if not self._sending or self._flow.paused or self._transport is None:
            return
        for call in list(self._sending.values()):
            if self._send_window <= 0:
                return
            if call.stream is not None:
                self.send_answers(call)
            else:
                self._flush_call(call, [])

    def data_sent(self, frames: int) -> None:
        """``frames`` DATA frames went out (their WINDOW_UPDATEs are free: :class:`FrameBudgets`)."""
        self._budgets.data_sent(frames)

    # streams (:class:`~rayinfer.transport.h2_stream.StreamConnection`)

    def _start_stream(self, stream: int, headers: list[tuple[bytes, bytes]], ended: bool) -> None:
        """A stream: answered here while the replica has fewer than --max-inflight-requests
        calls and streams open (each open stream counts as one), else refused UNAVAILABLE."""
        call = self._calls[stream] = _Call(stream, headers, self._initial_window, self._client_window)
        listener = self._listener
        if listener.in_flight >= listener.max_inflight:
            self._send(call, b"", trailers(*grpc_status(UnavailableError(inflight_limit_message(listener.max_inflight)))))
            self._write(reset_stream(stream))
            return
        call.stream = ServedStream(self, call, listener.stream_grpc)
        self._sending[stream] = call
        if ended:
            call.stream.feed(b"", True)
        listener.in_flight += 1
        call.task = self._loop.create_task(call.stream.answer())
        call.task.add_done_callback(self._stream_done)

    def _stream_done(self, _task: asyncio.Task) -> None:
        self._listener.in_flight -= 1

    @property
    def client_window(self) -> int:
        return self._client_window

    @property
    def max_message_bytes(self) -> int:
        return self._limits.max_message_bytes

    def stream_taken(self, call: _Call, size: int) -> None:
        """``size`` bytes of the client's were taken by the stream's handler: the client may send
        as many more."""
        self._release(call, size)
        call.unacked += size
        if call.unacked >= self._client_window // 2 and self._calls.get(call.id) is call:
            self.give_window(call)

    def begin_answer(self, call: _Call) -> None:
        self._write(header_frames(call.id, RESPONSE_HEADERS, False, self._max_frame))

    def send_answers(self, call: _Call) -> None:
        """Send what the windows allow of a stream's answers (its trailers after them)."""
        if self._calls.get(call.id) is not call or self._transport is None:
            return
        assert call.stream is not None
        out = []
        # No more than the write buffer takes: a client that does not read holds one buffer.
        room = self._limits.connection_buffer_bytes - self._transport.get_write_buffer_size()
        while call.out and min(self._send_window, call.window, room) > 0:
            size = min(len(call.out), self._send_window, call.window, self._max_frame)
            room -= size
            out.append(frame(DATA, 0, call.id, bytes(call.out[:size])))
            del call.out[:size]
            self._send_window -= size
            call.window -= size
        self.data_sent(len(out))
        ended = not call.out and bool(call.trailers)
        if ended:
            out.append(header_frames(call.id, call.trailers, True, self._max_frame))
            if not call.stream.client_ended:  # ended early (an error): the client's side is closed too
                out.append(reset_stream(call.id))
        if out:
            self._write(b"".join(out))
        if ended:
            self._ended(call)
        elif len(call.out) <= self._client_window:
            call.stream.sent.set()

    def _ended(self, call: _Call) -> None:
        self._calls.pop(call.id, None)
        self._sending.pop(call.id, None)
        self._release(call)
        if not self._going and (self._listener.closing or time.monotonic() >= self._rebalance_at):
            self.hand_back()
        self._maybe_close()

    def _last_goaway(self) -> None:
        if self._going == 1 and self._transport is not None:
            self._going = 2
            self._last_taken = self._highest
            self._write(goaway(self._highest))
            self._maybe_close()

    def _maybe_close(self) -> None:
        if self._going == 2 and not self._calls and self._transport is not None and not self._shut:
            self._shut_down()

    def _shut_down(self) -> None:
        """End a connection whose calls are answered, after the last GOAWAY: FIN, then read and
        drop what the client sends until it closes its end (or :data:`_LINGER_S` has passed).
        Closing at once would reset the connection when the client's next frames arrive (a
        call it started before it read the GOAWAY), and a client whose write fails first fails
        that call ("Stream removed (sendmsg: Broken pipe)", UNAVAILABLE) instead of sending it
        again on a new connection, as the GOAWAY tells it to."""
        self._shut = True
        self._buffer = b""
        self._transport.write_eof()
        asyncio.get_running_loop().call_later(_LINGER_S, self.close)
