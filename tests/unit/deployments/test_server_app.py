"""The ``/v2`` application as ``rayinfer serve`` builds it (no Ray cluster)."""

from __future__ import annotations

from pathlib import Path

from rayinfer.deployments.app import server_application


def test_a_rerun_with_new_load_errors_keeps_the_code_version(tmp_path: Path) -> None:
    """``rayinfer serve`` runs the app again once models failed to load: with this launch's
    version and only ``user_config`` changed, Serve reconfigures the replica in place."""
    first = server_application(str(tmp_path), version="launch-1", startup_models=["m"])._bound_deployment
    again = server_application(str(tmp_path), load_errors={"m": "broken"}, version="launch-1",
                               startup_models=["m"])._bound_deployment
    assert first.version == again.version == "launch-1"
    assert (first.user_config, again.user_config) == ({"load_errors": {}, "startup_models": ["m"]},
                                                      {"load_errors": {"m": "broken"}, "startup_models": ["m"]})
    assert first.init_args == again.init_args
    # Without a version (Serve configs), Serve keeps choosing the version itself.
    assert server_application(str(tmp_path))._bound_deployment.version is None
