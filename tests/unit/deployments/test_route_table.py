"""The front's route table during an unload (no Ray: stand-ins for Serve's state and the front)."""

from __future__ import annotations

import asyncio

from rayinfer.deployments.route_table import RouteTable


class _State:
    """Serve's state as the route table reads it: two models, one replica each, running."""

    def __init__(self) -> None:
        self.routes = {"m/1": ("m", "m_v1"), "m/": ("m", "m_v1"), "other/1": ("other", "other_v1")}
        self.splits: dict = {}
        self.running = {"m": 1, "other": 1}

    async def refresh(self) -> list[dict]:
        return []

    def forget_routes(self, model: str) -> None:
        self.routes = {k: v for k, v in self.routes.items() if not k.startswith(f"{model}/")}

    def invalidate(self) -> None:
        """Nothing cached here."""


class _Front:
    def __init__(self) -> None:
        self.published: dict[str, list[tuple[str, int]]] = {}
        self.sequence_keys: frozenset[str] = frozenset()
        self.publications = 0

    async def publish(self, routes: dict[str, list[tuple[str, int]]], sequence_keys: frozenset[str] = frozenset(),
                      splits: dict | None = None) -> None:
        self.published = dict(routes)
        self.sequence_keys = sequence_keys
        self.publications += 1


def test_a_replica_of_a_model_being_unloaded_withdraws_at_once_and_others_still_publish():
    """Serve stops an unloaded model's replica during the unload; its withdrawal, and another
    model's, do not wait for that unload (one waited out its 5 s timeout once)."""
    async def scenario() -> None:
        front = _Front()
        table = RouteTable(_State(), front)  # type: ignore[arg-type]  # stand-ins
        await table.register("m/r1", "m", "10.0.0.1", 1000)
        await table.register("other/r1", "other", "10.0.0.2", 1000)
        assert set(front.published) == {"m/1", "m/", "other/1"}
        async with table.withdrawn("m"):
            assert set(front.published) == {"other/1"}
            await asyncio.wait_for(table.withdraw("m/r1"), 1.0)
            assert table.listeners("m") == []
            # Another model's replica withdraws at once too: its publication leaves the model
            # being unloaded out (Serve still reports it running).
            await asyncio.wait_for(table.withdraw("other/r1"), 1.0)
            assert table.listeners("other") == [] and not set(front.published) & {"other/1", "m/1", "m/"}
        assert "other/1" not in front.published

    asyncio.run(scenario())


def test_a_registration_that_arrives_after_its_replica_withdrew_is_dropped():
    """A stopping replica's last registration, sent before it withdrew, does not bring its
    listener back (it would be routed to, then reported lost when it stops registering)."""
    async def scenario() -> None:
        front = _Front()
        table = RouteTable(_State(), front)  # type: ignore[arg-type]  # stand-ins
        await table.register("m/r1", "m", "10.0.0.1", 1000)
        await table.withdraw("m/r1")
        await table.register("m/r1", "m", "10.0.0.1", 1000)
        assert table.listeners("m") == [] and "m/1" not in front.published
        await table.register("m/r2", "m", "10.0.0.1", 1001)
        assert table.listeners("m") == [("10.0.0.1", 1001)]

    asyncio.run(scenario())


def test_the_start_waits_for_routes_but_not_for_pooled_versions_the_pool_holds_unloaded():
    """``rayinfer serve`` waits for the front to route what it deployed before it says it started;
    a pooled version unloaded past --pool-max-models has no listener until its next request, so
    waiting for it would hold the start for the whole timeout."""
    from rayinfer.deployments.serve_state import NOT_RESIDENT

    class _Pooled(_State):
        async def refresh(self) -> list[dict]:
            return [{"name": "m", "version": "1", "state": "READY", "reason": ""},
                    {"name": "other", "version": "1", "state": "READY", "reason": NOT_RESIDENT}]

    async def scenario() -> None:
        front = _Front()
        table = RouteTable(_Pooled(), front)  # type: ignore[arg-type]  # stand-ins
        await table.register("m/r1", "m", "10.0.0.1", 1000)
        started = asyncio.get_running_loop().time()
        await table.wait_routed("m", "other", timeout_s=5.0)
        assert asyncio.get_running_loop().time() - started < 1.0
        assert set(front.published) == {"m/1", "m/"}

    asyncio.run(scenario())
