"""The rollouts' decisions and routing in the /v2 replica, with Serve's state, model control and
the route table standing in (no Ray): a start splits version-less requests, a failing candidate
is rolled back on the next judging, a good one steps up and is promoted, and a rollout survives
being saved and read back."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from rayinfer.deployments.rollouts import Rollout, Rollouts
from rayinfer.deployments.serve_state import ServeState
from rayinfer.protocol.statistics import ModelStatistics
from rayinfer.repository.rollout_config import RolloutSettings
from rayinfer.serving.statistics_store import StatisticsStore


class _Routes:
    def __init__(self) -> None:
        self.published = 0

    async def publish(self) -> None:
        self.published += 1


def _api(tmp_path: Path) -> SimpleNamespace:
    controller = SimpleNamespace(kept={}, repository=tmp_path, release_kept=lambda model: None)
    state = ServeState(tmp_path, controller)  # type: ignore[arg-type]  # a stand-in controller
    state.routes = {"m/1": ("m@v1", "m_v1"), "m/2": ("m", "m_v2"), "m/": ("m", "m_v2")}

    async def refresh() -> list:
        return []

    state.refresh = refresh  # type: ignore[method-assign]  # Serve is not read here
    return SimpleNamespace(state=state, controller=controller, routes=_Routes(), statistics=StatisticsStore())


def _report(api, version: str, successes: int, failures: int, latency_ms: float = 2.0) -> None:
    stats = ModelStatistics()
    for _ in range(successes):
        stats.record_success(int(latency_ms * 1e6), 10_000)
    for _ in range(failures):
        stats.record_failure(1_000_000)
    api.statistics.report(f"replica-{version}-{successes}", "m", version, stats.snapshot())


def test_a_rollout_splits_then_rolls_back_a_failing_candidate(tmp_path):
    api = _api(tmp_path)
    rollouts = Rollouts(api, "test")  # type: ignore[arg-type]
    settings = RolloutSettings(steps=(20, 100), step_seconds=0, step_requests=10)
    doc = asyncio.run(rollouts.start("m", "1", "2", settings, "a test"))
    assert (doc["state"], doc["weight"]) == ("PROGRESSING", 20)
    assert api.state.splits["m"].weight == 20 and api.state.routes["m/"] == ("m@v1", "m_v1")  # the stable one
    assert api.controller.kept == {"m": 1}
    assert not rollouts.routes_version_less("m", "1") and not rollouts.routes_version_less("m", "2")
    _report(api, "1", 100, 0)
    _report(api, "2", 8, 4)  # a third failed
    asyncio.run(rollouts.tick())
    doc = rollouts.status("m")
    assert (doc["state"], doc["weight"]) == ("ROLLED_BACK", 0)
    assert "failure rate 33.3%" in doc["decisions"][-1]["reason"]
    assert "m" not in api.state.splits and api.state.routes["m/"] == ("m@v1", "m_v1")
    assert rollouts.routes_version_less("m", "1") and not rollouts.routes_version_less("m", "2")


def test_a_good_candidate_steps_up_and_is_promoted(tmp_path):
    api = _api(tmp_path)
    rollouts = Rollouts(api, "test")  # type: ignore[arg-type]
    asyncio.run(rollouts.start("m", "1", "2", RolloutSettings(steps=(50, 100), step_seconds=0, step_requests=5), "a test"))
    _report(api, "1", 50, 0)
    _report(api, "2", 20, 0)
    asyncio.run(rollouts.tick())
    assert rollouts.status("m")["weight"] == 100 and api.state.routes["m/"] == ("m", "m_v2")
    assert "m" not in api.state.splits and rollouts.routes_version_less("m", "2")
    _report(api, "2", 40, 0)
    asyncio.run(rollouts.tick())
    doc = rollouts.status("m")
    assert doc["state"] == "PROMOTED" and [d["action"] for d in doc["decisions"]] == ["started", "step", "promoted"]
    assert rollouts.routes_version_less("m", "2") and not rollouts.routes_version_less("m", "1")


def test_a_rollout_reads_back_as_it_was_saved(tmp_path):
    api = _api(tmp_path)
    rollouts = Rollouts(api, "test")  # type: ignore[arg-type]
    asyncio.run(rollouts.start("m", "1", "2", RolloutSettings(sticky_header="x-user", shadow_percent=10), "a test"))
    saved = rollouts.status("m")
    again = Rollout.from_dict(saved)
    assert again.as_dict() == {k: v for k, v in saved.items() if k not in ("figures", "shadow")}
    assert again.split() is not None and again.split().sticky_header == "x-user"
    target = rollouts.shadow_target("m", "1")
    assert target == {"candidate": "2", "app": "m", "deployment": "m_v2", "percent": 10, "tolerance": 1e-5}
    assert rollouts.shadow_target("m", "2") is None
