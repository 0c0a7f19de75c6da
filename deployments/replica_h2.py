"""A client's gRPC connection (HTTP/2) that the front's door gave a model replica.

The door (:mod:`front_door`) reads a new connection's first call and passes the connection to a
replica of the model version it names; this protocol then answers, on the replica's event loop,
the unary model calls for that version (``ModelInfer`` and the model's metadata, readiness,
config and statistics) with no process in between. Any other unary call on the connection is
relayed to the front's HAProxy as HTTP/1.1 (:func:`client_relay.relay_grpc`), which routes it
as it routes every call; a stream (``ModelStreamInfer``) is relayed to HAProxy over HTTP/2, frame
by frame (:mod:`h2_stream_relay`: refused, it could lose a message). A call of another service
and a call that may stop this replica (a model load or unload) are not taken here: the
connection is closed to new calls (``GOAWAY`` naming the last call taken) and the client's gRPC
library sends that call again on a new connection, which the door gives HAProxy.

An HTTP/2 connection cannot change hands once its header tables hold state, so a replica never
gives one back to the door: it takes its turn (when a call ends :data:`_TURN_S` or more after
the connection came, so that clients spread over replicas that started since) and stops the
way HTTP/2 closes a connection gracefully: a ``GOAWAY`` with the largest stream id and a
``PING``; once the ``PING`` is answered, every call the client sent before it has arrived, and
a second ``GOAWAY`` names the last of them; once they are answered the replica sends FIN and
reads on, dropping what arrives, until the client closes its end (:meth:`H2Connection._shut_down`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import hpack

from rayinfer.deployments.client_relay import relay_grpc
from rayinfer.deployments.h2_stream_relay import RelayedStreams, StreamRelay
from rayinfer.protocol.errors import UnavailableError
from rayinfer.protocol.grpc_wire import (
    ACK, CONTINUATION, DATA, DEFAULT_FRAME_SIZE, DEFAULT_WINDOW, END_HEADERS, END_STREAM, GOAWAY, HEADERS,
    MAX_WINDOW, NOT_DIRECT_RPCS, OK_TRAILERS, PING, PREFACE, PROTOCOL_ERROR, PUSH_PROMISE, RESPONSE_HEADERS, ROUTED_RPCS,
    RST_STREAM, SERVICE, SETTINGS, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE, STREAM_RPC, WINDOW_UPDATE,
    HeaderDecoder, frame, frame_header, goaway, grpc_status, literal, name_and_version,
    parse_settings, settings, trailers, unframe, unpadded, window_update,
)
from rayinfer.protocol.limits import GRPC_MAX_MESSAGE_SIZE, inflight_limit_message, message_too_large
from rayinfer.serving.protocol_stamps import PROTOCOL_STAMPS, ProtocolStamps

logger = logging.getLogger(__name__)

_STREAM_WINDOW = 1 << 22  # what a client may send on one call before the replica reads it
_CONNECTION_WINDOW = 1 << 26
_TURN_S = 10.0
_RELAYED_TURN_S = 1.0  # the turn of a connection with a call relayed
_GOING = b"rayinfer"  # the PING of a graceful close
_PING_WAIT_S = 2.0  # a client that does not answer that PING: the second GOAWAY anyway
_LINGER_S = 5.0  # after the last GOAWAY and answer: how long the client may take to close its end


class _Call:
    """One call (stream): its request as read, and its answer while it waits for send window."""

    __slots__ = ("id", "headers", "body", "size", "unacked", "task", "received", "window", "left", "trailers",
                 "relay", "out", "answering")

    def __init__(self, stream: int, headers: list[tuple[bytes, bytes]], window: int) -> None:
        self.id = stream
        self.headers = headers
        self.body: list[bytes] = []
        self.size = self.unacked = 0
        self.task: asyncio.Task | None = None
        self.received = time.perf_counter_ns()
        self.window = window  # what the client lets this side send on the call
        self.left: memoryview | None = None  # the answer's messages not sent yet
        self.trailers = b""
        self.relay: StreamRelay | None = None  # a stream relayed to HAProxy
        self.out = bytearray()  # a relayed stream's answers not sent yet
        self.answering = False  # a relayed stream's response headers are sent


class H2Connection(RelayedStreams, asyncio.Protocol):
    """One client's HTTP/2 connection; ``direct``: the Unix socket of the front's HAProxy that
    takes relayed calls, and the route key (``<model>/<version>``) the door gave it for."""

    def __init__(self, listener: Any, direct: tuple[str, str]) -> None:
        """``listener``: the replica's :class:`~rayinfer.deployments.replica_listener.ReplicaListener`."""
        self._listener = listener
        self._relay, self._key = direct
        self._transport: Any = None
        self._buffer = bytearray()
        self._preface = False
        self._decoder = HeaderDecoder()
        self._calls: dict[int, _Call] = {}  # open calls: read, or being answered
        self._block: tuple[int, int, list[bytes]] | None = None  # a header block in CONTINUATIONs
        self._highest = 0  # the largest stream id the client opened
        self._last_taken = MAX_WINDOW  # calls above this id are not taken (a GOAWAY named it)
        self._going = 0  # 0 serving, 1 first GOAWAY and PING sent, 2 last GOAWAY sent
        self._shut = False  # all sent (the last GOAWAY, then FIN): what the client sends is dropped
        self._send_window = DEFAULT_WINDOW
        self._initial_window = DEFAULT_WINDOW  # each call's send window at its start
        self._max_frame = DEFAULT_FRAME_SIZE
        self._unacked = 0  # bytes received since the last connection WINDOW_UPDATE
        self._turn_at = time.monotonic() + _TURN_S
        self._client_window = _STREAM_WINDOW

    # the listener's view (as of its HTTP/1.1 connections)

    @property
    def direct(self) -> bool:
        return self._transport is not None

    @property
    def idle(self) -> bool:
        return True  # leaving is graceful at any time

    def hand_over_relay(self) -> bool:
        return False

    def leave(self) -> bool:
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
        self._listener._connections.add(self)
        transport.write(settings({SETTINGS_INITIAL_WINDOW_SIZE: _STREAM_WINDOW})
                        + window_update(0, _CONNECTION_WINDOW - DEFAULT_WINDOW))

    def connection_lost(self, exc: Exception | None) -> None:
        self._listener._connections.discard(self)
        self._transport = None
        for call in self._calls.values():  # the client went away: its calls are cancelled
            if call.task is not None:
                call.task.cancel()
            if call.relay is not None:
                call.relay.cancel()
        self._calls.clear()

    def data_received(self, data: bytes) -> None:
        if self._shut:
            return  # frames the client sent before it read the GOAWAY: it sends their calls again
        self._buffer += data
        try:
            self._read_frames()
        except (ValueError, hpack.HPACKError) as exc:
            logger.warning("malformed HTTP/2 from a client: %s", exc)
            self._fail()

    def _fail(self) -> None:
        if self._transport is not None:
            self._write(goaway(self._highest, PROTOCOL_ERROR))
            self._transport.close()

    # frames in

    def _read_frames(self) -> None:
        buffer, at = self._buffer, 0
        if not self._preface:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(bytes(buffer)):
                    raise ValueError("not an HTTP/2 connection preface")
                return
            if buffer[:len(PREFACE)] != PREFACE:
                raise ValueError("not an HTTP/2 connection preface")
            self._preface, at = True, len(PREFACE)
        while len(buffer) - at >= 9 and self._transport is not None:
            length, kind, flags, stream = frame_header(buffer, at)
            if length > DEFAULT_FRAME_SIZE:
                raise ValueError(f"a frame of {length} bytes")
            if len(buffer) - at - 9 < length:
                break
            payload = bytes(buffer[at + 9:at + 9 + length])
            at += 9 + length
            self._frame(kind, flags, stream, payload)
        del buffer[:at]

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if self._block is not None and kind != CONTINUATION:
            raise ValueError("a header block without its CONTINUATION")
        if kind == DATA:
            self._data(flags, stream, payload)
        elif kind == HEADERS:
            block = unpadded(payload, flags, kind)
            if flags & END_HEADERS:
                self._headers(stream, flags, block)
            else:
                self._block = (stream, flags, [block])
        elif kind == CONTINUATION:
            if self._block is None or self._block[0] != stream:
                raise ValueError("a CONTINUATION of no header block")
            self._block[2].append(payload)
            if flags & END_HEADERS:
                first, first_flags, blocks = self._block
                self._block = None
                self._headers(first, first_flags, b"".join(blocks))
        elif kind == SETTINGS and not flags & ACK:
            self._settings(parse_settings(payload))
        elif kind == PING and flags & ACK:
            if payload == _GOING and self._going == 1:
                self._last_goaway()
        elif kind == PING:
            self._write(frame(PING, ACK, 0, payload))
        elif kind == WINDOW_UPDATE:
            increment = int.from_bytes(payload, "big") & MAX_WINDOW
            if stream == 0:
                self._send_window += increment
            elif (call := self._calls.get(stream)) is not None:
                call.window += increment
            self._flush()
        elif kind == RST_STREAM:
            call = self._calls.pop(stream, None)
            if call is not None and call.task is not None:
                call.task.cancel()
            if call is not None and call.relay is not None:
                call.relay.cancel()
            self._maybe_close()
        elif kind == GOAWAY:  # the client opens no more calls
            self._last_taken = min(self._last_taken, self._highest)
            self._going = 2
            self._maybe_close()
        elif kind == PUSH_PROMISE:
            raise ValueError("PUSH_PROMISE from a client")

    def _settings(self, values: dict[int, int]) -> None:
        if SETTINGS_INITIAL_WINDOW_SIZE in values:
            delta = values[SETTINGS_INITIAL_WINDOW_SIZE] - self._initial_window
            self._initial_window += delta
            for call in self._calls.values():
                call.window += delta
        if SETTINGS_MAX_FRAME_SIZE in values:
            self._max_frame = values[SETTINGS_MAX_FRAME_SIZE]
        self._write(frame(SETTINGS, ACK, 0))
        self._flush()

    def _headers(self, stream: int, flags: int, block: bytes) -> None:
        headers = self._decoder.decode(block)  # always: the decoder's table follows every block
        call = self._calls.get(stream)
        if call is not None:  # a call's trailers
            if flags & END_STREAM and call.relay is not None:
                call.relay.send(b"", True)
            elif flags & END_STREAM and call.task is None:
                self._start(call)
            return
        if not stream & 1:
            raise ValueError(f"a client opened stream {stream}")
        if stream <= self._highest:
            return  # a call already answered (or refused)
        self._highest = stream
        if stream > self._last_taken:
            return  # after the GOAWAY: the client sends it again elsewhere
        path = next((value for name, value in headers if name == b":path"), b"").decode("latin-1")
        if path == SERVICE + STREAM_RPC:
            self._relay_stream(stream, headers, bool(flags & END_STREAM))
            return
        if not path.startswith(SERVICE) or path[len(SERVICE):] in NOT_DIRECT_RPCS:
            self._not_taken(stream)
            return
        call = self._calls[stream] = _Call(stream, headers, self._initial_window)
        if flags & END_STREAM:
            self._start(call)

    def _not_taken(self, stream: int) -> None:
        """Close the connection to new calls from ``stream`` on; the client sends them again
        on a new connection."""
        self._last_taken = stream - 2
        self._going = 2
        self._write(goaway(max(stream - 2, 0)))
        self._maybe_close()

    def _data(self, flags: int, stream: int, payload: bytes) -> None:
        self._unacked += len(payload)
        if self._unacked >= _CONNECTION_WINDOW // 2:
            self._write(window_update(0, self._unacked))
            self._unacked = 0
        call = self._calls.get(stream)
        if call is not None and call.relay is not None:
            call.relay.send(unpadded(payload, flags, DATA), bool(flags & END_STREAM))
            return
        if call is None or call.task is not None:
            return  # a call refused, reset or answered: its data is dropped
        data = unpadded(payload, flags, DATA)
        call.size += len(data)
        if call.size > GRPC_MAX_MESSAGE_SIZE + 5:
            self._send(call, b"", trailers(*grpc_status(message_too_large(call.size, GRPC_MAX_MESSAGE_SIZE))))
            self._write(frame(RST_STREAM, 0, call.id, b"\0\0\0\0"))
            return
        call.body.append(data)
        if flags & END_STREAM:
            self._start(call)
            return
        call.unacked += len(payload)
        if call.unacked >= _STREAM_WINDOW // 2:
            self._write(window_update(stream, call.unacked))
            call.unacked = 0

    # calls

    def _start(self, call: _Call) -> None:
        call.task = asyncio.get_running_loop().create_task(self._answer(call))

    async def _answer(self, call: _Call) -> None:
        received = time.perf_counter_ns()
        path = next(value for name, value in call.headers if name == b":path")
        method = path[len(SERVICE):].decode("latin-1")
        body = call.body[0] if len(call.body) == 1 else b"".join(call.body)
        try:
            message, own = b"", False
            if method in ROUTED_RPCS:
                encoding = next((value for name, value in call.headers if name == b"grpc-encoding"), None)
                message = unframe(body, encoding)
                try:
                    own = self._listener.owns_grpc(*name_and_version(message), self._key)
                except ValueError:  # not a message of its RPC: the core answers as Triton does
                    own = True
            if not own:
                # A connection given for another call than this replica's (a client's first call
                # asked for readiness) takes its turn soon: the door places it by its next call.
                self._turn_at = min(self._turn_at, time.monotonic() + _RELAYED_TURN_S)
                data, fields = await relay_grpc(self._relay, path, call.headers, body)
                self._send(call, data, b"".join(literal(name, value) for name, value in fields))
                return
            stamps = ProtocolStamps(self._listener.model, True, call.received, received, call.headers)
            PROTOCOL_STAMPS.set(stamps)
            if self._listener.in_flight >= self._listener.max_inflight:
                raise UnavailableError(inflight_limit_message(self._listener.max_inflight))
            reply = await self._listener.call_grpc(method, message)
            send_start = time.perf_counter_ns()
            self._send(call, b"\0" + len(reply).to_bytes(4, "big") + reply, OK_TRAILERS)
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
            self._write(frame(HEADERS, END_HEADERS | END_STREAM, call.id, RESPONSE_HEADERS + trailer_block))
            self._ended(call)
            return
        call.left, call.trailers = memoryview(data), trailer_block
        self._flush_call(call, [frame(HEADERS, END_HEADERS, call.id, RESPONSE_HEADERS)])

    def _flush_call(self, call: _Call, out: list[bytes]) -> None:
        """Send what the windows allow of a call's answer (its trailers once all is sent)."""
        left = call.left
        assert left is not None
        while left and min(self._send_window, call.window) > 0:
            size = min(len(left), self._send_window, call.window, self._max_frame)
            out.append(frame(DATA, 0, call.id, left[:size]))  # type: ignore[arg-type]  # bytes + memoryview
            left = left[size:]
            self._send_window -= size
            call.window -= size
        call.left = left
        if not left:
            out.append(frame(HEADERS, END_HEADERS | END_STREAM, call.id, call.trailers))
        if out:
            self._write(b"".join(out))
        if not left:
            self._ended(call)

    def _flush(self) -> None:
        for call in [c for c in self._calls.values() if c.left is not None or c.relay is not None]:
            if self._send_window <= 0:
                return
            if call.relay is not None:
                self._flush_relayed(call)
            else:
                self._flush_call(call, [])

    # relayed streams (the rest of their side here is :class:`RelayedStreams`)

    def _relay_stream(self, stream: int, headers: list[tuple[bytes, bytes]], ended: bool) -> None:
        call = self._calls[stream] = _Call(stream, headers, self._initial_window)
        call.relay = StreamRelay(self, call)
        if ended:
            call.relay.send(b"", True)
        call.task = asyncio.get_running_loop().create_task(call.relay.open(self._relay))

    def _ended(self, call: _Call) -> None:
        self._calls.pop(call.id, None)
        if not self._going and (self._listener.closing or time.monotonic() >= self._turn_at):
            self.leave()
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
        self._buffer.clear()
        self._transport.write_eof()
        asyncio.get_running_loop().call_later(_LINGER_S, self.close)
