"""Which model versions the front routes, from Serve's application status (no Ray: Serve's
status stood in for, the real repository scan)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rayinfer.cluster.example_repository import write_example_repository
from rayinfer.deployments import serve_state
from rayinfer.deployments.names import model_app_name, model_deployment_name
from rayinfer.deployments.serve_state import ApplicationState, DeploymentState, ServeState
from rayinfer.serving.model_control import ModelController


def app(status: str, running: int, message: str = "") -> ApplicationState:
    deployment = DeploymentState(status, message, {"RUNNING": running} if running else {}, target_replicas=2)
    return ApplicationState(status, message, {model_deployment_name("simple", 1): deployment})


@pytest.mark.parametrize("status,running,routed,state", [
    ("RUNNING", 2, True, "READY"),
    # A replica died: Serve reports the application UNHEALTHY until its new replica runs; the
    # other replica serves meanwhile.
    ("UNHEALTHY", 1, True, "READY"),
    ("UNHEALTHY", 0, False, "UNAVAILABLE"),
    ("DEPLOYING", 0, False, "LOADING"),
    ("DEPLOY_FAILED", 0, False, "UNAVAILABLE"),
])
def test_a_version_is_routed_while_a_replica_of_it_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         status: str, running: int, routed: bool, state: str) -> None:
    write_example_repository(tmp_path)
    apps = {model_app_name("simple", 1, True): app(status, running, "replica died")}
    monkeypatch.setattr(serve_state, "serve_applications", lambda: apps)
    monkeypatch.setattr(serve_state, "resource_shortage", lambda application, apps=None: None)
    state_of = ServeState(tmp_path, ModelController(tmp_path, deployer=None))  # type: ignore[arg-type]  # never deploys
    (row,) = [r for r in asyncio.run(state_of.refresh()) if r["name"] == "simple"]
    assert row["state"] == state
    assert (state_of.route("simple", "") is not None, state_of.running.get(model_app_name("simple", 1, True))) == (
        routed, running if routed else None)
