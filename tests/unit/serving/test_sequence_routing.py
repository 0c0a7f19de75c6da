"""Routing slots of sequence models: assignment as replicas come and go, and a replica's view."""

from __future__ import annotations

import asyncio
import zlib
from collections import Counter

from rayinfer.deployments.route_table import RouteTable
from rayinfer.serving.sequence_routing import SLOTS, SequenceRoutes, assign_slots, slot_of


def test_slots_are_zlibs_crc32_of_the_id_as_text():
    assert slot_of(42) == zlib.crc32(b"42") % SLOTS
    assert slot_of("sequence-7") == zlib.crc32(b"sequence-7") % SLOTS
    assert slot_of("\u00fc") == zlib.crc32("\u00fc".encode()) % SLOTS


def test_slots_are_shared_evenly_and_move_only_when_replicas_change():
    one = assign_slots(None, ["a"])
    assert one == ["a"] * SLOTS
    two = assign_slots(one, ["a", "b"])
    assert Counter(two) == {"a": 32, "b": 32}
    three = assign_slots(two, ["c", "a", "b"])
    assert sorted(Counter(three).values()) == [21, 21, 22]
    # A joining replica takes slots from the others; none moves between the others.
    assert all(after == before for before, after in zip(two, three) if after != "c")
    # A leaving replica's slots go to the others; the others keep theirs.
    left = assign_slots(three, ["a", "c"])
    assert sorted(Counter(left).values()) == [32, 32]
    assert all(after == before for before, after in zip(three, left) if before != "b")
    # The same replicas again: nothing moves.
    assert assign_slots(left, ["c", "a"]) == left


def test_a_replica_routes_the_sequences_of_other_replicas_slots_to_them():
    routes = SequenceRoutes(("10.0.0.1", 1000))
    assert routes.owner({"sequence_id": 5}) is None  # no table yet: here
    table = [("10.0.0.1", 1000) if slot % 2 else ("10.0.0.2", 2000) for slot in range(SLOTS)]
    routes.update(table)
    mine = next(i for i in range(1, 1000) if slot_of(i) % 2)
    theirs = next(i for i in range(1, 1000) if not slot_of(i) % 2)
    assert routes.owner({"sequence_id": mine}) is None
    assert routes.owner({"sequence_id": theirs}) == ("10.0.0.2", 2000)
    assert routes.owner({"sequence_id": str(theirs)}) == ("10.0.0.2", 2000)  # the same slot as text
    # No sequence named (Triton's error comes from this replica's batcher).
    assert routes.owner({}) is None and routes.owner({"sequence_id": 0}) is None
    routes.update(None)
    assert routes.owner({"sequence_id": theirs}) is None


class _State:
    def __init__(self) -> None:
        self.routes = {"s/1": ("s", "s_v1"), "s/": ("s", "s_v1"), "m/1": ("m", "m_v1")}
        self.running = {"s": 3, "m": 2}

    async def refresh(self) -> list[dict]:
        return []


class _Front:
    def __init__(self) -> None:
        self.published: dict[str, list[tuple[str, int]]] = {}
        self.sequence_keys: frozenset[str] = frozenset()

    async def publish(self, routes, sequence_keys=frozenset()) -> None:
        self.published, self.sequence_keys = dict(routes), sequence_keys


def test_the_route_table_publishes_a_listener_per_slot_and_tells_the_replicas():
    async def scenario() -> None:
        front = _Front()
        table = RouteTable(_State(), front)  # type: ignore[arg-type]  # stand-ins
        await table.register("s/r1", "s", "10.0.0.1", 1000, sequences=True)
        await table.register("m/r1", "m", "10.0.0.3", 1000)
        await table.register("m/r2", "m", "10.0.0.4", 1000)
        await table.register("s/r2", "s", "10.0.0.2", 1000, sequences=True)
        assert front.sequence_keys == {"s/1", "s/"}
        assert front.published["m/1"] == [("10.0.0.3", 1000), ("10.0.0.4", 1000)]
        slots = front.published["s/1"]
        assert len(slots) == SLOTS and Counter(slots) == {("10.0.0.1", 1000): 32, ("10.0.0.2", 1000): 32}
        assert table.slot_listeners("s") == slots and table.slot_listeners("m") is None
        await table.register("s/r3", "s", "10.0.0.5", 1000, sequences=True)
        moved = [(before, after) for before, after in zip(slots, front.published["s/"]) if before != after]
        assert len(moved) == 21 and all(after == ("10.0.0.5", 1000) for _, after in moved)
        await table.withdraw("s/r1")
        assert ("10.0.0.1", 1000) not in front.published["s/"]
        assert table.slot_listeners("s") == front.published["s/"]

    asyncio.run(scenario())
