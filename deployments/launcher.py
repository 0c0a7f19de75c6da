"""Deploys a scanned repository onto a running Ray cluster and waits for the models to load."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from ray import serve
from ray.serve.schema import ServeDeploySchema

from rayinfer.deployments.app import openai_application, server_application
from rayinfer.deployments.control import deploy_models
from rayinfer.deployments.replica_options import DEFAULT_GPU_WAIT_S, DEFAULT_RESOURCE_WAIT_S, ModelControl
from rayinfer.transport.front_supervisor import stop_fronts
from rayinfer.deployments.grpc_service import SERVICER_FUNCTION
from rayinfer.deployments.names import (
    OPENAI_APP,
    OPENAI_ROUTE_PREFIX,
    POOL_APP,
    SERVER_APP,
    SERVER_DEPLOYMENT,
    SERVER_ROUTE_PREFIX,
    model_apps,
)
from rayinfer.deployments.serve_internals import delete_application, shutdown_cached_handles
from rayinfer.deployments.serve_state import serve_applications
from rayinfer.protocol.limits import DEFAULT_HTTP_MAX_INPUT_SIZE, DEFAULT_MAX_INFLIGHT_REQUESTS
from rayinfer.protocol.metrics import MetricsOptions
from rayinfer.serving.openai_service import OpenAIOptions

logger = logging.getLogger(__name__)

# How long a stop waits for rayinfer's applications to be deleted (their replicas drain for up
# to their graceful_shutdown_timeout_s, 10 s) before Serve's shutdown.
_STOP_WAIT_S = 15.0


def validate_serve_config(doc: dict[str, Any]) -> None:
    """Raise if ``doc`` is not a valid Serve config (Ray's own schema)."""
    ServeDeploySchema.model_validate(doc)


def start_serve(http_host: str, http_port: int, grpc_port: int | None = None) -> None:
    """Start Serve's controller and HAProxy ingress on this cluster; with ``grpc_port``, also
    Serve's gRPC ingress there, each replica serving Triton's GRPCInferenceService."""
    grpc_options = {"port": grpc_port, "grpc_servicer_functions": [SERVICER_FUNCTION]} if grpc_port else None
    serve.start(
        proxy_location="EveryNode", http_options={"host": http_host, "port": http_port}, grpc_options=grpc_options
    )


def deploy_repository(
    model_repository: str,
    versions: list[tuple[str, int, bool]],
    *,
    server_id: str,
    strict_readiness: bool,
    auto_complete: bool,
    replica_num_cpus: float,
    timeout_s: float,
    metrics: MetricsOptions | None = None,
    control_mode: str = "none",
    poll_secs: float = 15.0,
    grpc_front: tuple[str, int, str, int] | None = None,
    http_front: tuple[str, int, str, int] | None = None,
    front_threads: int | None = None,
    max_inflight: int | None = None,
    openai: OpenAIOptions | None = None,
    direct_connections: bool = True,
    log_level: str = "WARNING",
    load_errors: dict[str, str] | None = None,
    gpu_fallback: bool = False,
    gpu_wait_s: float = DEFAULT_GPU_WAIT_S,
    resource_wait_s: float = DEFAULT_RESOURCE_WAIT_S,
    gpu_fraction: float = 1.0,
    replica_ray_metrics: bool = False,
    cache_size_bytes: int = 0,
    trace_config: tuple[str, ...] = (),
    log_settings: dict[str, Any] | None = None,
    max_input_size: int = DEFAULT_HTTP_MAX_INPUT_SIZE,
    connection_limits: dict[str, float] | None = None,
    tls: dict[str, dict[str, Any]] | None = None,
    http_restricted: list[str] | None = None,
    grpc_restricted: list[str] | None = None,
    front_on_head: bool = False,
    front_on_every_node: bool = False,
    model_hosting: str = "dedicated",
    pool_replicas: int = 1,
    pool_max_models: int = 0,
    pool_load_timeout_s: float = 60.0,
    pool_scale_up_rpm: float = 0.0,
) -> dict[str, str]:
    """Deploy the ``/v2`` app, one app per model version and, given ``openai``, the ``/v1`` app
    (the OpenAI-compatible API); returns models that failed to load.

    A model that fails to load is removed (so its requests reach the ``/v2`` app, which reports
    the reason) and never stops the others. ``load_errors``: models asked for that could not be
    read (they count against readiness, and are returned with the failures).
    """
    control = ModelControl(
        mode=control_mode, replica_num_cpus=replica_num_cpus, auto_complete=auto_complete, timeout_s=timeout_s,
        poll_secs=poll_secs, log_level=log_level, gpu_fallback=gpu_fallback, gpu_wait_s=gpu_wait_s,
        resource_wait_s=resource_wait_s,
        cache_size_bytes=cache_size_bytes, trace_config=trace_config, max_input_size=max_input_size,
        log_settings=tuple((log_settings or {}).items()), http_restricted=tuple(http_restricted or ()),
        grpc_restricted=tuple(grpc_restricted or ()), gpu_fraction=gpu_fraction,
        replica_ray_metrics=replica_ray_metrics, connection_limits=tuple((connection_limits or {}).items()),
        hosting=model_hosting, pool_replicas=pool_replicas, pool_max_models=pool_max_models,
        pool_load_timeout_s=pool_load_timeout_s, pool_scale_up_rpm=pool_scale_up_rpm,
    )
    launch = f"rayinfer-{uuid.uuid4().hex}"
    unreadable = dict(load_errors or {})
    serve.run(
        server_application(
            model_repository, server_id=server_id, strict_readiness=strict_readiness,
            load_errors=unreadable, metrics=metrics, control=control, grpc_front=grpc_front,
            http_front=http_front, front_threads=front_threads, max_inflight=max_inflight, launch=launch,
            direct_connections=direct_connections, tls=tls,
            startup_models=sorted({model for model, _, _ in versions}),
            http_restricted=http_restricted, grpc_restricted=grpc_restricted, front_on_head=front_on_head,
            front_on_every_node=front_on_every_node,
        ),
        name=SERVER_APP,
        route_prefix=SERVER_ROUTE_PREFIX,
    )
    if openai is not None:  # starts while the models load
        app = openai_application(openai, max_input_size=max_input_size, http_restricted=http_restricted,
                                 max_ongoing_requests=max_inflight or DEFAULT_MAX_INFLIGHT_REQUESTS,
                                 version=launch)
        serve.run_many([serve.RunTarget(app, name=OPENAI_APP, route_prefix=OPENAI_ROUTE_PREFIX)],
                       wait_for_applications_running=False)
    by_model = {**unreadable, **deploy_models(model_repository, versions, control)}
    served = sorted({model for model, _, _ in versions if model not in by_model})
    if openai is not None:
        _wait_running(OPENAI_APP, 60.0)
    # Every startup model is deployed or failed now: the /v2 replica (and one Serve starts again
    # later) has none to wait for, even one unloaded since. It answers once the front routes what
    # was deployed, before the server says it started.
    try:
        asyncio.run(_startup_ended(by_model, served, 30.0))
    except Exception as exc:  # the /v2 app answers for models the front does not route yet
        logger.warning("the /v2 replica did not confirm the end of the start: %s", exc)
    return by_model


def _wait_running(app: str, timeout_s: float) -> None:
    """Wait (up to ``timeout_s``) for ``app`` to run; a warning if it does not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get(app)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            break
        time.sleep(0.2)
    logger.warning("the '%s' application is not running: %s", app, serve.status().applications.get(app))


async def _startup_ended(load_errors: dict[str, str], models: list[str], timeout_s: float) -> None:
    """Tell the ``/v2`` replica that the start ended with ``load_errors``, and wait (up to
    ``timeout_s``) for the front to route ``models``. In a loop of its own: with Serve's
    throughput-optimized settings a handle routes on the running event loop, and a blocking call
    from outside one fails at once."""
    handle = serve.get_deployment_handle(SERVER_DEPLOYMENT, SERVER_APP)
    try:
        await asyncio.wait_for(handle.startup_ended.remote(load_errors, models), timeout_s)
    finally:
        # The handle's router runs on this loop, which closes after this call: shut it down (and
        # out of Serve's handle cache) here. Else serve.shutdown() at Ctrl-C fails on the closed
        # loop ("Event loop is closed") and rayinfer exits with a traceback and status 1.
        await shutdown_cached_handles()


def stop(models: list[str], *, whole_serve: bool, fronts: list[tuple[str, int]] | None = None) -> None:
    """Shut Serve down (a cluster we started) or delete only rayinfer's applications (one we
    joined): those of the repository's ``models``, whichever versions are loaded now. Then stop
    the front on ``fronts`` (address, port) if it runs on this machine: the ``/v2`` replica may
    have been stopped without stopping it (its supervisor would otherwise stop it a minute later)."""
    try:
        if whole_serve:
            # Serve's own shutdown stops deployments in tiers, callers first, about 1.5 s a
            # tier. The models, the pool and /v1 stop at once (their replicas drain as they
            # stop, withdrawing their listeners from the /v2 replica), then Serve with /v2.
            for name in serve_applications():
                if name != SERVER_APP:
                    delete_application(name, wait=False)
            deadline = time.monotonic() + _STOP_WAIT_S
            while set(serve_applications()) - {SERVER_APP} and time.monotonic() < deadline:
                # Serve signals no deletion's end (its own blocking delete polls the status too,
                # once a second); its controller's loop runs every 0.1 s.
                time.sleep(0.1)
            serve.shutdown()
            return
        apps = serve_applications()
        running = [name for name, app in apps.items() if not app.pooled]
        for model in models:
            for name in model_apps(model, running):
                delete_application(name, wait=False)
        if POOL_APP in running:
            delete_application(POOL_APP, wait=False)
        if OPENAI_APP in running:
            delete_application(OPENAI_APP, wait=False)
        serve.delete(SERVER_APP)
    finally:
        stop_fronts(fronts or [])
