"""Which replica holds a sequence: routing slots for models with sequence batching.

A sequence model's replicas each run their own sequence batcher, so every request of a sequence
must reach the replica that received its START. A sequence's *slot* is the CRC-32 of its
correlation id (the decimal integer, or the string) modulo :data:`SLOTS`; the ``/v2`` replica's
route table gives each slot to one replica and publishes the table twice: to the front, which
routes a request carrying ``sequence_id`` to its slot's listener with no Python process on the
way (HAProxy's ``crc32`` converter is zlib's CRC-32), and to the model's replicas, which send a
request that reached them by another path (Serve's ingress, a gRPC stream, a front that has not
heard of the latest table yet) on to the slot's replica over its listener. A request sent on
carries a header saying so and is never sent on again.

Slots move only when the replicas change: the slots of a replica that left go to those with the
fewest, and a replica that joins takes slots from those with the most, until every replica has
``SLOTS // n`` or one more. A sequence whose slot moved fails its next request with Triton's
error for a sequence that was never started (it has no state on the slot's new replica), as it
would in Triton if its instance were gone; sequences in the other slots go on.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

# Routing slots per sequence model version (the front's map holds one listener per slot).
SLOTS = 64
# The header a replica puts on a request it sends on to the slot's replica.
FORWARDED_HEADER = b"rayinfer-sequence-forwarded"

Address = tuple[str, int]


def slot_of(sequence_id: Any) -> int:
    """The routing slot of a correlation id (an unsigned integer or a string)."""
    return zlib.crc32(str(sequence_id).encode("utf-8")) % SLOTS


def assign_slots(current: Sequence[str | None] | None, replicas: Sequence[str]) -> list[str]:
    """The slots' owners among ``replicas`` (at least one), moving as few slots from
    ``current`` as keeps the replicas' shares within one of each other."""
    live = sorted(set(replicas))
    owners: list[str | None] = list(current) if current is not None and len(current) == SLOTS else [None] * SLOTS
    owners = [owner if owner in live else None for owner in owners]
    held: dict[str, list[int]] = {replica: [] for replica in live}
    for slot, owner in enumerate(owners):
        if owner is not None:
            held[owner].append(slot)
    for slot, owner in enumerate(owners):  # a departed replica's slots: to the replicas with the fewest
        if owner is None:
            fewest = min(live, key=lambda r: (len(held[r]), live.index(r)))
            owners[slot] = fewest
            held[fewest].append(slot)
    while True:  # a replica that joined takes slots from those with the most
        most = max(live, key=lambda r: (len(held[r]), -live.index(r)))
        fewest = min(live, key=lambda r: (len(held[r]), live.index(r)))
        if len(held[most]) - len(held[fewest]) <= 1:
            return owners  # type: ignore[return-value]
        slot = held[most].pop()
        owners[slot] = fewest
        held[fewest].append(slot)


class SequenceRoutes:
    """A replica's view of its version's slot table: which listener holds a request's sequence."""

    def __init__(self, own: Address) -> None:
        self.own = (own[0], int(own[1]))
        self._listeners: list[Address] | None = None

    def update(self, listeners: Sequence[Sequence[Any]] | None) -> None:
        """The table the route table answered (one listener per slot), or None (none yet)."""
        self._listeners = [(str(h), int(p)) for h, p in listeners] if listeners and len(listeners) == SLOTS else None

    def owner(self, parameters: dict[str, Any]) -> Address | None:
        """The listener of the replica holding the sequence of a request with these parameters,
        or None when that is this replica (or the request names no sequence, or no table is known)."""
        listeners = self._listeners
        sequence_id = parameters.get("sequence_id")
        if listeners is None or sequence_id is None or sequence_id == 0 or sequence_id == "":
            return None
        owner = listeners[slot_of(sequence_id)]
        return None if owner == self.own else owner
