"""The control channel from the ``/v2`` replica to the model replicas, over Ray.

Model replicas call the ``/v2`` replica by deployment handle (registration, statistics, traces,
shared-memory registrations). The other direction, the changes every replica must take before
the ``/v2`` replica answers its client (new trace settings, a shared-memory region unregistered,
a sequence model's new slots), travels on the same handle as a *long poll*, the way Serve's
controller pushes its own updates: each model replica keeps one call to
:meth:`ControlChannel.poll` waiting; a :meth:`ControlChannel.send` answers it with the message,
and the replica's next poll acknowledges it. Nothing of this reaches the listeners clients
connect to.

Messages are typed (:class:`ControlMessage`); one whose kind carries a full state (trace
settings, sequence slots) replaces a pending one of the same kind, so a replica that stops
polling holds at most one of each and :data:`MAX_PENDING` in all.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rayinfer.deployments.names import replica_of

logger = logging.getLogger(__name__)

# The kinds of message: the server's trace settings (TraceSettings.as_dict()), a shared-memory
# region forgotten ({"kind", "name"}; every region of the kind for an empty name), a sequence
# model's slot table ({"listeners", "previous"}, as RouteTable.slot_table gives it), a model's
# rollout split ({"model", "split", "version_less"}, as Rollouts.split_message gives it).
TRACE_SETTINGS = "trace_settings"
SHM_FORGET = "shm_forget"
SEQUENCE_SLOTS = "sequence_slots"
ROLLOUT_SPLIT = "rollout_split"
_FULL_STATE = frozenset({TRACE_SETTINGS, SEQUENCE_SLOTS})
# How long a poll waits for a message before it answers none (the replica polls again at once).
POLL_WAIT_S = 20.0
# Model replicas whose polls the /v2 deployment holds at once, beyond its own requests
# (its max_ongoing_requests).
MAX_POLLING_REPLICAS = 4096
# Messages kept for a replica that has not taken them; past it, the oldest is dropped (logged).
MAX_PENDING = 256


@dataclass(frozen=True, slots=True)
class ControlMessage:
    kind: str
    body: dict[str, Any]


def _app(message: ControlMessage) -> str | None:
    """The application a message is for, when it names one."""
    return message.body.get("app")


@dataclass(slots=True)
class _Mailbox:
    """One model replica's messages not yet acknowledged, and the senders waiting for them."""

    pending: list[tuple[int, ControlMessage]] = field(default_factory=list)
    next_seq: int = 1
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    waiters: list[tuple[int, asyncio.Future]] = field(default_factory=list)

    def put(self, message: ControlMessage) -> int:
        if message.kind in _FULL_STATE:  # replaces the one of its kind (and application: a pool
            # replica's mailbox holds every hosted version's sequence slots)
            self.pending = [(seq, m) for seq, m in self.pending if (m.kind, _app(m)) != (message.kind, _app(message))]
        if len(self.pending) >= MAX_PENDING:
            logger.warning("a model replica has not taken %d control messages: dropping the oldest (%s)",
                           len(self.pending), self.pending[0][1].kind)
            del self.pending[0]
        seq = self.next_seq
        self.next_seq += 1
        self.pending.append((seq, message))
        self.arrived.set()
        return seq

    def acknowledge(self, acked: int) -> None:
        self.pending = [(seq, m) for seq, m in self.pending if seq > acked]
        still = []
        for seq, future in self.waiters:
            if seq <= acked:
                if not future.done():
                    future.set_result(None)
            else:
                still.append((seq, future))
        self.waiters = still

    def taken(self, seq: int) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.waiters = [(s, f) for s, f in self.waiters if not f.done()]
        self.waiters.append((seq, future))
        return future

    def close(self) -> None:
        for _, future in self.waiters:
            if not future.done():
                future.set_result(None)  # the replica is gone: it keeps nothing to correct
        self.waiters.clear()
        self.arrived.set()


class ControlChannel:
    """The ``/v2`` replica's side: a mailbox per model replica (its registration key)."""

    def __init__(self) -> None:
        # A new /v2 replica's polls start afresh: the replicas' acknowledgements name this.
        self.epoch = secrets.token_hex(8)
        self._boxes: dict[str, _Mailbox] = {}

    async def poll(self, replica: str, epoch: str | None, acked: int,
                   wait_s: float = POLL_WAIT_S) -> tuple[str, list[tuple[int, ControlMessage]]]:
        """A model replica's long poll: ``acked``, the last message it took (of ``epoch``);
        answers (this channel's epoch, the messages it has not taken) once there is one, or
        none after ``wait_s``."""
        box = self._boxes.setdefault(replica, _Mailbox())
        if epoch == self.epoch:
            box.acknowledge(acked)
        if not box.pending:
            box.arrived.clear()
            try:
                await asyncio.wait_for(box.arrived.wait(), wait_s)
            except asyncio.TimeoutError:  # none came: the replica polls again
                pass
        return self.epoch, list(box.pending)

    async def send(self, replicas: Iterable[str], message: ControlMessage, timeout_s: float) -> list[str]:
        """Give ``message`` to each of ``replicas``; returns once each has taken it, or after
        ``timeout_s``: the replicas that had not (they take it on their next poll)."""
        waits = {}
        # A pooled model version's key names its pool replica's mailbox (one poll per replica).
        for replica in {replica_of(key) for key in replicas}:
            box = self._boxes.setdefault(replica, _Mailbox())
            waits[replica] = box.taken(box.put(message))
        if not waits:
            return []
        deadline = time.monotonic() + timeout_s
        await asyncio.wait(list(waits.values()), timeout=max(0.0, deadline - time.monotonic()))
        late = sorted(replica for replica, future in waits.items() if not future.done())
        for future in waits.values():
            future.cancel()
        return late

    def forget(self, replica: str) -> None:
        """A replica that withdrew or was not heard from: its messages go (and its senders stop
        waiting)."""
        box = self._boxes.pop(replica, None)
        if box is not None:
            box.close()
