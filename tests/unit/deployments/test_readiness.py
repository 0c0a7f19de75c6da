"""Strict readiness of the ``/v2`` replica (no Ray: stand-ins for the controller, Serve's state
and the route table)."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

from rayinfer.deployments.v2_api import V2Api


class _State:
    """Serve's state as V2Api reads it: the deployed models and their index rows."""

    def __init__(self) -> None:
        self.deployed: set[str] = set()
        self.invalidations = 0

    async def refresh(self) -> list[dict]:
        return [{"name": m, "version": "1", "state": "READY"} for m in sorted(self.deployed)]

    def invalidate(self) -> None:
        self.invalidations += 1  # nothing is cached here; counted only


class _Routes:
    def routes_version(self, model: str, version: str) -> bool:
        return True

    @contextlib.asynccontextmanager
    async def withdrawn(self, model: str):
        yield


def api() -> tuple[V2Api, _State]:
    state = _State()
    controller = SimpleNamespace(explicit=True, load_errors={}, unload=lambda model: state.deployed.discard(model))
    return V2Api("triton", True, controller, state, _Routes()), state  # type: ignore[arg-type]  # stand-ins


def test_ready_once_every_startup_model_is_served_or_failed() -> None:
    v2, state = api()
    v2.startup_pending = {"a", "b"}
    assert not asyncio.run(v2.ready())
    state.deployed.add("a")
    v2.controller.load_errors["b"] = "broken"
    assert asyncio.run(v2.ready())


def test_a_startup_model_unloaded_before_it_was_served_is_not_waited_for() -> None:
    v2, state = api()
    v2.startup_pending = {"a", "b"}
    state.deployed.add("a")
    asyncio.run(v2.change_model("unload", "b", {}))
    assert asyncio.run(v2.ready()) and v2.startup_pending == set()
