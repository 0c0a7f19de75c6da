"""Which nodes get a front of their own, what each one binds, and how :class:`Fronts` starts,
publishes to and restarts them, with stand-ins for the node fronts' actors
(deployments/node_fronts.py); real fronts on two nodes: tests/integration/test_two_nodes.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rayinfer.deployments import node_fronts
from rayinfer.deployments.node_fronts import Fronts, front_nodes, node_endpoint

OWN = "10.0.0.1"
NODE = "ab" * 28  # a Ray node ID


def test_an_address_of_the_v2_replicas_node_becomes_each_nodes_own():
    assert node_endpoint(("10.0.0.1", 8000, "10.0.0.1", 9000), OWN, "10.0.0.7") == ("10.0.0.7", 8000, "10.0.0.7", 9000)


def test_wildcard_and_loopback_addresses_are_the_same_on_every_node():
    assert node_endpoint(("0.0.0.0", 8000, "127.0.0.1", 9000), OWN, "10.0.0.7") == ("0.0.0.0", 8000, "127.0.0.1", 9000)
    assert node_endpoint(("::", 8001, "127.0.0.1", 9001), OWN, "10.0.0.7") == ("::", 8001, "127.0.0.1", 9001)
    loopback = ("127.0.0.1", 8000, "127.0.0.1", 9000)
    assert node_endpoint(loopback, OWN, "10.0.0.7") == loopback
    assert node_endpoint(None, OWN, "10.0.0.7") is None


def test_a_front_goes_to_each_other_node_with_a_routed_replica():
    routes = {"simple/1": [("10.0.0.1", 30001), ("10.0.0.2", 30001)], "other/1": [("10.0.0.3", 30002)]}
    nodes = {"10.0.0.1": ["head"], "10.0.0.2": ["a"], "10.0.0.3": ["b"], "10.0.0.4": ["idle"]}
    assert front_nodes(routes, nodes, OWN) == {"a": "10.0.0.2", "b": "10.0.0.3"}


def test_nodes_sharing_an_address_get_no_front_of_their_own():
    """Ray nodes started on one machine share its ports: a second front there could not bind."""
    routes = {"simple/1": [("10.0.0.1", 30001), ("10.0.0.1", 30002), ("10.0.0.2", 30003)]}
    nodes = {"10.0.0.1": ["head", "worker"], "10.0.0.2": ["a", "b"]}
    assert front_nodes(routes, nodes, OWN) == {}


class _LocalFront:
    """The local front's side of the contract: the routes it last took."""

    def __init__(self) -> None:
        self.published: dict = {}
        self.sequence_keys: frozenset = frozenset()
        self.splits: dict = {}
        self.running = True

    async def publish(self, routes: dict, sequence_keys: frozenset = frozenset(), splits: dict | None = None) -> None:
        self.published, self.sequence_keys = dict(routes), frozenset(sequence_keys)
        self.splits = self.splits if splits is None else dict(splits)

    def stop(self) -> None:
        self.running = False


class _NodeActor:
    """A node front's actor: takes routes after ``started`` is set (its HAProxy starting)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.routes: list[dict] = []
        self.splits: list[dict] = []
        self.calls = 0
        self.stopped = False
        self.publish = SimpleNamespace(remote=self._publish)
        self.stop = SimpleNamespace(remote=self._stop)

    async def _publish(self, routes: dict, sequence_keys: frozenset, splits: dict) -> bool:
        self.calls += 1
        await self.started.wait()
        self.routes.append(dict(routes))
        self.splits.append(dict(splits))
        return True

    def _stop(self) -> None:
        self.stopped = True


def _fronts(monkeypatch: pytest.MonkeyPatch, nodes: dict[str, list[str]]) -> tuple[Fronts, list[_NodeActor]]:
    actors: list[_NodeActor] = []

    def make(*args) -> _NodeActor:
        actors.append(_NodeActor())
        return actors[-1]

    actor_class = SimpleNamespace(options=lambda **options: SimpleNamespace(remote=make))
    monkeypatch.setattr(node_fronts, "_actor_class", lambda: actor_class)
    fronts = Fronts(_LocalFront(), ("0.0.0.0", 8000, "127.0.0.1", 9000), None, {}, own_ip=OWN)

    async def live_nodes(routes):
        return nodes

    monkeypatch.setattr(fronts, "_live_nodes", live_nodes)
    return fronts, actors


def test_a_node_front_routes_only_once_it_has_the_latest_routes(monkeypatch: pytest.MonkeyPatch):
    """Routes published while a node's front starts (a model unloaded meanwhile) reach it before
    it counts as routing: it never routes by the routes it was started with."""
    async def scenario() -> None:
        fronts, actors = _fronts(monkeypatch, {OWN: ["head"], "10.0.0.2": [NODE]})
        both = {"m/1": [("10.0.0.2", 1)], "n/1": [("10.0.0.2", 2)]}
        await fronts.publish(both)
        while not actors or not actors[0].calls:  # placed, and its first routes sent
            await asyncio.sleep(0)
        assert NODE in fronts._starting
        await fronts.publish({"n/1": both["n/1"]})  # while it starts: it is not published to yet
        actors[0].started.set()
        await fronts._starting[NODE]
        assert fronts._ready == {NODE}
        assert actors[0].routes == [both, {"n/1": both["n/1"]}]
        # A rollout's split reaches the node's front as it reaches the local one.
        await fronts.publish(both, frozenset(), {"m": (30, "2", "x-user")})
        assert actors[0].splits[-1] == fronts.local.splits == {"m": (30, "2", "x-user")}
        await fronts.publish({})  # a node with no replica left loses its front
        await asyncio.sleep(0)
        assert actors[0].stopped and not fronts._actors

    asyncio.run(scenario())


def test_a_node_front_that_fails_is_started_again_after_a_back_off(monkeypatch: pytest.MonkeyPatch):
    async def scenario() -> None:
        fronts, actors = _fronts(monkeypatch, {OWN: ["head"], "10.0.0.2": [NODE]})
        routes = {"m/1": [("10.0.0.2", 1)]}
        await fronts.publish(routes)
        await asyncio.sleep(0)
        actors[0].started.set()
        await fronts._starting[NODE]

        async def dead(routes: dict, sequence_keys: frozenset, splits: dict) -> bool:
            raise RuntimeError("the actor died")

        actors[0].publish = SimpleNamespace(remote=dead)
        await fronts.publish(routes)
        assert actors[0].stopped and NODE not in fronts._actors
        await fronts.publish(routes)
        await asyncio.sleep(0)
        assert len(actors) == 1  # not before the back-off
        assert fronts.retry_delay(NODE) == node_fronts.RETRY_FIRST_S
        fronts._failed_at[NODE] -= node_fronts.RETRY_FIRST_S
        await fronts.publish(routes)
        await asyncio.sleep(0)
        assert len(actors) == 2 and NODE in fronts._starting
        # It fails again before it routes: the back-off doubles, up to RETRY_MAX_S.
        actors[1].publish = SimpleNamespace(remote=dead)
        await fronts._starting[NODE]
        assert NODE not in fronts._actors and fronts.retry_delay(NODE) == 2 * node_fronts.RETRY_FIRST_S
        fronts._failures[NODE] = 30
        assert fronts.retry_delay(NODE) == node_fronts.RETRY_MAX_S
        fronts._failures[NODE] = 1
        fronts._failed_at[NODE] -= node_fronts.RETRY_FIRST_S
        await fronts.publish(routes)
        await asyncio.sleep(0)
        actors[2].started.set()
        await fronts._starting[NODE]
        assert fronts._ready == {NODE} and fronts.retry_delay(NODE) == 0.0  # routing again: the count starts afresh
        fronts.stop()
        assert actors[2].stopped and fronts.local.running is False

    asyncio.run(scenario())
