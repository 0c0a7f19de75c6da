"""A gRPC stream (``ModelStreamInfer``) that a client starts on a connection a model replica
holds, answered by that replica.

The stream's requests are read from its DATA frames (gRPC's length-prefixed messages, each at
most gRPC's maximum message size) and handed to the replica's stream handler
(:attr:`~rayinfer.transport.replica_listener.ReplicaListener.stream_grpc`: its own model's
requests answered in the replica, another model's sent to a replica of that model by deployment
handle, :mod:`stream_infer`). The client's flow-control window is given back as the handler takes
each request (and as a request arrives while the handler waits for it, so that a message larger
than the window can arrive), so a stream holds at most its window of requests the handler has not
taken; the answers are
written as the client's windows allow, and the handler waits while more than a window of them
waits to be sent. A client that resets the stream or goes away cancels its requests.

:class:`ServedStream` reads a stream's requests and runs the handler; the connection
(:class:`StreamConnection`: :class:`~rayinfer.transport.replica_h2.H2Connection`) writes its answers
as the windows allow.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Protocol

from rayinfer.protocol.errors import InternalError
from rayinfer.protocol.grpc_wire import OK_TRAILERS, RESPONSE_HEADERS, grpc_status, message_frame, trailers, unframe_off_loop
from rayinfer.protocol.limits import message_too_large, stream_idle
from rayinfer.serving.stream_infer import parse_request

Fields = list[tuple[bytes, bytes]]
# The replica's stream handler: (the stream's requests, the call's headers) -> its serialized
# ModelStreamInferResponse messages.
StreamHandler = Callable[[AsyncIterator[Any], Fields], AsyncGenerator[bytes, None]]


class StreamConnection(Protocol):
    """What a served stream asks of the connection it is on (:class:`~rayinfer.transport.replica_h2.H2Connection`).
    A ``call`` is the connection's call of the stream."""

    @property
    def client_window(self) -> int:
        """What a client may send on one call before the replica reads it."""

    @property
    def max_message_bytes(self) -> int:
        """--grpc-max-message-size."""

    def stream_taken(self, call: Any, size: int) -> None:
        """``size`` bytes of the client's were taken by the stream's handler."""

    def begin_answer(self, call: Any) -> None:
        """Send the stream's response headers."""

    def send_answers(self, call: Any) -> None:
        """Send what the windows allow of the stream's answers (its trailers after them)."""


class ServedStream:
    """One stream's requests as they arrive, and the task that answers them."""

    def __init__(self, connection: StreamConnection, call: Any, handler: StreamHandler) -> None:
        self._connection, self._call, self._handler = connection, call, handler
        self._pending = bytearray()  # the client's bytes not split into messages yet
        self._messages: deque[bytes] = deque()
        self.client_ended = False  # the client ended its side
        self._arrived = asyncio.Event()
        self.sent = asyncio.Event()  # the answers waiting to be sent are under a window again
        self._encoding = next((value for name, value in call.headers if name == b"grpc-encoding"), None)
        self._too_large = 0  # the size of a message over the limit
        self._owed = 0  # bytes received whose window is not given back yet
        self._limit = connection.max_message_bytes  # --grpc-max-message-size
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
                        connection.begin_answer(call)
                    call.out += message_frame(response)
                    self.last_active = time.monotonic()
                    connection.send_answers(call)
                    if len(call.out) > connection.client_window:
                        self.sent.clear()
                        await self.sent.wait()
            block = OK_TRAILERS
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            block = trailers(*grpc_status(exc))
        call.trailers = block if call.answering else RESPONSE_HEADERS + block
        call.answering = True
        connection.send_answers(call)
