"""A gRPC stream (``ModelStreamInfer``) that a client starts on a connection a model replica
holds, relayed by that replica to the front's HAProxy over HTTP/2.

The replica does not answer streams itself (the ``/v2`` replica forwards each of a stream's
requests to its model), and it cannot give the connection away once HTTP/2's header tables hold
state. Refusing the stream (a ``GOAWAY`` naming the call before it) makes the client's gRPC
library send it again on a new connection, but grpc's C core (under tritonclient.grpc and
perf_analyzer) then drops a message now and then when some of the stream's messages went out
before the ``GOAWAY`` came and some after: the stream waits forever for that answer. So the
replica keeps the stream and copies it, frame by frame, over a connection of its own to
HAProxy's gRPC socket (stream 1 there), which routes it as it routes a stream from the acceptor.

:class:`StreamRelay` is the HAProxy side of one relayed stream: the client's messages go up as
HAProxy's flow-control window allows (the client's own window is given back only as they go, so
a stream never holds more than its window here), and HAProxy's answers come down to the client's
connection (:class:`RelayedStreams`, the part of
:class:`~rayinfer.serving.replica_h2.H2Connection` that sends them), whose windows pace them
(HAProxy's window is given back as they reach the client). Header blocks are decoded on one side
and sent on as literals on the other. A stream HAProxy refuses, resets or whose connection ends
before its status ends for the client with UNAVAILABLE and a message saying so.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import hpack

from hyperframe.exceptions import HyperframeError
from hyperframe.frame import Frame

from rayinfer.protocol.grpc_wire import (
    ACK, CANCEL, CONTINUATION, DATA, DEFAULT_FRAME_SIZE, DEFAULT_WINDOW, END_STREAM, GOAWAY, HEADERS,
    PING, PREFACE, RESPONSE_HEADERS, RST_STREAM, SETTINGS, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE,
    WINDOW_UPDATE, HeaderDecoder, check_settings, frame, header_frames, literal, settings, window_update,
)

logger = logging.getLogger(__name__)

Fields = list[tuple[bytes, bytes]]

_UP = 1  # the relayed stream's id on HAProxy's connection
_STREAM_WINDOW = 1 << 22  # what HAProxy may send down before the client has read it
_CONNECTION_WINDOW = 1 << 22
_UNAVAILABLE = b"14"


class RelayedStreams:
    """The client's side of relayed streams, a part of ``replica_h2.H2Connection``: what
    :class:`StreamRelay` calls with HAProxy's answers, sent to the client as the client's
    flow-control windows allow. A ``call`` is the connection's call of the stream."""

    _calls: dict[int, Any]
    _transport: Any
    _send_window: int  # what the client lets this side send on the connection
    _max_frame: int
    _client_window: int  # what a client may send on one call before the replica reads it
    _write: Callable[[bytes], None]  # to the client (H2Connection's)
    _ended: Callable[[Any], None]  # a call is over (H2Connection's)
    _release: Callable[[Any, int], None]  # bytes a call held are freed (H2Connection's)
    give_window: Callable[[Any], None]  # a call's window given back (H2Connection's)

    def _current(self, call: Any) -> bool:
        """Whether ``call`` is still the connection's call of its stream."""
        return self._calls.get(call.id) is call

    def relay_sent(self, call: Any, size: int) -> None:
        """``size`` bytes of the client's went up: the client may send as many more."""
        self._release(call, size)
        call.unacked += size
        if call.unacked >= self._client_window // 2 and self._current(call):
            self.give_window(call)

    def relay_headers(self, call: Any, block: bytes) -> None:
        if self._current(call):
            call.answering = True
            self._write(header_frames(call.id, block, False, self._max_frame))

    def relay_data(self, call: Any, data: bytes) -> None:
        call.out += data
        self._flush_relayed(call)

    def relay_end(self, call: Any, fields: Fields) -> None:
        """The stream's trailers (sent once its answers are)."""
        block = encode(fields)
        if not call.answering and not any(name == b":status" for name, _ in fields):
            block = RESPONSE_HEADERS + block  # trailers only
        call.trailers, call.answering = block, True
        self._flush_relayed(call)

    def _flush_relayed(self, call: Any) -> None:
        """Send what the windows allow of a relayed stream's answers (its trailers after them)."""
        if not self._current(call) or self._transport is None:
            return
        out, sent = [], 0
        while call.out and min(self._send_window, call.window) > 0:
            size = min(len(call.out), self._send_window, call.window, self._max_frame)
            out.append(frame(DATA, 0, call.id, bytes(call.out[:size])))
            del call.out[:size]
            self._send_window -= size
            call.window -= size
            sent += size
        ended = not call.out and bool(call.trailers)
        if ended:
            out.append(header_frames(call.id, call.trailers, True, self._max_frame))
        if out:
            self._write(b"".join(out))
        if sent and call.relay is not None:
            call.relay.delivered(sent)
        if ended:
            self._ended(call)


def unavailable(message: bytes) -> Fields:
    return [(b"grpc-status", _UNAVAILABLE), (b"grpc-message", message)]


def encode(fields: Fields) -> bytes:
    return b"".join(literal(name, value) for name, value in fields)


class StreamRelay(asyncio.Protocol):
    """One relayed stream: the connection to HAProxy that carries it, and both directions."""

    def __init__(self, down: RelayedStreams, call: Any) -> None:
        self._down, self._call = down, call
        self._transport: Any = None
        self._buffer = b""
        self._decoder = HeaderDecoder()
        self._block: list[bytes] | None = None  # a header block in CONTINUATIONs
        self._block_ends = False
        self._up = bytearray()  # the client's bytes not sent up yet
        self._up_ends = False  # the client has ended its side: END_STREAM after them
        self._up_ended = False
        self._send_window = self._stream_window = self._initial_window = DEFAULT_WINDOW
        self._max_frame = DEFAULT_FRAME_SIZE
        self._down_unacked = 0  # bytes delivered to the client since the last WINDOW_UPDATEs
        self._answering = False  # HAProxy's response headers came
        self.done = False

    async def open(self, socket_path: str) -> None:
        try:
            await asyncio.get_running_loop().create_unix_connection(lambda: self, socket_path)
        except OSError as exc:
            logger.warning("could not relay a stream to the front (%s): %s", socket_path, exc)
            self._fail(b"the front did not take a relayed stream")

    # the client's side (H2Connection calls these)

    def send(self, data: bytes, end: bool) -> None:
        """The client's DATA for the stream (``end``: its last)."""
        self._up += data
        self._up_ends = self._up_ends or end
        self._flush_up()

    def delivered(self, size: int) -> None:
        """``size`` bytes of HAProxy's DATA reached the client: HAProxy may send as many more."""
        self._down_unacked += size
        if self._down_unacked >= _STREAM_WINDOW // 2 and self._transport is not None:
            self._transport.write(window_update(0, self._down_unacked) + window_update(_UP, self._down_unacked))
            self._down_unacked = 0

    def cancel(self) -> None:
        """The client reset the stream or went away: HAProxy's side is reset and closed."""
        self.done = True
        if self._transport is not None:
            self._transport.write(frame(RST_STREAM, 0, _UP, CANCEL.to_bytes(4, "big")))
            self._transport.close()

    # asyncio.Protocol

    def connection_made(self, transport: Any) -> None:
        if self.done:  # the client went away while it connected
            transport.close()
            return
        self._transport = transport
        headers = encode(self._call.headers)
        transport.write(PREFACE + settings({SETTINGS_INITIAL_WINDOW_SIZE: _STREAM_WINDOW})
                        + window_update(0, _CONNECTION_WINDOW - DEFAULT_WINDOW)
                        + header_frames(_UP, headers, False, DEFAULT_FRAME_SIZE))
        self._flush_up()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._fail(b"the front closed a relayed stream")

    def data_received(self, data: bytes) -> None:
        data = self._buffer + data if self._buffer else data
        view, at = memoryview(data), 0
        try:
            while len(data) - at >= 9 and not self.done:
                parsed, length = Frame.parse_frame_header(view[at:at + 9])
                if len(data) - at - 9 < length:
                    break
                parsed.parse_body(view[at + 9:at + 9 + length])
                at += 9 + length
                self._frame(parsed, length)
        except (HyperframeError, hpack.HPACKError, ValueError) as exc:
            logger.warning("malformed HTTP/2 from the front on a relayed stream: %s", exc)
            self._fail(b"the front answered a relayed stream with malformed HTTP/2")
        self._buffer = data[at:]

    # frames from HAProxy (parsed by hyperframe)

    def _frame(self, parsed: Any, length: int) -> None:
        kind, flags, stream = parsed.type, parsed.flags, parsed.stream_id
        if kind == DATA and stream == _UP:
            self.delivered(length - len(parsed.data))  # padding is never delivered
            if parsed.data:
                self._down.relay_data(self._call, parsed.data)
            if "END_STREAM" in flags:  # no trailers: no status
                self._end([(b"grpc-status", b"13"), (b"grpc-message", b"the front ended a relayed stream without a status")])
        elif kind in (HEADERS, CONTINUATION) and stream == _UP:
            if kind == HEADERS:
                self._block, self._block_ends = [parsed.data], "END_STREAM" in flags
            elif self._block is not None:
                self._block.append(parsed.data)
            if "END_HEADERS" in flags and self._block is not None:
                fields = self._decoder.decode(b"".join(self._block))
                self._block = None
                self._headers(fields, self._block_ends)
        elif kind == SETTINGS and "ACK" not in flags:
            values = parsed.settings
            check_settings(values)
            if SETTINGS_INITIAL_WINDOW_SIZE in values:  # changes the stream's window by the difference
                self._stream_window += values[SETTINGS_INITIAL_WINDOW_SIZE] - self._initial_window
                self._initial_window = values[SETTINGS_INITIAL_WINDOW_SIZE]
            self._max_frame = values.get(SETTINGS_MAX_FRAME_SIZE, self._max_frame)
            self._write(frame(SETTINGS, ACK, 0))
            self._flush_up()
        elif kind == PING and "ACK" not in flags:
            self._write(frame(PING, ACK, 0, parsed.opaque_data))
        elif kind == WINDOW_UPDATE:
            if stream == 0:
                self._send_window += parsed.window_increment
            elif stream == _UP:
                self._stream_window += parsed.window_increment
            self._flush_up()
        elif kind == RST_STREAM and stream == _UP:
            self._fail(b"the front reset a relayed stream (HTTP/2 error %d)" % parsed.error_code)
        elif kind == GOAWAY and parsed.last_stream_id < _UP:
            self._fail(b"the front refused a relayed stream")

    def _headers(self, fields: Fields, ends: bool) -> None:
        if not self._answering and not ends:  # the response's headers
            self._answering = True
            self._down.relay_headers(self._call, encode(fields))
        elif ends:  # the trailers (or a trailers-only response)
            self._answering = True
            self._end(fields)

    # frames to HAProxy

    def _write(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)

    def _flush_up(self) -> None:
        """Send what HAProxy's windows allow of the client's bytes; give the client's window
        back as they go."""
        if self._transport is None or self._up_ended:
            return
        out, sent = [], 0
        while self._up and min(self._send_window, self._stream_window) > 0:
            size = min(len(self._up), self._send_window, self._stream_window, self._max_frame)
            out.append(frame(DATA, 0, _UP, bytes(self._up[:size])))
            del self._up[:size]
            self._send_window -= size
            self._stream_window -= size
            sent += size
        if self._up_ends and not self._up:
            out.append(frame(DATA, END_STREAM, _UP))
            self._up_ended = True
        if out:
            self._transport.write(b"".join(out))
        if sent:
            self._down.relay_sent(self._call, sent)

    # the end

    def _end(self, fields: Fields) -> None:
        if not self.done:
            self.done = True
            self._down.relay_end(self._call, fields)
            if self._transport is not None:
                self._transport.close()

    def _fail(self, message: bytes) -> None:
        self._end(unavailable(message))
