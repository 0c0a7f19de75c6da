"""The rollouts' decisions and routing in the /v2 replica, with Serve's state, model control and
the route table standing in (no Ray): a start splits version-less requests, a failing candidate
is rolled back on the next judging, a good one steps up and is promoted, and a rollout survives
being saved and read back."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from rayinfer.deployments import rollouts as rollouts_module
from rayinfer.deployments.control_channel import ROLLOUT_SPLIT, ControlChannel
from rayinfer.deployments.rollout_store import Rollout
from rayinfer.deployments.rollouts import Rollouts
from rayinfer.deployments.serve_state import ServeState
from rayinfer.protocol.statistics import ModelStatistics
from rayinfer.repository.rollout_config import RolloutSettings
from rayinfer.serving.statistics_store import StatisticsStore


class _Routes:
    """The route table's part rollouts use: publications counted, a real control channel."""

    def __init__(self, replicas: tuple[str, ...] = ()) -> None:
        self.published = 0
        self.channel = ControlChannel()
        self._replicas = list(replicas)

    async def publish(self) -> None:
        self.published += 1

    def model_replicas(self, model: str) -> list[str]:
        return [replica for replica in self._replicas if replica.split("/")[0].split("@v")[0] == model]


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


def test_the_model_replicas_are_told_each_split_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(rollouts_module, "_TELL_TIMEOUT_S", 0.01)  # nobody polls here
    api = _api(tmp_path)
    api.routes = _Routes(("m@v1/r1", "m/r2", "n/r3"))
    rollouts = Rollouts(api, "test")  # type: ignore[arg-type]

    async def told(replica: str) -> list[dict]:
        _, messages = await api.routes.channel.poll(replica, None, 0, wait_s=0)
        return [m.body for _, m in messages if m.kind == ROLLOUT_SPLIT]

    async def scenario() -> None:
        await rollouts.start("m", "1", "2", RolloutSettings(steps=(30, 100), sticky_header="x-user"), "a test")
        expected = {"model": "m", "version_less": {"1": False, "2": False},
                    "split": {"stable": "1", "candidate": "2", "weight": 30, "sticky_header": "x-user"}}
        assert await told("m@v1/r1") == [expected] and await told("m/r2") == [expected]
        assert await told("n/r3") == []  # another model's replica
        await rollouts.abort("m")
        ended = (await told("m/r2"))[-1]
        assert ended["split"] is None and ended["version_less"] == {"1": True, "2": False}

    asyncio.run(scenario())


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
