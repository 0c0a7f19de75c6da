"""Changes to the model pool's list of versions (deployments/pool_control.py), without Ray: two
loads at once both end in the pool, although Serve's details still show the list from before
either (its controller applies a new user_config a moment later)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from rayinfer.deployments import pool_control
from rayinfer.deployments.replica_options import ModelControl


@pytest.fixture
def runs(monkeypatch) -> list[dict[str, Any]]:
    """Each list of versions the pool is deployed with; Serve's details never catch up."""
    deployed: list[dict[str, Any]] = []

    def run(control, specs) -> None:
        time.sleep(0.05)  # a deploy's own time, for two changes to overlap
        deployed.append(dict(specs))

    monkeypatch.setattr(pool_control, "_deployed", None)
    monkeypatch.setattr(pool_control, "pooled_specs", lambda details=None: {"old": ("old", 1, {})})
    monkeypatch.setattr(pool_control, "_run_pool", run)
    monkeypatch.setattr(pool_control, "_wait_dropped", lambda names, control: None)
    return deployed


def _spec(name: str) -> tuple[str, tuple[str, int, dict[str, Any]]]:
    return name, (name, 1, {"repository": "/repo"})


def test_two_loads_at_once_both_end_in_the_pool(runs, monkeypatch):
    monkeypatch.setattr(pool_control, "_wait_for_pool", lambda names, control: {})
    loads = [threading.Thread(target=pool_control.deploy_pool, args=(ModelControl(),),
                              kwargs={"add": {name: _spec(name)}}) for name in ("a", "b")]
    for thread in loads:
        thread.start()
    for thread in loads:
        thread.join()
    assert set(runs[-1]) == {"old", "a", "b"}
    pool_control.deploy_pool(ModelControl(), drop={"a"})
    assert set(runs[-1]) == {"old", "b"}


def test_a_version_that_fails_to_load_leaves_the_others_in(runs, monkeypatch):
    monkeypatch.setattr(pool_control, "_wait_for_pool",
                        lambda names, control: {name: "cannot be read" for name in names if name == "broken"})
    assert pool_control.deploy_pool(ModelControl(), add={"good": _spec("good")}) == {}
    assert pool_control.deploy_pool(ModelControl(), add={"broken": _spec("broken")}) == {"broken": "cannot be read"}
    assert set(runs[-1]) == {"old", "good"}
