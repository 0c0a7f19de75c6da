"""The contract between a model replica's listener (:mod:`replica_listener`) and the connections
it holds: HTTP/1.1 (:mod:`listener_connection`) and a client's HTTP/2 (:mod:`replica_h2`).

- :class:`ClientConnection`: what the listener asks of every connection as it stops or
  rebalances (whether it is a client's from the acceptor, whether it is between two requests,
  give it back, close it). A connection joins the listener's set with
  :meth:`~rayinfer.transport.replica_listener.ReplicaListener.admit` and leaves it with
  :meth:`~rayinfer.transport.replica_listener.ReplicaListener.release`.
- :class:`WriteFlow`: the flow control of a connection's answers, as asyncio's transport signals
  it (``pause_writing`` past the write buffer's high-water mark, ``resume_writing`` below its low
  one), with the send timeout's deadline (``--client-send-timeout``), for both protocols.

Where a connection's requests go (this replica, or relayed to the front) is not the connection's
to decide: it asks its :class:`~rayinfer.transport.replica_routes.ConnectionRoute`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class ClientConnection(Protocol):
    """A connection a replica's listener holds."""

    @property
    def direct(self) -> bool:
        """A client's own connection, given by the front's acceptor (else one over the
        listener's port, from the front or another replica)."""
        ...

    @property
    def idle(self) -> bool:
        """Between two requests: it may be given back (or, HTTP/2, closed gracefully) now."""
        ...

    def hand_back(self) -> bool:
        """Give a client's connection back to the acceptor (HTTP/2: close it gracefully); False
        if it stays here for now."""
        ...

    def hand_over_relay(self) -> bool:
        """The listener stops while the connection waits for a relayed answer: give the
        connection with that answer to the acceptor; False if there is none."""
        ...

    def close(self) -> None:
        ...


class WriteFlow:
    """Whether the client takes a connection's answers: ``paused`` while the transport's write
    buffer is over its high-water mark; :meth:`writable` gives a future to wait on until it is
    not; :meth:`send_deadline` says by when a client that takes none of its answers is
    disconnected, counted from when it last took some."""

    __slots__ = ("paused", "_resumed", "_mark_ns", "_mark_bytes")

    def __init__(self) -> None:
        self.paused = False
        self._resumed: asyncio.Future[None] | None = None
        self._mark_ns = 0  # when the client was last seen taking answers
        self._mark_bytes = 0  # what the write buffer held then

    def pause(self, buffered: int) -> None:
        """The transport's ``pause_writing`` (``buffered``: its write buffer's size)."""
        self.paused = True
        self._mark_ns, self._mark_bytes = time.perf_counter_ns(), buffered

    def resume(self) -> None:
        """The transport's ``resume_writing``."""
        self.paused = False
        self._mark_ns = 0
        self.wake()

    def writable(self) -> asyncio.Future[None] | None:
        """None while the client takes its answers; else a future done once writing resumes (or
        the connection is lost: :meth:`wake`)."""
        if not self.paused:
            return None
        if self._resumed is None:
            self._resumed = asyncio.get_running_loop().create_future()
        return self._resumed

    def wake(self) -> None:
        """Release whoever waits in :meth:`writable` (writing resumed, or the connection is lost)."""
        if self._resumed is not None:
            if not self._resumed.done():
                self._resumed.set_result(None)
            self._resumed = None

    def send_deadline(self, now_ns: int, buffered: int, waiting: bool, timeout_s: float) -> int | None:
        """While answers wait for the client (``waiting``: writing paused, or answers buffered and
        none being written; ``buffered``: the write buffer's size now), the time (perf_counter
        ns) by which the client must take some of them: ``timeout_s`` after it last did (the
        buffer shrank). None while nothing waits."""
        if not waiting:
            self._mark_ns = 0
            return None
        if not self._mark_ns or buffered < self._mark_bytes:
            self._mark_ns, self._mark_bytes = now_ns, buffered
        return self._mark_ns + int(timeout_s * 1e9)
