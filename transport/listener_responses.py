"""The HTTP/1.1 responses a model replica's listener writes (:mod:`replica_listener`): a whole
response with a content-length, a response streamed in chunks (``generate_stream``'s events, a
decoupled model's responses to a request another replica sent on), and a relayed gRPC call's
answer (a chunked body with ``grpc-status`` trailers, which HAProxy turns back into HTTP/2).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Any

from rayinfer.protocol.grpc_wire import grpc_status
from rayinfer.protocol.limits import DEFAULT_CONNECTION_LIMITS, ConnectionLimits

logger = logging.getLogger(__name__)

_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}
# What a connection's writer awaits before writing more: None while the client takes what is
# written, else an awaitable done once it has taken enough (the transport resumed writing).
Writable = Callable[[], Awaitable[None] | None]
_GRPC_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\ntransfer-encoding: chunked\r\n\r\n"
# How often a streamed response looks whether a connection that does not pause its writer has
# sent what it holds (only while it holds more than its bound).
_DRAIN_POLL_S = 0.01
# SO_LINGER on, for 0 s: closing the socket resets the connection (and frees what it holds).
_NO_LINGER = struct.pack("ii", 1, 0)


def _head(status: int, headers: list[tuple[bytes, bytes]], framing: bytes) -> bytes:
    """The status line and headers, ``framing`` (content-length or transfer-encoding) first."""
    extra = b"".join(b"%b: %b\r\n" % header for header in headers)
    return b"HTTP/1.1 %d %b\r\n%b\r\n%b\r\n" % (status, _REASONS.get(status, b"Status"), framing, extra)


def http_response(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """A complete HTTP/1.1 response with a content-length."""
    return _head(status, headers, b"content-length: %d" % len(body)) + body


class StreamedResponse:
    """A response whose body comes in chunks as it is made (``generate_stream``'s events, a
    decoupled model's responses to a request another replica sent on, :meth:`ListenerClient.stream`):
    written chunk by chunk, never more than ``limits.connection_buffer_bytes`` (and one chunk)
    held for its reader: past it the next chunk is not taken from ``chunks`` (so what makes them
    waits too), and a reader that takes nothing for ``limits.send_timeout_s`` is disconnected."""

    __slots__ = ("head", "chunks", "_limits")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], chunks: AsyncIterator[bytes],
                 limits: ConnectionLimits = DEFAULT_CONNECTION_LIMITS) -> None:
        self.head = _head(status, headers, b"transfer-encoding: chunked")
        self.chunks = chunks
        self._limits = limits

    async def write(self, transport: Any, writable: Writable | None = None) -> bool:
        """Write the response; false when the connection went away meanwhile, or was closed
        because the chunks failed (the reader then sees the stream break off) or its reader took
        nothing for the send timeout. With ``writable`` (the connection's flow control), a chunk
        is written only once the client has taken enough of those before; a connection whose
        flow control does not pause (the front's) is bounded here, by its write buffer's size."""
        transport.write(self.head)
        try:
            async for chunk in self.chunks:
                if writable is not None and (paused := writable()) is not None:
                    await paused
                elif transport.get_write_buffer_size() > self._limits.connection_buffer_bytes:
                    if not await self._drained(transport):
                        return False
                if transport.is_closing():
                    return False
                transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        except Exception:
            logger.exception("a streamed response failed")
            transport.close()
            return False
        finally:
            close = getattr(self.chunks, "aclose", None)
            if close is not None:  # given up early (the client went away): what makes them stops
                await close()
        transport.write(b"0\r\n\r\n")
        return True

    async def _drained(self, transport: Any) -> bool:
        """Wait until the connection holds at most half its bound; false once it is closed, or
        reset because its reader took nothing of it for the send timeout."""
        held, since = transport.get_write_buffer_size(), time.monotonic()
        while held > self._limits.connection_buffer_bytes // 2:
            await asyncio.sleep(_DRAIN_POLL_S)
            if transport.is_closing():
                return False
            now_held = transport.get_write_buffer_size()
            if now_held < held:
                held, since = now_held, time.monotonic()
            elif time.monotonic() - since >= self._limits.send_timeout_s:
                logger.info("a streamed response's reader took none of it for %g s (--client-send-timeout): "
                            "disconnected", self._limits.send_timeout_s)
                reset(transport)
                return False
        return True


def reset(transport: Any) -> None:
    """Drop a connection and what it holds: a reset (no linger) frees what its reader did not
    take, where a close would wait for the reader to take it."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _NO_LINGER)
    transport.abort()


def grpc_response(message: bytes) -> bytes:
    """A successful call: one uncompressed message frame, then ``grpc-status: 0``."""
    frame_length = 5 + len(message)
    return b"%b%x\r\n\x00%b%b\r\n0\r\ngrpc-status: 0\r\n\r\n" % (
        _GRPC_HEAD, frame_length, len(message).to_bytes(4, "big"), message
    )


def grpc_error(exc: BaseException) -> bytes:
    """A failed call: no message; its status and message as trailers."""
    return b"%b0\r\ngrpc-status: %d\r\ngrpc-message: %b\r\n\r\n" % (_GRPC_HEAD, *grpc_status(exc))
