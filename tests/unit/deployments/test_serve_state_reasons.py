"""Why a model failed, in one line, from Serve's failure messages; why its replicas wait, from
Ray's resources and pending demand."""

from __future__ import annotations

import pytest

from rayinfer.deployments import serve_state
from rayinfer.deployments.serve_state import ApplicationState, DeploymentState, resource_shortage, short_reason


def test_the_exception_line_of_a_traceback() -> None:
    message = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
               "rayinfer.protocol.errors.ModelConfigError: model.onnx: not an ONNX model\n")
    assert short_reason(message) == "model.onnx: not an ONNX model"


def test_pips_own_error_when_a_runtime_environment_failed() -> None:
    message = ("ray.exceptions.RuntimeEnvSetupError: Failed to set up runtime environment.\n"
               "Run cmd[13] failed with the following details.\n"
               "ERROR: Could not find a version that satisfies the requirement nope==1 (from versions: none)\n"
               "ERROR: No matching distribution found for nope==1\n")
    assert short_reason(message) == "pip could not install the model's requirements: No matching distribution found for nope==1"


def _app(unplaced: int, required: dict[str, float], target: int = 3) -> ApplicationState:
    deployment = DeploymentState("UPDATING", "", {"STARTING": unplaced}, target, required.get("GPU", 0.0), required,
                                 unplaced)
    return ApplicationState("DEPLOYING", "", {"d": deployment})


def _figures(monkeypatch: pytest.MonkeyPatch, free: dict[str, float], total: dict[str, float],
             pending: list[tuple[dict[str, float], int]]) -> None:
    """Ray's figures as resource_shortage reads them (the cluster tests read real ones)."""
    monkeypatch.setattr(serve_state, "_cluster_figures", lambda: (free, total, pending))


def test_replicas_ray_holds_waiting_are_reported_with_what_they_need_and_what_to_change(monkeypatch) -> None:
    _figures(monkeypatch, {"CPU": 0.05}, {"CPU": 2.0}, [({"CPU": 0.3}, 2)])
    shortage = resource_shortage(_app(2, {"CPU": 0.3}))
    assert shortage is not None and not shortage.gpu and shortage.resources == "CPU"
    assert shortage.text == ("2 of its 3 replicas need 0.3 CPU each; the cluster has 2 CPU (0.05 CPU free). Unload a "
                             "model, lower --replica-num-cpus or the model's instance count, or add a node")


def test_a_replica_whose_worker_starts_is_not_reported(monkeypatch) -> None:
    # Two replicas of this shape not placed as Serve sees them, one waiting in Ray's demand: the
    # other was granted its CPUs and starts its worker, and it may be this application's.
    _figures(monkeypatch, {"CPU": 0.0}, {"CPU": 2.0}, [({"CPU": 0.1}, 1)])
    apps = {"a": _app(1, {"CPU": 0.1}), "b": _app(1, {"CPU": 0.1})}
    assert resource_shortage(apps["a"], apps) is None
    _figures(monkeypatch, {"CPU": 0.0}, {"CPU": 2.0}, [])  # nothing waits: every one is starting
    assert resource_shortage(_app(1, {"CPU": 0.1})) is None
    _figures(monkeypatch, {"CPU": 0.0}, {"CPU": 2.0}, [({"CPU": 0.2}, 5)])  # another shape waits
    assert resource_shortage(_app(1, {"CPU": 0.1})) is None


def test_gpus_keep_their_message_and_memory_is_given_in_gib(monkeypatch) -> None:
    _figures(monkeypatch, {"CPU": 1.0, "GPU": 0.0}, {"CPU": 2.0, "GPU": 1.0}, [({"CPU": 0.1, "GPU": 0.5}, 1)])
    shortage = resource_shortage(_app(1, {"CPU": 0.1, "GPU": 0.5}, target=1))
    assert shortage is not None and shortage.gpu
    assert shortage.text == "1 of its 1 replicas need 0.5 GPU each; the cluster has 1 GPU(s), 0 free"
    _figures(monkeypatch, {"CPU": 1.0, "memory": 2**30}, {"CPU": 2.0, "memory": 150 * 2**30},
             [({"CPU": 0.1, "memory": 4 * 2**30}, 1)])
    shortage = resource_shortage(_app(1, {"CPU": 0.1, "memory": 4 * 2**30}, target=1))
    assert shortage is not None and shortage.resources == "memory"
    assert "need 4.0 GiB memory each; the cluster has 150.0 GiB memory (1.0 GiB memory free)" in shortage.text


def test_nothing_is_reported_when_rays_figures_cannot_be_read(monkeypatch) -> None:
    monkeypatch.setattr(serve_state, "_cluster_figures", lambda: None)
    assert resource_shortage(_app(2, {"CPU": 0.3})) is None
