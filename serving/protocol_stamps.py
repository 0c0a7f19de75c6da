"""What a request's protocol adds to its trace: when its bytes arrived at the replica and when its
answer left (Triton's HTTP_RECV_START ... HTTP_SEND_END, or GRPC_WAITREAD_START ...
GRPC_SEND_END), and the client's W3C trace context. Whoever reads a request (a replica's
listener, Serve's HTTP ingress, a gRPC stream's forwarded request) sets the current task's
:data:`PROTOCOL_STAMPS`; the serving core that traces the request takes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import NamedTuple


class StreamTrace(NamedTuple):
    """The last item of a traced stream request's answer (after its responses), from the model
    replica to the ``/v2`` replica that writes them: the trace's ``token``, and the model
    replica's ``node`` (set by the deployment) and :func:`wall_clock_offset_ns`, so that the send
    stamps the ``/v2`` replica takes on its own clock are put on the model replica's when the
    two are on different nodes."""

    token: str
    wall_offset_ns: int
    node: str = ""

    def clock_offset(self, node: str, reader_wall_offset_ns: int) -> int:
        """How far the model replica's clock is ahead of that of the reader on ``node``, whose
        :func:`wall_clock_offset_ns` is given: 0 on the same node (one monotonic clock), else
        through both nodes' wall clocks (exact where they are one machine's, otherwise as close
        as the nodes' clocks are synchronised, as by NTP)."""
        return 0 if self.node == node else reader_wall_offset_ns - self.wall_offset_ns


def wall_clock_offset_ns() -> int:
    """The wall clock (``time.time_ns``) less the trace clock (``time.perf_counter_ns``) in this
    process: a stamp plus this is the stamp's wall-clock time."""
    return time.time_ns() - time.perf_counter_ns()


class ProtocolStamps:
    """When a request's bytes arrived at a replica's listener, and the trace that waits for
    when its response leaves (Triton's HTTP_RECV_START ... HTTP_SEND_END, or GRPC_WAITREAD_START
    ... GRPC_SEND_END). The listener sets one per request in :data:`PROTOCOL_STAMPS`; the serving
    core of ``model`` that traces the request takes it."""

    __slots__ = ("model", "grpc", "recv_start", "recv_end", "finish", "_context", "sent_elsewhere", "token")

    def __init__(self, model: str, grpc: bool, recv_start: int, recv_end: int,
                 context: bytes | list[tuple[bytes, bytes]] | None = None) -> None:
        self.model = model
        self.grpc = grpc
        self.recv_start = recv_start
        self.recv_end = recv_end
        # The client's traceparent header, or the gRPC call's header list holding it (read
        # only when the request is traced).
        self._context = context
        # Set by the core tracing the request: called with the send's start and end (0 and 0:
        # the client went away before the answer was written, or, :attr:`sent_elsewhere`, its
        # answers are written by another process).
        self.finish: Callable[[int, int], None] | None = None
        # A gRPC stream's request: the ``/v2`` replica, which read it, writes its responses and
        # gives their send stamps to the trace it names by :attr:`token` (set by the core when
        # the request is traced in Triton's mode).
        self.sent_elsewhere = False
        self.token: str | None = None

    @property
    def context(self) -> str | None:
        """The client's W3C traceparent (header or gRPC metadata), for the opentelemetry mode."""
        context = self._context
        if isinstance(context, list):
            context = next((value for name, value in context if name == TRACEPARENT), None)
        return context.decode("latin-1") if context else None

    @property
    def received(self) -> list[tuple[str, int]]:
        if not self.recv_start:  # no read was stamped (a caller that gave none)
            return []
        if self.grpc:
            return [("GRPC_WAITREAD_START", self.recv_start), ("GRPC_WAITREAD_END", self.recv_end)]
        return [("HTTP_RECV_START", self.recv_start), ("HTTP_RECV_END", self.recv_end)]

    def send_stamps(self, start: int, end: int) -> list[tuple[str, int]]:
        if not start:
            return []
        prefix = "GRPC" if self.grpc else "HTTP"
        return [(f"{prefix}_SEND_START", start), (f"{prefix}_SEND_END", end)]


# The W3C trace context header (HTTP) and metadata key (gRPC) of a client's span.
TRACEPARENT = b"traceparent"
# The request the current task answers, when a replica listener received it.
PROTOCOL_STAMPS: ContextVar[ProtocolStamps | None] = ContextVar("rayinfer_protocol_stamps", default=None)


def stamp_stream_request(model: str, context: str | None, read_walls: tuple[int, int] | None) -> ProtocolStamps:
    """The stamps of a gRPC stream's request, read by the ``/v2`` replica: when its read began
    and ended (``read_walls``: wall-clock ns, put on this process's trace clock) and the client's
    trace context (``traceparent``), set for the serving core of ``model`` that traces it."""
    to_wall = wall_clock_offset_ns()
    start, end = (read_walls[0] - to_wall, read_walls[1] - to_wall) if read_walls else (0, 0)
    stamps = ProtocolStamps(model, True, start, end, context.encode("latin-1") if context else None)
    stamps.sent_elsewhere = True
    PROTOCOL_STAMPS.set(stamps)
    return stamps


def stamp_http_request(model: str, recv_start: int, headers: list[tuple[bytes, bytes]]) -> ProtocolStamps:
    """The stamps of an HTTP request the current task answers, read by now (Serve's ingress:
    a listener sets its own), set for the serving core of ``model`` that traces it."""
    stamps = ProtocolStamps(model, False, recv_start, time.perf_counter_ns(), headers)
    PROTOCOL_STAMPS.set(stamps)
    return stamps
