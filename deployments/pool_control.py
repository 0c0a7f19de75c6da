"""The model pool's side of model control: which versions are pooled, and deploying the pool
with a new list of versions (:mod:`pool`) and waiting for its replicas' reports
(:mod:`cluster_records`)."""

from __future__ import annotations

import logging
import threading
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.schema import LoggingConfig

from rayinfer.adapters.base import backend_uses_gpus
from rayinfer.deployments.front import route_key_is_safe
from rayinfer.deployments.hosted_model import HostingOptions
from rayinfer.deployments.names import POOL_APP
from rayinfer.deployments.pool import HostedSpec, PoolDeployment
from rayinfer.deployments.cluster_records import read_reports, spec_digest
from rayinfer.deployments.replica_options import (
    MIN_ONGOING_REQUESTS,
    RAY_METRICS_OFF,
    ModelControl,
    with_callers_runtime_env,
)
from rayinfer.deployments.serve_internals import with_code_version
from rayinfer.deployments.serve_state import (
    cluster_gpus,
    failure_reason,
    pooled_specs,
    running_replicas,
    serve_applications,
    status_name,
)
from rayinfer.protocol.errors import ModelConfigError
from rayinfer.repository.hosting import DEDICATED, HOSTING_PARAMETER, POOL, model_hosting
from rayinfer.repository.instance_groups import replica_plan
from rayinfer.repository.scanner import scan_model

logger = logging.getLogger(__name__)

# Changes to the pool's list of versions, one at a time in this process, and the list this
# process deployed last: Serve's details show a new user_config only once its controller has
# applied it, so two loads at once would otherwise each start from the list before both, and
# the second would drop the first's version.
_CHANGING = threading.Lock()
_deployed: dict[str, HostedSpec] | None = None


def version_hosting(folder: Path, model: str, version: int, override: str | None, control: ModelControl) -> str:
    """``dedicated`` or ``pool`` for one version (:func:`~rayinfer.repository.hosting.model_hosting`);
    raises :class:`ModelConfigError` for a config that cannot be read or a wrong ``rayinfer_hosting``."""
    entry = scan_model(folder / model, override)
    if entry.config is None:
        raise ModelConfigError(entry.error or f"model '{model}' cannot be read")
    auto_gpu = cluster_gpus() > 0 and backend_uses_gpus(entry.config.backend)
    plan = replica_plan(entry.config, entry.path / "config.pbtxt", auto_gpu=auto_gpu,
                        gpu_fallback=control.gpu_fallback, gpu_fraction=control.gpu_fraction)
    hosting = model_hosting(entry.config, entry.path / "config.pbtxt", plan, control.hosting, version)
    if hosting == POOL and not route_key_is_safe(f"{model}/{version}"):
        # The front cannot route such a name to a listener, and a pooled version has no route of
        # its own at Serve's HTTP ingress to fall back on.
        if HOSTING_PARAMETER in entry.config.parameters:
            raise ModelConfigError(f"{entry.path / 'config.pbtxt'}: model '{model}' cannot be pooled: its name has "
                                   "whitespace, ';', '#' or '\\'")
        return DEDICATED
    return hosting


def hosting_options(folder: Path, model: str, version: int, override: str | None,
                    control: ModelControl) -> HostingOptions:
    """How a pool replica loads one version: the options a dedicated replica is given."""
    entry = scan_model(folder / model, override)
    return HostingOptions(
        auto_complete=control.auto_complete, config_override=override, cache_size_bytes=control.cache_size_bytes,
        max_input_size=control.max_input_size,
        restricted=(("http", tuple(control.http_restricted)), ("grpc", tuple(control.grpc_restricted))),
        any_version=int(version) not in entry.versions,
    )


def pool_version(control: ModelControl) -> str:
    """The pool's code version: the same for every deploy with these options, so that a new list
    of models reconfigures the pool's replicas in place."""
    options = (control.pool_replicas, control.replica_num_cpus, control.log_level,
               control.log_settings, control.replica_ray_metrics)
    return f"pool-{zlib.crc32(repr(options).encode()):08x}"


def deploy_pool(control: ModelControl, *, add: dict[str, tuple[str, HostedSpec]] | None = None,
                drop: set[str] | None = None) -> dict[str, str]:
    """Deploy the pool with its versions less ``drop`` plus ``add`` ({application: (model, spec)})
    and wait until its replicas hold them; returns {model: reason} for those of ``add`` that
    failed, which are left out of the pool again."""
    add = add or {}
    _change_pool(control, add={name: spec for name, (_, spec) in add.items()}, drop=drop or set())
    if drop:
        _wait_dropped(drop, control)
    if not add:
        return {}
    failed = _wait_for_pool({name: spec for name, (_, spec) in add.items()}, control)
    for name, reason in failed.items():
        logger.error("model '%s' failed to load: %s", add[name][0], reason)
    if failed:
        _change_pool(control, drop=set(failed))
    for name in set(add) - set(failed):
        logger.info("model '%s' is ready (in the pool, as '%s')", add[name][0], name)
    return {add[name][0]: reason for name, reason in failed.items()}


def _change_pool(control: ModelControl, *, add: dict[str, HostedSpec] | None = None,
                 drop: set[str] | None = None) -> None:
    """Deploy the pool with the versions it has (as this process last deployed them, else as
    Serve has them) less ``drop`` plus ``add``."""
    global _deployed
    with _CHANGING:
        specs = {name: spec for name, spec in (pooled_specs() if _deployed is None else _deployed).items()
                 if name not in (drop or set())}
        specs.update(add or {})
        _run_pool(control, specs)
        _deployed = specs


def _run_pool(control: ModelControl, specs: dict[str, HostedSpec]) -> None:
    options: dict[str, Any] = {}
    if not control.replica_ray_metrics:
        options["runtime_env"] = {"env_vars": dict(RAY_METRICS_OFF)}
        if ray.is_initialized():
            options["runtime_env"] = with_callers_runtime_env(options["runtime_env"],
                                                              ray.get_runtime_context().runtime_env)
    app = pool_application(
        specs, replicas=control.pool_replicas, max_models=control.pool_max_models,
        load_timeout_s=control.pool_load_timeout_s, scale_up_rpm=control.pool_scale_up_rpm, num_cpus=control.replica_num_cpus,
        actor_options=options, log_level=control.log_level, log_settings_at_start=dict(control.log_settings),
        max_ongoing_requests=4 * MIN_ONGOING_REQUESTS, version=pool_version(control),
    )
    serve.run_many([serve.RunTarget(app, name=POOL_APP, route_prefix=None)], wait_for_applications_running=False)


def _wait_for_pool(names: dict[str, HostedSpec], control: ModelControl) -> dict[str, str]:
    """Wait until every running pool replica reports each of ``names`` ({application: spec})
    loaded or failed with that spec; {name: reason} of the failures (all of them, with the
    pool's reason, if the pool itself failed)."""
    wanted = {name: spec_digest(spec) for name, spec in names.items()}
    deadline = time.monotonic() + control.timeout_s
    while time.monotonic() < deadline:
        pool = serve_applications().get(POOL_APP)
        if pool is not None and status_name(pool.status) in ("DEPLOY_FAILED", "UNHEALTHY"):
            return {name: f"the model pool failed: {failure_reason(pool)}" for name in names}
        replicas = [key.split("/", 1)[1] for key in running_replicas() if key.startswith(f"{POOL_APP}/")]
        reports = read_reports(replicas) if replicas else {}
        if replicas and len(reports) == len(replicas):
            failed: dict[str, str] = {}
            done = True
            for report in reports.values():
                for name, digest in wanted.items():
                    if digest in (report["loaded"].get(name), report.get("evicted", {}).get(name)):
                        continue
                    if (report["failed"].get(name) or [None])[0] == digest:
                        failed[name] = report["failed"][name][1]
                        continue
                    done = False
            if done:
                return failed
        time.sleep(0.2)  # the reports change only when a pool replica finishes a load: poll them
    return {name: f"not loaded in the pool after {control.timeout_s:.0f} s" for name in names}


def _wait_dropped(names: set[str], control: ModelControl) -> None:
    """Wait until no serving pool replica reports any of ``names`` loaded (they were drained and
    closed), for at most a minute."""
    deadline = time.monotonic() + min(60.0, control.timeout_s)
    while time.monotonic() < deadline:
        replicas = [key.split("/", 1)[1] for key in running_replicas() if key.startswith(f"{POOL_APP}/")]
        if not any(names & set(report["loaded"]) for report in read_reports(replicas).values()):
            return
        time.sleep(0.2)  # Ray's store tells of no change: poll it, until the deadline
    logger.warning("the model pool still hosts %s a minute after they were dropped", ", ".join(sorted(names)))


def hosted_spec(model_repository: str, model: str, version: int, options: HostingOptions) -> HostedSpec:
    """One hosted version (of ``model_repository``: the server's, or a load request's files) as
    the pool's ``user_config`` carries it. ``load`` is new for every load, so that loading a
    version again (its files changed) reloads it, and its report is told from an earlier one's."""
    return (model, int(version), {
        "repository": str(model_repository), "load": uuid.uuid4().hex,
        "auto_complete": options.auto_complete, "config_override": options.config_override,
        "cache_size_bytes": options.cache_size_bytes, "max_input_size": options.max_input_size,
        "restricted": {kind: list(values) for kind, values in options.restricted},
        "any_version": options.any_version,
    })


def pool_application(models: dict[str, HostedSpec], *, replicas: int, max_models: int, load_timeout_s: float,
                     num_cpus: float, scale_up_rpm: float = 0.0,
                     actor_options: dict[str, Any], log_level: str, log_settings_at_start: dict[str, Any] | None,
                     max_ongoing_requests: int, version: str) -> Any:
    """The pool's application, hosting ``models`` ({application: spec}) on ``replicas`` replicas,
    each holding at most ``max_models`` loaded (0: all; a request for another waits up to
    ``load_timeout_s`` for it to load; past ``scale_up_rpm`` requests per minute a version gets
    another copy, :mod:`pool_spread`).
    ``version``: the pool's code version, the same for every deploy of one server, so that a new
    list of models reconfigures the running replicas instead of replacing them."""
    deployment = PoolDeployment.options(
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={**actor_options, "num_cpus": num_cpus},
        user_config={"models": {app: list(spec) for app, spec in sorted(models.items())},
                     "max_models": max_models, "load_timeout_s": load_timeout_s,
                     "scale_up_rpm": scale_up_rpm, "replicas": replicas},
        health_check_period_s=5.0,
        graceful_shutdown_timeout_s=10.0,
        graceful_shutdown_wait_loop_s=0.2,
        max_constructor_retry_count=1,
        logging_config=LoggingConfig(enable_access_log=False, log_level=log_level),
    )
    return with_code_version(deployment, version).bind(log_settings_at_start or None)
