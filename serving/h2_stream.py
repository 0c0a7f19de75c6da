"""A gRPC stream (``ModelStreamInfer``) that a client starts on a connection a model replica
holds, answered by that replica.

The stream's requests are read from its DATA frames (gRPC's length-prefixed messages, each at
most gRPC's maximum message size) and handed to the replica's stream handler
(:attr:`~rayinfer.serving.replica_listener.ReplicaListener.stream_grpc`: its own model's
requests answered in the replica, another model's sent to a replica of that model by deployment
handle, :mod:`stream_infer`). The client's flow-control window is given back as the handler takes
each request (and as a request arrives while the handler waits for it, so that a message larger
than the window can arrive), so a stream holds at most its window of requests the handler has not
taken; the answers are
written as the client's windows allow, and the handler waits while more than a window of them
waits to be sent. A client that resets the stream or goes away cancels its requests.

:class:`StreamAnswers` is the part of :class:`~rayinfer.serving.replica_h2.H2Connection` that
writes a stream's answers; :class:`ServedStream` reads its requests and runs the handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from rayinfer.protocol.errors import InternalError
from rayinfer.protocol.grpc_wire import (
    DATA, OK_TRAILERS, RESPONSE_HEADERS, frame, grpc_status, header_frames, message_frame, reset_stream, trailers,
    unframe_off_loop,
)
from rayinfer.protocol.limits import message_too_large, stream_idle
from rayinfer.serving.stream_infer import parse_request

Fields = list[tuple[bytes, bytes]]
# The replica's stream handler: (the stream's requests, the call's headers) -> its serialized
# ModelStreamInferResponse messages.
StreamHandler = Callable[[AsyncIterator[Any], Fields], AsyncGenerator[bytes, None]]


class StreamAnswers:
    """What writes the answers of served streams to the client, a part of ``replica_h2.H2Connection``.
    A ``call`` is the connection's call of the stream."""

    _calls: dict[int, Any]
    _transport: Any
    _send_window: int  # what the client lets this side send on the connection
    _max_frame: int
    _limits: Any  # the connection's ConnectionLimits
    _client_window: int  # what a client may send on one call before the replica reads it
    _write: Callable[[bytes], None]  # to the client (H2Connection's)
    _ended: Callable[[Any], None]  # a call is over (H2Connection's)
    _release: Callable[[Any, int], None]  # bytes a call held are freed (H2Connection's)
    give_window: Callable[[Any], None]  # a call's window given back (H2Connection's)
    data_sent: Callable[[int], None]  # DATA frames went out (H2Connection's)

    def stream_taken(self, call: Any, size: int) -> None:
        """``size`` bytes of the client's were taken by the stream's handler: the client may send
        as many more."""
        self._release(call, size)
        call.unacked += size
        if call.unacked >= self._client_window // 2 and self._current(call):
            self.give_window(call)

    def _current(self, call: Any) -> bool:
        """Whether ``call`` is still the connection's call of its stream."""
        return self._calls.get(call.id) is call

    def _flush_stream(self, call: Any) -> None:
        """Send what the windows allow of a stream's answers (its trailers after them)."""
        if not self._current(call) or self._transport is None:
            return
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


class ServedStream:
    """One stream's requests as they arrive, and the task that answers them."""

    def __init__(self, connection: StreamAnswers, call: Any, handler: StreamHandler) -> None:
        self._connection, self._call, self._handler = connection, call, handler
        self._pending = bytearray()  # the client's bytes not split into messages yet
        self._messages: deque[bytes] = deque()
        self.client_ended = False  # the client ended its side
        self._arrived = asyncio.Event()
        self.sent = asyncio.Event()  # the answers waiting to be sent are under a window again
        self._encoding = next((value for name, value in call.headers if name == b"grpc-encoding"), None)
        self._too_large = 0  # the size of a message over the limit
        self._owed = 0  # bytes received whose window is not given back yet
        self._limit = connection._limits.max_message_bytes  # --grpc-max-message-size
        self.last_active = time.monotonic()  # the client's last bytes, or the last response sent
        self._expired = 0.0  # the idle timeout that ended the stream

    def expire(self, timeout_s: float) -> None:
        """The stream has had no request nor response for ``timeout_s`` (--stream-idle-timeout):
        it ends once the requests in progress are answered, with DEADLINE_EXCEEDED."""
        if not self._expired:
            self._expired = timeout_s
            self._arrived.set()

    def feed(self, data: bytes, end: bool) -> None:
        """The client's DATA for the stream (``end``: its last)."""
        self.client_ended = self.client_ended or end
        self.last_active = time.monotonic()
        self._arrived.set()
        if self._too_large:
            return  # the stream ends for a message over the limit: what follows is dropped
        self._pending += data
        self._owed += len(data)
        while len(self._pending) >= 5 and not self._too_large:
            size = 5 + int.from_bytes(self._pending[1:5], "big")
            if size > self._limit + 5:
                self._too_large = size
            elif len(self._pending) >= size:
                self._messages.append(bytes(self._pending[:size]))
                del self._pending[:size]
            else:
                break
        if not self._messages and not self._too_large:  # the handler waits for a message: it may arrive, however large
            self._give(self._owed)

    def _give(self, size: int) -> None:
        size = min(size, self._owed)
        if size:
            self._owed -= size
            self._connection.stream_taken(self._call, size)

    async def _requests(self) -> AsyncIterator[Any]:
        while True:
            while not self._messages:
                if self._too_large:
                    raise message_too_large(self._too_large - 5, self._limit)
                if self._expired:
                    raise stream_idle(self._expired)
                if self.client_ended:
                    if self._pending:
                        raise InternalError("malformed gRPC request: the stream ended within a message")
                    return
                self._arrived.clear()
                await self._arrived.wait()
            message = self._messages.popleft()
            self._give(len(message) if self._messages else self._owed)
            yield parse_request(await unframe_off_loop(message, self._encoding, self._limit))

    async def answer(self) -> None:
        """Answer the stream's requests until the client has ended its side and all are answered."""
        call, connection = self._call, self._connection
        try:
            async with contextlib.aclosing(self._handler(self._requests(), call.headers)) as responses:
                async for response in responses:
                    if not call.answering:
                        call.answering = True
                        connection._write(header_frames(call.id, RESPONSE_HEADERS, False, connection._max_frame))
                    call.out += message_frame(response)
                    self.last_active = time.monotonic()
                    connection._flush_stream(call)
                    if len(call.out) > connection._client_window:
                        self.sent.clear()
                        await self.sent.wait()
            block = OK_TRAILERS
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            block = trailers(*grpc_status(exc))
        call.trailers = block if call.answering else RESPONSE_HEADERS + block
        call.answering = True
        connection._flush_stream(call)
