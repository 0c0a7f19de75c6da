"""Deploys a scanned repository onto a running Ray cluster and waits for the models to load."""

from __future__ import annotations

import logging
import time
from typing import Any

from ray import serve
from ray.serve.schema import ServeDeploySchema

from rayinfer.deployments.app import model_application, server_application
from rayinfer.deployments.names import SERVER_APP, SERVER_ROUTE_PREFIX, model_app_name, model_route_prefix
from rayinfer.deployments.server import failure_reason, status_name

logger = logging.getLogger(__name__)


def validate_serve_config(doc: dict[str, Any]) -> None:
    """Raise if ``doc`` is not a valid Serve config (Ray's own schema)."""
    ServeDeploySchema.model_validate(doc)


def start_serve(http_host: str, http_port: int) -> None:
    """Start Serve's controller and HAProxy ingress on this cluster."""
    serve.start(proxy_location="EveryNode", http_options={"host": http_host, "port": http_port})


def deploy_repository(
    model_repository: str,
    versions: list[tuple[str, int, bool]],
    *,
    server_id: str,
    strict_readiness: bool,
    auto_complete: bool,
    replica_num_cpus: float,
    timeout_s: float,
    metrics: tuple[str, int] | None = None,
) -> dict[str, str]:
    """Deploy the ``/v2`` app and one app per model version; returns models that failed to load.

    A model that fails to load is removed (so its requests reach the ``/v2`` app, which reports
    the reason) and never stops the others.
    """
    serve.run(
        server_application(model_repository, server_id=server_id, strict_readiness=strict_readiness, metrics=metrics),
        name=SERVER_APP,
        route_prefix=SERVER_ROUTE_PREFIX,
    )
    targets = {}
    for model, version, is_default in versions:
        name = model_app_name(model, version, is_default)
        targets[name] = (model, serve.RunTarget(
            model_application(
                model_repository, model, version, is_default,
                replica_num_cpus=replica_num_cpus, auto_complete=auto_complete,
            ),
            name=name,
            route_prefix=model_route_prefix(model, version, is_default),
        ))
    if targets:
        serve.run_many([t for _, t in targets.values()], wait_for_applications_running=False)
    load_errors = _wait_for_apps({name: model for name, (model, _) in targets.items()}, timeout_s)
    for name in load_errors:
        serve.delete(name, _blocking=False)
    by_model = {targets[name][0]: reason for name, reason in load_errors.items()}
    if by_model:
        serve.run(
            server_application(
                model_repository, server_id=server_id, strict_readiness=strict_readiness,
                load_errors=by_model, metrics=metrics,
            ),
            name=SERVER_APP,
            route_prefix=SERVER_ROUTE_PREFIX,
        )
    return by_model


def _wait_for_apps(apps: dict[str, str], timeout_s: float) -> dict[str, str]:
    """Poll Serve until every app runs or failed; returns {app: reason} for the failures."""
    deadline = time.monotonic() + timeout_s
    pending = set(apps)
    failures: dict[str, str] = {}
    while pending and time.monotonic() < deadline:
        status = serve.status().applications
        for name in list(pending):
            app = status.get(name)
            if app is None:
                continue
            if status_name(app.status) == "RUNNING":
                pending.discard(name)
                logger.info("model '%s' is ready (application '%s')", apps[name], name)
            elif status_name(app.status) in ("DEPLOY_FAILED", "UNHEALTHY"):
                pending.discard(name)
                failures[name] = failure_reason(app)
                logger.error("model '%s' failed to load: %s", apps[name], failures[name])
        time.sleep(0.2)
    for name in pending:
        failures[name] = f"not ready after {timeout_s:.0f} s"
    return failures


def stop(versions: list[tuple[str, int, bool]], *, whole_serve: bool) -> None:
    """Shut Serve down (a cluster we started) or delete only rayinfer's applications (one we joined)."""
    if whole_serve:
        serve.shutdown()
        return
    for model, version, is_default in versions:
        serve.delete(model_app_name(model, version, is_default), _blocking=False)
    serve.delete(SERVER_APP)
