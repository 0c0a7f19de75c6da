"""Serve's side of model control: deploying, trying and removing model-version applications.

Used by ``rayinfer serve`` at start and, through :class:`ServeDeployer`, by the ``/v2`` replica's
:class:`~rayinfer.serving.model_control.ModelController` for the repository API's load and
unload (explicit mode) and for repository polling (poll mode).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import ray
from ray import serve

from ray.serve import Application
from ray.serve.schema import LoggingConfig

from rayinfer.deployments.model import ModelDeployment
from rayinfer.deployments.names import (
    DEFAULT_REPLICA_NUM_CPUS,
    model_app_name,
    model_apps,
    model_deployment_name,
    model_route_prefix,
)
from rayinfer.deployments.serve_internals import delete_application
from rayinfer.deployments.pool import HostedSpec
from rayinfer.deployments.pool_control import deploy_pool, hosted_spec, hosting_options, version_hosting
from rayinfer.deployments.replica_options import (
    DEFAULT_GPU_WAIT_S,
    DEFAULT_RESOURCE_WAIT_S,
    MIN_ONGOING_REQUESTS,
    ModelControl,
    replica_count,
    replica_resources,
    with_callers_runtime_env,
)
from rayinfer.deployments.serve_state import (
    cluster_gpus,
    failure_reason,
    pooled_specs,
    resource_shortage,
    serve_applications,
    status_name,
)
from rayinfer.protocol.errors import ModelConfigError
from rayinfer.protocol.limits import DEFAULT_HTTP_MAX_INPUT_SIZE
from rayinfer.repository.hosting import POOL
from rayinfer.repository.ensemble import dependency_waves, member_names
from rayinfer.repository.object_store import local_repository
from rayinfer.repository.scanner import scan_model

logger = logging.getLogger(__name__)

def model_application(
    model_repository: str,
    model: str,
    version: int,
    is_default: bool,
    *,
    replica_num_cpus: float = DEFAULT_REPLICA_NUM_CPUS,
    auto_complete: bool = True,
    config_override: str | None = None,
    log_level: str = "WARNING",
    gpu_fallback: bool = False,
    gpu_fraction: float = 1.0,
    ray_metrics: bool = False,
    cache_size_bytes: int = 0,
    max_input_size: int = DEFAULT_HTTP_MAX_INPUT_SIZE,
    folder: Path | None = None,
    log_settings: dict[str, Any] | None = None,
    http_restricted: list[str] | None = None,
    grpc_restricted: list[str] | None = None,
) -> Application:
    """The application serving one version of one model; replicas and their resources from its
    ``instance_group`` (:mod:`rayinfer.repository.instance_groups`).

    ``folder``: where the repository's files are on this machine (default: ``model_repository``,
    an s3:// one's copy brought up to date first); the replicas are given ``model_repository``.

    ``config_override``: a load request's config (Triton's JSON form) used instead of config.pbtxt;
    ``log_level``: the replicas' log level (``--log-verbose`` makes it DEBUG); ``gpu_fallback``:
    GPU groups run as CPU replicas; ``gpu_fraction``: the share of a GPU the version's GPU
    instances reserve together; ``ray_metrics``: the replicas report Ray's own metrics;
    ``cache_size_bytes``: the response cache's size on a node;
    ``max_input_size``: the largest HTTP body a replica reads (--http-max-input-size);
    ``log_settings``: the logging extension's settings at start (--log-* flags), which the
    replicas follow from their first line until they register with the /v2 replica, whose
    current settings they follow from then on. ``http_restricted``, ``grpc_restricted``: the
    values of --http-restricted-api and --grpc-restricted-protocol, which the replicas' listeners
    check as the front does.
    """
    entry = scan_model((folder or local_repository(model_repository, [model])) / model, config_override)
    if entry.config is None:
        raise ModelConfigError(entry.error or f"model '{model}' cannot be read")
    config = entry.config
    replicas, actor_options = replica_resources(entry, version, replica_num_cpus,
                                                cluster_has_gpus=cluster_gpus() > 0, gpu_fallback=gpu_fallback,
                                                gpu_fraction=gpu_fraction, ray_metrics=ray_metrics)
    if "runtime_env" in actor_options and ray.is_initialized():
        # The load API, poll mode and the launcher deploy from a process (the /v2 replica, the
        # CLI) whose runtime_env (a `serve deploy` application's, a job's) the replicas keep.
        actor_options["runtime_env"] = with_callers_runtime_env(actor_options["runtime_env"],
                                                                ray.get_runtime_context().runtime_env)
    deployment = ModelDeployment.options(
        name=model_deployment_name(model, version),
        **replica_count(entry, replicas),
        max_ongoing_requests=max(MIN_ONGOING_REQUESTS, 2 * int(config.max_batch_size)),
        ray_actor_options=actor_options,
        health_check_period_s=5.0,
        graceful_shutdown_timeout_s=10.0,
        # Serve's drain waits one loop period before it first counts the replica's requests
        # (2 s by default); requests from the front are withdrawn before an unload anyway.
        graceful_shutdown_wait_loop_s=0.2,
        # A replica that fails to load fails the model at once, as in Triton (Serve would start
        # it again up to three times per replica: a broken model file took about 20 s to report).
        max_constructor_retry_count=1,
        # A per-request access log line costs more than the request's own decoding.
        logging_config=LoggingConfig(enable_access_log=False, log_level=log_level),
    )
    # A version the policy does not select is served only while a rollout keeps it.
    any_version = int(version) not in entry.versions
    return deployment.bind(str(model_repository), model, int(version), auto_complete, config_override,
                           cache_size_bytes, max_input_size, log_settings or None,
                           {"http": list(http_restricted or ()), "grpc": list(grpc_restricted or ())}, any_version)


def deploy_models(
    model_repository: str,
    versions: list[tuple[str, int, bool]],
    control: ModelControl,
    config_overrides: dict[str, str] | None = None,
) -> dict[str, str]:
    """Deploy (or update) one application per model version and wait for them; returns
    {model: reason} for models that failed, whose applications are removed again.

    Ensembles are deployed after their members (an ensemble checks its steps against its
    members' configs as it loads); one whose member failed is not deployed."""
    overrides = config_overrides or {}
    models = list(dict.fromkeys(v[0] for v in versions))
    folder = local_repository(model_repository, models)  # an s3:// repository: these models' copies
    members = {}
    for model in models:
        config = scan_model(folder / model, overrides.get(model)).config
        members[model] = member_names(config) if config is not None else []
    waves, cycle = dependency_waves(members)
    failures = {m: f"ensemble '{m}' depends on itself through its steps' models ({', '.join(cycle)})" for m in cycle}
    for wave in waves:
        for model in wave:
            failed = [n for n in members[model] if n in failures]
            if failed:
                failures[model] = (f"ensemble '{model}' depends on '{failed[0]}', which failed to load: "
                                   f"{failures[failed[0]]}")
        wanted = [v for v in versions if v[0] in wave and v[0] not in failures]
        failures.update(_deploy_wave(model_repository, folder, wanted, control, overrides))
    return failures


def _deploy_wave(model_repository: str, folder: Path, versions: list[tuple[str, int, bool]], control: ModelControl,
                 config_overrides: dict[str, str]) -> dict[str, str]:
    """Deploy model versions that do not depend on each other, at once; {model: reason} of failures."""
    targets = {}
    refused: dict[str, str] = {}
    pooled: dict[str, tuple[str, HostedSpec]] = {}  # application -> (model, spec)
    for model, version, is_default in versions:
        name = model_app_name(model, version, is_default)
        try:
            if version_hosting(folder, model, version, config_overrides.get(model), control) == POOL:
                pooled[name] = (model, hosted_spec(model_repository, model, version, hosting_options(
                    folder, model, version, config_overrides.get(model), control)))
                continue
            app = model_application(
                model_repository, model, version, is_default,
                replica_num_cpus=control.replica_num_cpus, auto_complete=control.auto_complete,
                config_override=config_overrides.get(model), log_level=control.log_level,
                gpu_fallback=control.gpu_fallback, gpu_fraction=control.gpu_fraction,
                ray_metrics=control.replica_ray_metrics, cache_size_bytes=control.cache_size_bytes,
                max_input_size=control.max_input_size, folder=folder, log_settings=dict(control.log_settings),
                http_restricted=list(control.http_restricted), grpc_restricted=list(control.grpc_restricted),
            )
        except ModelConfigError as exc:  # e.g. instance groups Serve cannot express: this model only
            logger.error("model '%s' failed to load: %s", model, exc)
            refused[model] = str(exc)
            continue
        targets[name] = (model, serve.RunTarget(app, name=name, route_prefix=model_route_prefix(model, version, is_default)))
    if targets:
        # A version moving from the pool to replicas of its own leaves the pool first.
        leaving = set(targets) & set(pooled_specs())
        if leaving:
            deploy_pool(control, drop=leaving)
        serve.run_many([t for _, t in targets.values()], wait_for_applications_running=False)
    if pooled:
        for name in set(pooled) & set(serve_applications()):  # moving into the pool: its own replicas go
            if not serve_applications()[name].pooled:
                delete_application(name, wait=True)
        refused.update(deploy_pool(control, add=dict(pooled)))
    load_errors = _wait_for_apps({name: model for name, (model, _) in targets.items()}, control.timeout_s,
                                 gpu_wait_s=control.gpu_wait_s, resource_wait_s=control.resource_wait_s)
    # Gone before the failure is answered: while a failed application exists, Serve's HTTP
    # ingress sends requests under its route prefix to it (those that reach Serve's port
    # directly: the front sends a model's GETs without a replica to the /v2 application).
    for name in load_errors:  # all removals at once, then wait for each
        delete_application(name, wait=False)
    for name in load_errors:
        delete_application(name, wait=True)
    return {**refused, **{targets[name][0]: reason for name, reason in load_errors.items()}}


def trial_load(model_repository: str, versions: list[tuple[str, int, bool]], control: ModelControl,
               config_override: str | None = None) -> None:
    """Load each version once in a throwaway Ray task and drop it; raises the load's error.

    A reload of a serving model is tried this way first, so that a broken new model file leaves
    the serving version untouched instead of replacing it with a failed application.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rayinfer.adapters.loader import load_runner

    def load(repository: str, model: str, version: int) -> None:
        runner, _ = load_runner(local_repository(repository, [model]), model, version, control.auto_complete,
                                config_override, any_version=True)
        runner.adapter.unload()

    # On this node: a load request's files are in a temporary directory here.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    task = ray.remote(load).options(num_cpus=0, max_retries=0, scheduling_strategy=here)
    refs = [task.remote(model_repository, model, version) for model, version, _ in versions]
    try:
        ray.get(refs, timeout=control.timeout_s)
    except ray.exceptions.GetTimeoutError:
        for ref in refs:
            ray.cancel(ref, force=True)
        raise TimeoutError(f"loading the new model took longer than {control.timeout_s:.0f} s") from None


def _wait_for_apps(apps: dict[str, str], timeout_s: float, gpu_wait_s: float = DEFAULT_GPU_WAIT_S,
                   resource_wait_s: float = DEFAULT_RESOURCE_WAIT_S) -> dict[str, str]:
    """Poll Serve until every app runs or failed; returns {app: reason} for the failures. An app
    whose replicas wait for GPUs the cluster does not have fails after ``gpu_wait_s``; one whose
    replicas wait for other resources (CPU, memory) it does not have free, after ``resource_wait_s``.
    Either is logged as soon as it is seen."""
    start = time.monotonic()
    deadline = start + timeout_s
    pending = set(apps)
    failures: dict[str, str] = {}
    short_since: dict[str, float] = {}  # app -> when its replicas were first seen waiting for resources
    while pending and time.monotonic() < deadline:
        now = time.monotonic()
        status = serve_applications()
        for name in list(pending):
            app = status.get(name) if now - start > min(5.0, gpu_wait_s, resource_wait_s) else None
            shortage = resource_shortage(app, status) if app is not None else None
            if shortage is None:
                # The wait ends when every replica is placed, not when one look finds none waiting
                # (a replica starting elsewhere makes Ray's pending demand ambiguous for a moment).
                if app is not None and not any(d.unplaced for d in app.deployments.values()):
                    short_since.pop(name, None)
                continue
            wait_s = gpu_wait_s if shortage.gpu else resource_wait_s
            if name not in short_since:
                short_since[name] = now
                logger.warning("model '%s' waits for %s resources (up to %.0f s): %s", apps[name],
                               shortage.resources, wait_s, shortage.text)
            elif now - short_since[name] >= wait_s:
                pending.discard(name)
                failures[name] = f"waited {wait_s:.0f} s for {shortage.resources} resources: {shortage.text}"
                logger.error("model '%s' failed to load: %s", apps[name], failures[name])
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


class ServeDeployer:
    """The :class:`~rayinfer.serving.model_control.Deployer` of a Serve cluster."""

    def __init__(self, control: ModelControl) -> None:
        self._control = control

    def serving(self, model: str) -> bool:
        return bool(model_apps(model, serve_applications()))

    def trial_load(self, root: str, versions: list[tuple[str, int, bool]], override: str | None) -> None:
        trial_load(root, versions, self._control, override)

    def deploy(self, root: str, model: str, versions: list[tuple[str, int, bool]], override: str | None) -> str | None:
        failures = deploy_models(root, versions, self._control, {model: override} if override else None)
        wanted = {model_app_name(*v) for v in versions}
        self._remove_apps([name for name in model_apps(model, serve_applications()) if name not in wanted])
        return failures.get(model)

    def remove_version(self, model: str, version: int) -> None:
        self._remove_apps([model_app_name(model, version, False)])

    def _remove_apps(self, names: list[str]) -> None:
        """Remove these applications: their own (at once), or their versions from the pool."""
        pooled = set(names) & set(pooled_specs())
        if pooled:
            deploy_pool(self._control, drop=pooled)
        for name in set(names) - pooled:
            delete_application(name, wait=False)

    def remove(self, model: str) -> None:
        names = model_apps(model, serve_applications())
        self._remove_apps(names)
        deadline = time.monotonic() + 60
        while names and time.monotonic() < deadline:
            apps = serve_applications()
            names = [name for name in names if name in apps]
            # Serve tells of a removed application only through its status: poll it (the loop
            # ends when they are gone, or at the deadline).
            time.sleep(0.1)
