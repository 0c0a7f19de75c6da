"""The router's guarantees (rayinfer.transport.router's docstring), each as a property."""

from __future__ import annotations

import math
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from rayinfer.transport.router import (
    ConnectionPlacement,
    ModelRoute,
    Replica,
    RouteTable,
    VersionSplit,
    pick_version,
    run_length,
)
from rayinfer.serving.sequence_routing import SLOTS, slot_of

NODES = ("n1", "n2", "n3")
replica_lists = st.lists(
    st.builds(Replica, key=st.integers(0, 10_000), node=st.sampled_from(NODES), load=st.integers(0, 50)),
    min_size=1, max_size=8, unique_by=lambda r: r.key)


def _table(weight: int = 0, replicas: list[Replica] | None = None, slots: list[int] | None = None,
           seed: int = 0, sticky_header: str = "") -> RouteTable:
    split = VersionSplit("1", "2", weight, sticky_header) if weight else None
    rows = {"1": replicas or [Replica("a")], "2": replicas or [Replica("b")]}
    return RouteTable({"m": ModelRoute("1", split, rows, {"1": slots or [], "2": slots or []})},
                      random.Random(seed))


@given(st.integers(1, 99), st.integers(0, 2**32))
@settings(max_examples=25, deadline=None)
def test_each_versions_share_is_its_weight(weight: int, seed: int) -> None:
    table, n = _table(weight, seed=seed), 4000
    candidate = sum(table.pick("m").version == "2" for _ in range(n))
    mean, sd = n * weight / 100, math.sqrt(n * weight / 100 * (1 - weight / 100))
    assert abs(candidate - mean) <= 4.5 * sd, (weight, candidate)


@given(st.integers(0, 100), st.text(min_size=1), st.integers(0, 2**32))
@settings(max_examples=200, deadline=None)
def test_a_sticky_value_always_reaches_the_same_version(weight: int, sticky: str, seed: int) -> None:
    table = _table(weight, seed=seed, sticky_header="x-user")
    assert len({table.pick("m", sticky=sticky).version for _ in range(5)}) == 1


def test_a_named_version_and_a_model_without_a_split_ignore_chance() -> None:
    table = _table(50)
    assert {table.pick("m", "1").version for _ in range(50)} == {"1"}
    assert {_table(0).pick("m").version for _ in range(50)} == {"1"}
    assert table.pick("unknown") is None


@given(replica_lists, st.one_of(st.integers(0, 2**64 - 1), st.text()), st.sampled_from(NODES), st.integers(0, 2**32))
@settings(max_examples=200, deadline=None)
def test_a_sequence_reaches_its_slots_replica_from_any_node(replicas, sequence_id, node, seed) -> None:
    slots = [replicas[i % len(replicas)].key for i in range(SLOTS)]
    table = _table(replicas=replicas, slots=slots, seed=seed)
    picked = {table.pick("m", "1", sequence_id=sequence_id, node=n).replica.key for n in (*NODES, node)}
    assert picked == {slots[slot_of(sequence_id)]}


@given(replica_lists, st.sampled_from(NODES), st.integers(0, 2**32))
@settings(max_examples=200, deadline=None)
def test_a_local_replica_comes_first(replicas, node, seed) -> None:
    picked = _table(replicas=replicas, seed=seed).pick("m", "1", node=node).replica
    if any(r.node == node for r in replicas):
        assert picked.node == node
    else:
        assert picked in replicas


@given(replica_lists, st.integers(0, 2**32))
@settings(max_examples=200, deadline=None)
def test_the_most_loaded_of_several_replicas_is_never_picked(replicas, seed) -> None:
    table = _table(replicas=replicas, seed=seed)
    most = max(r.load for r in replicas)
    busiest = [r for r in replicas if r.load == most]
    for _ in range(10):
        picked = table.pick("m", "1").replica
        if len(replicas) > 1 and len(busiest) == 1:
            assert picked != busiest[0]


def test_a_pooled_replica_serves_the_versions_it_holds() -> None:
    pool = [Replica("p1", models=frozenset({"m/1", "other/1"})), Replica("p2", models=frozenset({"other/1"}))]
    table = RouteTable({"m": ModelRoute("1", replicas={"1": pool})})
    assert {table.pick("m").replica.key for _ in range(20)} == {"p1"}
    empty = RouteTable({"m": ModelRoute("1", replicas={"1": [pool[1]]})})
    assert empty.pick("m").replica is None


@given(st.integers(1, 99), st.booleans(), st.integers(1, 400), st.integers(0, 2**32))
@settings(max_examples=100, deadline=None)
def test_connections_placed_in_runs_keep_each_versions_share(weight, grpc, connections, seed) -> None:
    random.seed(seed)  # the runs' fractional lengths are rounded by chance
    placement, split = ConnectionPlacement(expire_s=60.0), VersionSplit("1", "2", weight)
    placed = {"1": 0, "2": 0}
    for client in range(connections):  # each connection placed for a run, then given back
        key, run = placement.place("m/", split, grpc, True, list, "", ("10.0.0.1", client), bool, float(client))
        placed[key.removeprefix("m/")] += run
        placement.leaves(("10.0.0.1", client))
    total, longest = sum(placed.values()), max(run_length(split, v, grpc) + 1 for v in ("1", "2"))
    # A run goes to the version furthest behind its share, so neither is more than one run off.
    assert abs(placed["2"] - total * weight / 100) <= longest


@given(st.integers(0, 100), st.text(min_size=1), st.sampled_from(["", "m/1", "m/2 5"]))
@settings(max_examples=200, deadline=None)
def test_a_connections_sticky_value_places_it_at_its_version(weight, sticky, directed) -> None:
    split = VersionSplit("1", "2", weight, "x-user")
    key, run = ConnectionPlacement(60.0).place("m/", split, False, True, lambda: [(b"X-User", sticky)], directed,
                                               ("10.0.0.1", 1), bool, 0.0)
    assert (key, run) == ("m/2" if pick_version(split, sticky) == "2" else "m/", 0)
