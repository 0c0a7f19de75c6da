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
``SLOTS // n`` or one more. A slot taken from a replica still running keeps it as the slot's
*previous* replica: the new one starts the slot's new sequences and sends a request of a
sequence it does not hold on to the previous one, so sequences running there go on to their
end. A sequence whose replica left fails its next request with Triton's error for a sequence
that was never started (it has no state anywhere else), as it would in Triton if its instance
were gone; sequences on the other replicas go on.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

# Routing slots per sequence model version (the front's map holds one listener per slot).
SLOTS = 64
# The header a replica puts on a request it sends on to the slot's replica.
FORWARDED_HEADER = b"rayinfer-sequence-forwarded"

Address = tuple[str, int]


def slot_of(sequence_id: Any) -> int:
    """The routing slot of a correlation id (an unsigned integer or a string)."""
    # (A lone surrogate from a JSON "\ud800" is encoded as the front's Lua encodes it.)
    return zlib.crc32(str(sequence_id).encode("utf-8", "surrogatepass")) % SLOTS


def previous_owners(before: Sequence[str] | None, after: Sequence[str], previous: Sequence[str | None] | None,
                    replicas: Sequence[str]) -> list[str | None]:
    """Each slot's previous replica after ``before`` became ``after``: the replica a slot was
    taken from, while it runs (in ``replicas``); a slot that did not move keeps its previous one."""
    live = set(replicas)
    result: list[str | None] = []
    for slot, owner in enumerate(after):
        old = before[slot] if before is not None and len(before) == SLOTS else None
        kept = previous[slot] if previous is not None and len(previous) == SLOTS else None
        candidate = old if old is not None and old != owner else kept
        result.append(candidate if candidate in live and candidate != owner else None)
    return result


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
        self._previous: list[Address | None] = [None] * SLOTS

    def update(self, table: dict[str, Any] | None) -> None:
        """The table the route table answered (``listeners``: one per slot; ``previous``: each
        slot's previous replica or None), or None (none yet)."""
        listeners = (table or {}).get("listeners")
        if not listeners or len(listeners) != SLOTS:
            self._listeners = None
            return
        self._listeners = [(str(h), int(p)) for h, p in listeners]
        previous = table.get("previous") or [None] * SLOTS  # type: ignore[union-attr]
        self._previous = [(str(a[0]), int(a[1])) if a else None for a in previous]

    def owner(self, parameters: dict[str, Any], holds: Callable[[Any], bool]) -> Address | None:
        """The listener of the replica holding the sequence of a request with these parameters,
        or None when that is this replica (or the request names no sequence, or no table is
        known). ``holds(id)``: whether the sequence runs on this replica."""
        listeners = self._listeners
        sequence_id = parameters.get("sequence_id")
        if listeners is None or sequence_id is None or sequence_id == 0 or sequence_id == "":
            return None
        start = bool(parameters.get("sequence_start"))
        if not start and holds(sequence_id):  # began here (before its slot moved away, perhaps)
            return None
        slot = slot_of(sequence_id)
        if listeners[slot] != self.own:
            return listeners[slot]
        previous = self._previous[slot]
        if previous is None or previous == self.own or start:
            return None
        return previous  # a sequence that began before this replica took its slot
