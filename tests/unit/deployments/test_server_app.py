"""The ``/v2`` application as ``rayinfer serve`` builds it (no Ray cluster)."""

from __future__ import annotations

from pathlib import Path

from rayinfer.deployments.app import server_application


def test_the_start_reaches_the_replica_as_arguments_not_as_user_config(tmp_path: Path) -> None:
    """One ``serve.run`` per launch: the models to wait for, those that could not be read and the
    launch are the replica's arguments (the end of the start is a call, :meth:`startup_ended`);
    Serve has no user_config to reconfigure it with."""
    deployment = server_application(str(tmp_path), load_errors={"m": "broken"}, launch="launch-1",
                                    startup_models=["n", "m"])._bound_deployment
    assert deployment.user_config is None
    assert deployment.init_kwargs == {"startup_models": ["m", "n"], "load_errors": {"m": "broken"}, "launch": "launch-1"}
    # A Serve config has no launch: nothing tells its replica when the start ended.
    assert server_application(str(tmp_path))._bound_deployment.init_kwargs == {
        "startup_models": [], "load_errors": {}, "launch": None}
