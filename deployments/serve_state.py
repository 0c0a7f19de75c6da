"""Reading Serve's state: which model versions are served, loading or failed, and where.

:class:`ServeState` joins the repository on disk with Serve's application status into Triton's
repository index rows, and derives the versions the front may route and how many of their
replicas Serve reports RUNNING. It is right whether the models were deployed by ``rayinfer
serve`` or by ``serve deploy``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayinfer.deployments.names import (
    POOL_APP,
    POOL_DEPLOYMENT,
    deployment_version,
    model_app_name,
    model_apps,
    model_deployment_name,
)
from rayinfer.deployments.cluster_records import read_reports, spec_digest
from rayinfer.deployments.serve_internals import pending_resource_shapes, serve_details
from rayinfer.repository.scanner import RepositoryScan
from rayinfer.serving.model_control import ModelController
from rayinfer.transport.router import VersionSplit, choose_version

logger = logging.getLogger(__name__)

_CACHE_S = 0.5
_SERVE_STATE = {
    "RUNNING": "READY",
    "NOT_STARTED": "LOADING",
    "DEPLOYING": "LOADING",
    "DELETING": "UNLOADING",
}


def status_name(status: Any) -> str:
    """``RUNNING`` for Serve's ApplicationStatus enum members (and plain strings)."""
    return str(getattr(status, "value", status))


def failure_reason(app: Any) -> str:
    """Why a Serve application failed: its deployments' messages carry the replica's exception."""
    messages = [d.message for d in (getattr(app, "deployments", None) or {}).values() if d.message]
    return short_reason("\n".join(messages) or app.message or status_name(app.status))


def short_reason(message: str) -> str:
    """The last meaningful line of a Serve failure message (the exception, not the traceback)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    pip_errors = [line for line in lines if line.startswith("ERROR: ")]
    if pip_errors:  # a Python model's runtime environment could not be built
        return f"pip could not install the model's requirements: {pip_errors[-1][len('ERROR: '):]}"
    for line in reversed(lines):
        if "Error" in line.split(":", 1)[0]:
            return line.split(":", 1)[1].strip() or line
    return lines[-1] if lines else "failed to load"


@dataclass(frozen=True, slots=True)
class DeploymentState:
    status: str
    message: str
    replica_states: dict[str, int]  # replica state -> how many replicas are in it
    target_replicas: int = 0
    num_gpus: float = 0.0  # per replica
    required: dict[str, float] = field(default_factory=dict)  # each replica's resources (CPU, memory, ...)
    unplaced: int = 0  # replicas Ray has not placed on a node yet


@dataclass(frozen=True, slots=True)
class ApplicationState:
    status: str
    message: str
    deployments: dict[str, DeploymentState]
    # A pooled model version (deployments/pool.py): the pool's state, under the version's names.
    pooled: bool = False


@dataclass(frozen=True, slots=True)
class Shortage:
    """Why some of an application's replicas are not placed: ``resources``, those the cluster
    does not have free (``GPU`` alone, or others: CPU, memory, a custom resource), and ``text``,
    the numbers and what to change."""

    resources: str
    text: str

    @property
    def gpu(self) -> bool:
        return self.resources == "GPU"


def cluster_gpus() -> float:
    """GPUs the Ray cluster has (logical ones included), 0 without a connected Ray."""
    import ray

    return float(ray.cluster_resources().get("GPU", 0.0)) if ray.is_initialized() else 0.0


def resource_shortage(app: ApplicationState, apps: dict[str, ApplicationState] | None = None) -> Shortage | None:
    """Why some of ``app``'s replicas are not placed, when they wait for resources the cluster
    does not have free (else None). A replica Serve has not seen placed (no node) may be waiting
    for resources or starting its worker on the node that granted them: it counts as waiting
    only while Ray's pending demand holds as many requests of its resource shape as all the
    unplaced replicas of that shape in ``apps`` (every application; default: ``app`` alone), so
    that a replica still starting is never reported."""
    figures = _cluster_figures()
    if figures is None:  # Ray's figures could not be read: nothing is known to be missing
        return None
    free, total, pending = figures
    for deployment in app.deployments.values():
        if not deployment.unplaced:
            continue
        shape = _shape(deployment.required)
        waiting = sum(count for pending_shape, count in pending if pending_shape == shape)
        unplaced = sum(d.unplaced for other in (apps or {"": app}).values() if not other.pooled
                       for d in other.deployments.values() if _shape(d.required) == shape)
        if not waiting or waiting < unplaced:
            continue
        short = [name for name, need in shape.items() if free.get(name, 0.0) + 1e-9 < need] or list(shape)
        if "GPU" in short:
            return Shortage("GPU", f"{deployment.unplaced} of its {deployment.target_replicas} replicas need "
                                   f"{deployment.num_gpus:g} GPU each; the cluster has {total.get('GPU', 0.0):g} "
                                   f"GPU(s), {free.get('GPU', 0.0):g} free")
        needs = ", ".join(_amount(name, shape[name]) for name in short)
        has = ", ".join(f"{_amount(name, total.get(name, 0.0))} ({_amount(name, free.get(name, 0.0))} free)"
                        for name in short)
        return Shortage(" and ".join(short), (
            f"{deployment.unplaced} of its {deployment.target_replicas} replicas need {needs} each; the cluster "
            f"has {has}. Unload a model, lower --replica-num-cpus or the model's instance count, or add a node"))
    return None


# Ray's free and total resources, and its pending demand (each shape and how many wait).
ClusterFigures = tuple[dict[str, float], dict[str, float], list[tuple[dict[str, float], int]]]
_figures: tuple[float, ClusterFigures | None] = (-1.0, None)  # (when read, what was read), kept for _CACHE_S


def _cluster_figures() -> ClusterFigures | None:
    """Ray's free and total resources and its pending demand (:func:`pending_resource_shapes`),
    read at most every half second; None when they cannot be read."""
    global _figures
    now = time.monotonic()
    if now - _figures[0] > _CACHE_S:
        import ray

        try:
            figures: ClusterFigures | None = (
                {k: float(v) for k, v in ray.available_resources().items()},
                {k: float(v) for k, v in ray.cluster_resources().items()},
                [(_shape(shape), count) for shape, count in pending_resource_shapes()])
        except Exception as exc:  # no connected Ray, or its GCS did not answer in time
            logger.debug("could not read the cluster's resources: %s", exc)
            figures = None
        _figures = (now, figures)
    return _figures[1]


def _shape(resources: dict[str, float]) -> dict[str, float]:
    """A resource request's shape: its non-zero amounts, rounded so that equal requests compare equal."""
    return {name: round(amount, 6) for name, amount in resources.items() if amount}


def _amount(resource: str, value: float) -> str:
    """A resource amount as a person reads it: memory in GiB, others as counts."""
    if resource in ("memory", "object_store_memory"):
        return f"{value / 2**30:.1f} GiB {resource.replace('_', ' ')}"
    return f"{value:g} {resource}"


def serve_applications() -> dict[str, ApplicationState]:
    """Serve's applications and their deployments, from the controller's details as it sends them.

    ``serve.status()`` parses the same details into Serve's pydantic models, which pickles each
    deployment's request router class again: about 60 ms of CPU per call for a handful of
    applications, against under 2 ms here (measured with the example repository).
    """
    details = serve_details()
    if details is None:  # Serve has not started
        return {}
    apps = {}
    for name, app in (details.get("applications") or {}).items():
        deployments = {}
        for dname, deployment in (app.get("deployments") or {}).items():
            states: dict[str, int] = {}
            unplaced = 0
            for replica in deployment.get("replicas") or []:
                state = status_name(replica.get("state"))
                states[state] = states.get(state, 0) + 1
                unplaced += state == "STARTING" and not replica.get("node_id")  # Ray has not placed its actor
            required = {name: float(value) for name, value in (deployment.get("required_resources") or {}).items()
                        if isinstance(value, (int, float))}  # per replica
            deployments[dname] = DeploymentState(
                status_name(deployment.get("status")), deployment.get("message") or "", states,
                int(deployment.get("target_num_replicas") or 0), required.get("GPU", 0.0), required, unplaced,
            )
        apps[name] = ApplicationState(status_name(app.get("status")), app.get("message") or "", deployments)
    pool = apps.get(POOL_APP)
    if pool is not None and POOL_DEPLOYMENT in pool.deployments:
        apps.update(_pooled_applications(details, pool))
    return apps


# The index's reason for a pooled version no pool replica holds loaded now (--pool-max-models).
NOT_RESIDENT = "not loaded now (--pool-max-models): loads on its next request"


def _pooled_applications(details: dict[str, Any], pool: ApplicationState) -> dict[str, ApplicationState]:
    """Each version the pool hosts as an application of its own: RUNNING once a serving pool
    replica reports it loaded with its current spec (or loaded once and unloaded since to keep
    within --pool-max-models: its message says so), DEPLOY_FAILED with the reason one gave,
    else the pool's own state while it loads (a pool that failed fails them all)."""
    replicas = [str(r.get("replica_id")) for r in
                (details["applications"][POOL_APP]["deployments"][POOL_DEPLOYMENT].get("replicas") or [])
                if status_name(r.get("state")) in SERVING_STATES]
    try:
        reports = list(read_reports(replicas).values()) if replicas else []
    except Exception as exc:  # noqa: BLE001  # Ray's store unreadable: as if nothing were loaded yet
        logger.debug("could not read the pool's reports: %s", exc)
        reports = []
    apps = {}
    for name, spec in pooled_specs(details).items():
        digest = spec_digest(spec)
        failed = next((r["failed"][name][1] for r in reports if (r["failed"].get(name) or [None])[0] == digest), None)
        if any(r["loaded"].get(name) == digest for r in reports):
            status, message = "RUNNING", ""
        elif any(r.get("evicted", {}).get(name) == digest for r in reports):
            status, message = "RUNNING", NOT_RESIDENT
        elif failed is not None:
            status, message = "DEPLOY_FAILED", failed
        else:
            status, message = ("DEPLOYING" if pool.status == "RUNNING" else pool.status), pool.message
        apps[name] = ApplicationState(status, message, {model_deployment_name(spec[0], int(spec[1])):
                                                        pool.deployments[POOL_DEPLOYMENT]}, pooled=True)
    return apps


def pooled_specs(details: dict[str, Any] | None = None) -> dict[str, tuple[str, int, dict[str, Any]]]:
    """The model versions the pool hosts, as its user_config lists them ({application: spec})."""
    details = serve_details() if details is None else details
    app = ((details or {}).get("applications") or {}).get(POOL_APP) or {}
    deployment = (app.get("deployments") or {}).get(POOL_DEPLOYMENT) or {}
    config = deployment.get("deployment_config") or {}
    models = (config.get("user_config") or {}).get("models") or {}
    return {name: (str(spec[0]), int(spec[1]), dict(spec[2])) for name, spec in models.items()}


def deployed_versions(model: str) -> list[int]:
    """The versions of ``model`` Serve runs now (by its deployments' names, whatever the
    repository on disk says since), highest last."""
    versions: set[int] = set()
    for name, app in serve_applications().items():
        if model_apps(model, [name]) and status_name(app.status) in ("RUNNING", "DEPLOYING"):
            versions.update(deployment_version(d) for d in app.deployments)
    return sorted(versions)


# Replica states that serve: UPDATING is a running replica being reconfigured in place (the
# model pool's, while it loads or unloads a version: its other versions serve on).
SERVING_STATES = ("RUNNING", "UPDATING")


def running_replicas() -> set[str]:
    """``<application>/<replica id>`` of every replica Serve reports RUNNING (or UPDATING)."""
    details = serve_details()
    if details is None:
        raise RuntimeError("not connected to Serve")
    return {
        f"{app_name}/{replica['replica_id']}"
        for app_name, app in details.get("applications", {}).items()
        for deployment in app.get("deployments", {}).values()
        for replica in deployment.get("replicas", [])
        if status_name(replica.get("state")) in SERVING_STATES  # a str enum or its value
    }


class ServeState:
    """The repository index as served now, read from Serve at most every half second."""

    def __init__(self, repository: Path, controller: ModelController) -> None:
        self._repository = Path(repository)
        self._scan = RepositoryScan(self._repository)
        self._controller = controller
        self._lock = asyncio.Lock()
        self._read_at = 0.0
        self.rows: list[dict[str, Any]] = []
        # Served versions: "<model>/<version>" ("" = default) -> (application, deployment).
        self.routes: dict[str, tuple[str, str]] = {}
        # Replicas Serve reports RUNNING, per routed application.
        self.running: dict[str, int] = {}
        # Models with at least one application (served, loading or failed).
        self.deployed: set[str] = set()
        # Set by the rollouts (deployments/rollouts.py): model -> the version its version-less
        # requests go to instead of the highest (while routed), and the models whose
        # version-less requests are split between two versions.
        self.default_versions: dict[str, str] = {}
        self.splits: dict[str, VersionSplit] = {}

    def invalidate(self) -> None:
        """Read Serve again on the next :meth:`refresh` (after a load, an unload, a reconfigure)."""
        self._read_at = 0.0

    async def refresh(self) -> list[dict[str, Any]]:
        """One index row per model version (or per unreadable model), at most half a second old."""
        async with self._lock:
            if time.monotonic() - self._read_at > _CACHE_S:
                await asyncio.to_thread(self._read)
                self._read_at = time.monotonic()
            return self.rows

    def forget_routes(self, model: str) -> None:
        """Stop routing ``model`` until Serve is read again (it is being unloaded)."""
        self.routes = {k: v for k, v in self.routes.items() if not k.startswith(f"{model}/")}

    def apply_defaults(self, models: set[str]) -> None:
        """Point the version-less routes of ``models`` at their :attr:`default_versions` (or their
        highest routed version) at once, without reading Serve again."""
        routes = dict(self.routes)
        for model in models:
            versions = [k.split("/", 1)[1] for k in routes if k.startswith(f"{model}/") and not k.endswith("/")]
            if not versions:
                continue
            wanted = self.default_versions.get(model)
            version = wanted if wanted in versions else max(versions, key=int)
            routes[f"{model}/"] = routes[f"{model}/{version}"]
        self.routes = routes

    def route(self, name: str, version: str, sticky: bytes | str | None = None) -> tuple[str, str] | None:
        """(application, deployment) serving ``name`` at ``version`` ("" for the default, or for
        a model in a rollout the version picked by its split, ``sticky``: the request's value of
        the split's header)."""
        picked = choose_version(version, None if version else self.splits.get(name), "", sticky)
        return self.routes.get(f"{name}/{picked}") or self.routes.get(f"{name}/{version}")

    def served_versions(self, name: str) -> list[str]:
        """The versions of ``name`` being served, as strings."""
        return sorted((key.split("/", 1)[1] for key in self.routes if key.startswith(f"{name}/")
                       and not key.endswith("/")), key=lambda v: (len(v), v))

    def _read(self) -> None:
        apps = serve_applications()
        load_errors = self._controller.load_errors
        rows: list[dict[str, Any]] = []
        routes: dict[str, tuple[str, str]] = {}
        running: dict[str, int] = {}
        routed_before = {app for app, _ in self.routes.values()}
        deployed = set()
        for entry in self._controller.entries(self._scan.entries()):
            if entry.error is not None:
                rows.append({"name": entry.name, "state": "UNAVAILABLE", "reason": entry.error})
                continue
            latest = max(entry.versions)
            default = self.default_versions.get(entry.name)
            default_version = int(default) if default is not None and int(default) in entry.versions else latest
            for version in entry.versions:
                app_name = model_app_name(entry.name, version, version == latest)
                app = apps.get(app_name)
                row = {"name": entry.name, "version": str(version)}
                if app is not None:
                    deployed.add(entry.name)
                if entry.name in load_errors:
                    row.update(state="UNAVAILABLE", reason=load_errors[entry.name])
                elif app is None:
                    row.update(state="UNAVAILABLE", reason="unloaded")
                else:
                    status = status_name(app.status)
                    deployment = app.deployments.get(model_deployment_name(entry.name, version))
                    route = (app_name, POOL_DEPLOYMENT if app.pooled else model_deployment_name(entry.name, version))
                    replicas = sum(deployment.replica_states.get(state, 0) for state in SERVING_STATES) if deployment else 0
                    if status in _SERVE_STATE:
                        row.update(state=_SERVE_STATE[status], reason="")
                    else:
                        row.update(state="UNAVAILABLE", reason=failure_reason(app))
                    if status == "DEPLOYING":
                        shortage = resource_shortage(app, apps)
                        if shortage is not None:
                            row["reason"] = f"waiting for {shortage.resources} resources: {shortage.text}"
                    # A served version being updated (DEPLOYING) keeps serving from its old
                    # replicas, so it stays READY (as in Triton, and for readiness probes); one
                    # deploying for the first time is not ready yet. One whose replica died
                    # (UNHEALTHY until Serve's new one runs) serves from the others meanwhile.
                    if status == "RUNNING" or (status == "DEPLOYING" and app_name in routed_before) or (
                        status == "UNHEALTHY" and replicas > 0
                    ):
                        routes[f"{entry.name}/{version}"] = route
                        running[app_name] = replicas
                        row.update(state="READY", reason=app.message if app.pooled else "")
                        if version == default_version or (version == latest and f"{entry.name}/" not in routes):
                            routes[f"{entry.name}/"] = route
                rows.append(row)
        self.rows, self.routes, self.running, self.deployed = rows, routes, running, deployed
