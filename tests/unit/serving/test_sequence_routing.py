"""Routing slots of sequence models: assignment as replicas come and go, and a replica's view."""

from __future__ import annotations

import asyncio
import zlib
from collections import Counter

from rayinfer.deployments.control_channel import SEQUENCE_SLOTS
from rayinfer.deployments.route_table import RouteTable
from rayinfer.serving.sequence_routing import SLOTS, SequenceRoutes, assign_slots, previous_owners, slot_of


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
    held: set = set()
    assert routes.owner({"sequence_id": 5}, held.__contains__) is None  # no table yet: here
    table = [("10.0.0.1", 1000) if slot % 2 else ("10.0.0.2", 2000) for slot in range(SLOTS)]
    routes.update({"listeners": table, "previous": [None] * SLOTS})
    mine = next(i for i in range(1, 1000) if slot_of(i) % 2)
    theirs = next(i for i in range(1, 1000) if not slot_of(i) % 2)
    assert routes.owner({"sequence_id": mine}, held.__contains__) is None
    assert routes.owner({"sequence_id": theirs}, held.__contains__) == ("10.0.0.2", 2000)
    assert routes.owner({"sequence_id": str(theirs)}, held.__contains__) == ("10.0.0.2", 2000)  # same slot as text
    # A sequence that began here before its slot moved away stays here; its restart goes.
    held.add(theirs)
    assert routes.owner({"sequence_id": theirs}, held.__contains__) is None
    assert routes.owner({"sequence_id": theirs, "sequence_start": True}, held.__contains__) == ("10.0.0.2", 2000)
    # No sequence named (Triton's error comes from this replica's batcher).
    assert routes.owner({}, held.__contains__) is None and routes.owner({"sequence_id": 0}, held.__contains__) is None
    routes.update(None)
    assert routes.owner({"sequence_id": theirs + 1}, held.__contains__) is None


def test_a_slot_taken_from_a_running_replica_sends_its_unknown_sequences_back_there():
    routes = SequenceRoutes(("10.0.0.2", 2000))
    routes.update({"listeners": [("10.0.0.2", 2000)] * SLOTS, "previous": [("10.0.0.1", 1000)] * SLOTS})
    held = {42}
    assert routes.owner({"sequence_id": 7}, held.__contains__) == ("10.0.0.1", 1000)  # began there
    assert routes.owner({"sequence_id": 7, "sequence_start": True}, held.__contains__) is None  # new: here
    assert routes.owner({"sequence_id": 42}, held.__contains__) is None  # began here


def test_previous_replicas_are_those_slots_were_taken_from_while_they_run():
    two = assign_slots(["a"] * SLOTS, ["a", "b"])
    previous = previous_owners(["a"] * SLOTS, two, None, ["a", "b"])
    assert [p for p, o in zip(previous, two) if o == "b"] == ["a"] * 32
    assert all(p is None for p, o in zip(previous, two) if o == "a")
    # Unchanged slots keep their previous replica; it goes when that replica leaves.
    assert previous_owners(two, two, previous, ["a", "b"]) == previous
    one = assign_slots(two, ["b"])
    assert previous_owners(two, one, previous, ["b"]) == [None] * SLOTS


class _State:
    def __init__(self) -> None:
        self.routes = {"s/1": ("s", "s_v1"), "s/": ("s", "s_v1"), "m/1": ("m", "m_v1")}
        self.running = {"s": 3, "m": 2}
        self.splits: dict = {}

    async def refresh(self) -> list[dict]:
        return []


class _Front:
    def __init__(self) -> None:
        self.published: dict[str, list[tuple[str, int]]] = {}
        self.sequence_keys: frozenset[str] = frozenset()

    async def publish(self, routes, sequence_keys=frozenset(), splits=None) -> None:
        self.published, self.sequence_keys = dict(routes), sequence_keys


def test_the_route_table_publishes_a_listener_per_slot_and_tells_the_replicas():
    async def scenario() -> None:
        told: dict[str, list[dict]] = {}

        async def replica(table: RouteTable, key: str) -> None:
            """A sequence model replica's long poll on the control channel."""
            epoch, acked = None, 0
            while True:
                epoch, messages = await table.channel.poll(key, epoch, acked)
                for seq, message in messages:
                    assert message.kind == SEQUENCE_SLOTS
                    told.setdefault(key, []).append(message.body)
                    acked = seq

        front = _Front()
        table = RouteTable(_State(), front)  # type: ignore[arg-type]  # stand-ins
        pollers = [asyncio.create_task(replica(table, key)) for key in ("s/r1", "s/r2", "s/r3")]
        await table.register("s/r1", "s", "127.0.0.1", 1, sequences=True)
        await table.register("m/r1", "m", "127.0.0.1", 3)
        await table.register("m/r2", "m", "127.0.0.1", 4)
        await table.register("s/r2", "s", "127.0.0.1", 2, sequences=True)
        assert front.sequence_keys == {"s/1", "s/"}
        assert front.published["m/1"] == [("127.0.0.1", 3), ("127.0.0.1", 4)]
        slots = front.published["s/1"]
        assert len(slots) == SLOTS and Counter(slots) == {("127.0.0.1", 1): 32, ("127.0.0.1", 2): 32}
        # The replicas took the new table before the front routed by it.
        # Each table names its application (a pool replica's mailbox holds every version's).
        assert told["s/r1"][-1] == told["s/r2"][-1] == {**table.slot_table("s"), "app": "s"}
        assert [tuple(a) for a in table.slot_table("s")["listeners"]] == slots and table.slot_table("m") is None
        await table.register("s/r3", "s", "127.0.0.1", 5, sequences=True)
        moved = [(before, after) for before, after in zip(slots, front.published["s/"]) if before != after]
        assert len(moved) == 21 and all(after == ("127.0.0.1", 5) for _, after in moved)
        # The replicas those slots were taken from still run: each slot's previous replica.
        previous = [tuple(a) if a else None for a in table.slot_table("s")["previous"]]
        after = front.published["s/"]
        assert all(previous[slot] == slots[slot] for slot in range(SLOTS) if after[slot] != slots[slot])
        await table.withdraw("s/r1")
        assert ("127.0.0.1", 1) not in front.published["s/"]
        assert [tuple(a) for a in table.slot_table("s")["listeners"]] == front.published["s/"]
        assert ["127.0.0.1", 1] not in table.slot_table("s")["previous"]
        assert told["s/r2"][-1] == told["s/r3"][-1] == {**table.slot_table("s"), "app": "s"}
        assert told["s/r1"][-1] != {**table.slot_table("s"), "app": "s"}  # withdrawn: told nothing more
        # No model replica of "m" hears of sequence slots.
        assert "m/r1" not in told and "m/r2" not in told
        for poller in pollers:
            poller.cancel()

    asyncio.run(scenario())
