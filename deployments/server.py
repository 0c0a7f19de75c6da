"""ServerDeployment: the ``/v2`` application for everything that is not one model's traffic.

It answers server metadata, health, the repository index, all-model statistics and requests
for models that have no application of their own (unknown or failed to load). Model state comes
from the repository on disk and from Serve's own application status, so it is right whether
the models were deployed by ``rayinfer serve`` or by ``serve deploy``.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path
from collections.abc import Set as AbstractSet
from typing import Any

from ray import serve

import rayinfer
from rayinfer.deployments import asgi
from rayinfer.deployments.grpc_service import ServerGrpcMethods
from rayinfer.deployments.metrics_endpoint import MetricsEndpoint
from rayinfer.deployments.names import SERVER_APP, model_app_name, model_apps, model_deployment_name
from rayinfer.protocol.errors import (
    InternalError,
    InvalidArgError,
    NotFoundError,
    ServingError,
    UnavailableError,
    as_serving_error,
)
from rayinfer.protocol.http_codec import parse_json_body
from rayinfer.protocol.metrics import CpuFigures, GpuFigures, MetricsOptions, ModelFigures, render
from rayinfer.protocol.statistics import merge_snapshots, stats_to_json
from rayinfer.repository.override_files import file_parameters, write_model_directory
from rayinfer.repository.scanner import scan_model, scan_repository

logger = logging.getLogger(__name__)

EXTENSIONS = [
    "binary_tensor_data",
    "parameters",
    "statistics",
    "model_repository",
    "model_configuration",
    "schedule_policy",
]
_STATE_CACHE_S = 0.5
# A model replica's listener not registered again within this long is forgotten.
_LISTENER_TTL_S = 6.0
# How often the front's routes are compared with the served versions and their replicas.
_ROUTES_REFRESH_S = 2.0
_SERVE_STATE = {
    "RUNNING": "READY",
    "NOT_STARTED": "LOADING",
    "DEPLOYING": "LOADING",
    "DELETING": "UNLOADING",
}


def _running_replicas() -> set[str]:
    """``<application>/<replica id>`` of every replica Serve reports RUNNING."""
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    if client is None:
        raise RuntimeError("not connected to Serve")
    details = client.get_serve_details()
    return {
        f"{app_name}/{replica['replica_id']}"
        for app_name, app in details.get("applications", {}).items()
        for deployment in app.get("deployments", {}).values()
        for replica in deployment.get("replicas", [])
        if replica.get("state") == "RUNNING"  # a str enum or its value
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
    for line in reversed(lines):
        if "Error" in line.split(":", 1)[0]:
            return line.split(":", 1)[1].strip() or line
    return lines[-1] if lines else "failed to load"


@serve.deployment(name="ServerDeployment")
@serve.ingress()
class ServerDeployment(ServerGrpcMethods):
    """Serves the server-wide v2 endpoints (HTTP and gRPC); holds the statistics reported by
    model replicas; runs the metrics port and the front when asked to."""

    def __init__(
        self,
        model_repository: str,
        server_id: str = "triton",
        strict_readiness: bool = True,
        metrics: MetricsOptions | None = None,
        control: Any = None,
        grpc_front: tuple[str, int, str, int] | None = None,
        http_front: tuple[str, int, str, int] | None = None,
    ):
        self._repository = Path(model_repository)
        self._server_id = server_id
        self._strict = strict_readiness
        self._load_errors: dict[str, str] = {}
        self._stats: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
        self._states: list[dict[str, Any]] = []
        self._states_at = 0.0
        self._states_lock = asyncio.Lock()
        self._control = control  # a rayinfer.deployments.control.ModelControl; None: mode "none"
        self._control_lock = asyncio.Lock()
        # Models loaded with an override or files: (repository root, config override).
        self._sources: dict[str, tuple[Path, str | None]] = {}
        self._poll_task: asyncio.Task | None = None
        if control is not None and control.mode == "poll":
            from rayinfer.repository.poll import PollPlan, repository_fingerprints

            self._poll_plan = PollPlan(repository_fingerprints(self._repository))
            self._poll_task = asyncio.get_running_loop().create_task(self._poll_forever())
        # Served versions: "<model>/<version>" ("" = default) -> (application, deployment).
        self._routes: dict[str, tuple[str, str]] = {}
        # Replicas Serve reports RUNNING, per routed application (from the last status read).
        self._running: dict[str, int] = {}
        self._routes_lock = asyncio.Lock()
        self._handles: dict[tuple[str, str], Any] = {}
        # Model replicas' listeners: replica -> (application, host, port, last registered).
        self._listeners: dict[str, tuple[str, str, int, float]] = {}
        self._front: Any = None
        self._routes_task: asyncio.Task | None = None
        if grpc_front is not None or http_front is not None:
            from rayinfer.deployments.front import Front

            self._front = Front(http_front, grpc_front, SERVER_APP)
            self._routes_task = asyncio.get_running_loop().create_task(self._publish_routes_forever())
        self._metrics: MetricsEndpoint | None = None
        if metrics is not None:
            self._metrics = MetricsEndpoint(self._render_metrics, metrics)
            self._metrics.start()

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """``load_errors``: models whose deployment failed, with the reason (set by the CLI)."""
        self._load_errors = dict(user_config.get("load_errors") or {})
        self._states_at = 0.0

    def __serve_build_asgi_app__(self) -> Any:
        return asgi.asgi3(self._asgi)

    async def _asgi(self, scope: asgi.Scope, receive: asgi.Receive, send: asgi.Send) -> None:
        if scope["type"] == "lifespan":
            await asgi.handle_lifespan(receive, send)
            return
        path = scope["path"].rstrip("/")
        method = scope["method"]
        try:
            if path == "/v2" and method == "GET":
                await asgi.send_json(send, 200, self._server_metadata())
            elif path == "/v2/health/live" and method == "GET":
                await asgi.send_empty(send, 200)
            elif path == "/v2/health/ready" and method == "GET":
                await asgi.send_empty(send, 200 if await self._ready() else 400)
            elif path == "/v2/repository/index" and method == "POST":
                options = parse_json_body(await asgi.read_body(receive) or b"{}", "repository index")
                await asgi.send_json(send, 200, await self._index(bool(options.get("ready", False))))
            elif path == "/v2/models/stats" and method == "GET":
                await asgi.send_json(send, 200, {"model_stats": await self._all_stats()})
            elif path.startswith("/v2/repository/models/") and method == "POST":
                await self._repository_control(path, receive, send)
            elif path.startswith("/v2/models/"):
                await self._unroutable_model(path, method, send)
            else:
                raise NotFoundError(f"Not Found: {method} {scope['path']}")
        except ServingError as exc:
            await asgi.send_error(send, exc)

    def _server_metadata(self) -> dict[str, Any]:
        return {"name": self._server_id, "version": rayinfer.__version__, "extensions": EXTENSIONS}

    async def _unroutable_model(self, path: str, method: str, send: asgi.Send) -> None:
        """A model path no model application claimed: the model is unknown or not available."""
        parts = path[len("/v2/models/"):].split("/")
        version = parts[2] if len(parts) >= 3 and parts[1] == "versions" else None
        if parts[-1] == "ready" and method == "GET":
            await asgi.send_empty(send, 400)
            return
        raise await self._unavailable_model(parts[0], version)

    async def _unavailable_model(self, name: str, version: str | None) -> ServingError:
        """Triton's error for a model (version) that is unknown or not ready, with the reason."""
        states = [s for s in await self._model_states() if s["name"] == name]
        if not states:
            return NotFoundError(f"Request for unknown model: '{name}' is not found")
        if version is not None and not any(s.get("version") == version for s in states):
            return NotFoundError(f"Request for unknown model: '{name}' version {version} is not found")
        reasons = "; ".join(s["reason"] for s in states if s.get("reason"))
        suffix = f" ({reasons})" if reasons else ""
        if version is not None:
            return NotFoundError(f"Request for unknown model: '{name}' version {version} is not at ready state{suffix}")
        return NotFoundError(f"Request for unknown model: '{name}' has no available versions{suffix}")

    async def _ready(self) -> bool:
        if not self._strict:
            return True
        # In explicit mode a model nobody asked to load does not make the server unready.
        return all(
            s["state"] == "READY" or (self._explicit and s.get("reason") == "unloaded")
            for s in await self._model_states()
        )

    @property
    def _explicit(self) -> bool:
        return self._control is not None and self._control.mode == "explicit"

    # ---- model control (explicit and poll modes) --------------------------------------------

    async def _repository_control(self, path: str, receive: asgi.Receive, send: asgi.Send) -> None:
        """``POST /v2/repository/models/<m>/load`` and ``.../unload``; both answer when done."""
        model, _, action = path[len("/v2/repository/models/"):].rpartition("/")
        if not model or "/" in model or action not in ("load", "unload"):
            raise NotFoundError(f"Not Found: POST {path}")
        body = await asgi.read_body(receive)
        parameters = (parse_json_body(body, "repository") if body else {}).get("parameters") or {}
        if not isinstance(parameters, dict):
            raise InvalidArgError("'parameters' of a repository request must be a JSON object")
        await self._change_model(action, model, parameters)
        await asgi.send_empty(send, 200)

    async def _change_model(self, action: str, model: str, parameters: dict[str, Any]) -> None:
        """Load or unload ``model`` (explicit mode only); returns when it is done and, for a
        load, when the front routes it."""
        if not self._explicit:
            raise UnavailableError("explicit model load / unload is not allowed if polling is enabled")
        async with self._control_lock:
            if action == "load":
                try:
                    await asyncio.to_thread(self._load_model, model, parameters)
                finally:
                    self._states_at = 0.0
                await self._await_routes(model)
            else:
                await self._unload(model)

    async def _unload(self, model: str) -> None:
        """Take the model out of the front's routes, then remove its applications."""
        async with self._routes_lock:
            self._routes = {k: v for k, v in self._routes.items() if not k.startswith(f"{model}/")}
            self._handles = {route: h for route, h in self._handles.items() if not model_apps(model, [route[0]])}
            if self._front is not None:
                try:
                    await self._front.publish(self._front_routes())
                except Exception:  # the /v2 app answers what the front still routes to a removed app
                    logger.exception("could not withdraw '%s' from the front's routes", model)
            await asyncio.to_thread(self._unload_model, model)
            self._states_at = 0.0

    async def _await_routes(self, model: str, timeout_s: float = 15.0) -> None:
        """Wait (a little) until the front routes every served version of ``model``."""
        deadline = time.monotonic() + timeout_s
        while self._front is not None and time.monotonic() < deadline:
            await self._publish_routes()
            wanted = {k for k in self._routes if k.startswith(f"{model}/")}
            if wanted <= set(self._front.published):
                return
            await asyncio.sleep(0.1)

    async def _poll_forever(self) -> None:
        """Poll mode: load new and changed models, unload removed ones, every ``poll_secs``."""
        from rayinfer.repository.poll import repository_fingerprints

        while True:
            await asyncio.sleep(self._control.poll_secs)
            try:
                current = await asyncio.to_thread(repository_fingerprints, self._repository)
                to_load, to_unload = self._poll_plan.step(current)
                async with self._control_lock:
                    for model in to_unload:
                        logger.info("poll: model '%s' was removed; unloading it", model)
                        await self._unload(model)
                    for model in to_load:
                        logger.info("poll: model '%s' is new or changed; loading it", model)
                        try:
                            await asyncio.to_thread(self._load_model, model, {})
                        except ServingError as exc:
                            logger.error("poll: %s", exc.message)
                    if to_load or to_unload:
                        self._states_at = 0.0
                        await self._publish_routes()
            except Exception:  # one bad poll must not end polling
                logger.exception("poll: scanning the repository failed")

    def _load_model(self, model: str, parameters: dict[str, Any]) -> None:
        """Deploy every version the model's policy selects; remove versions no longer selected.

        ``parameters.config``: a config in Triton's JSON form used instead of config.pbtxt;
        ``file:<version>/<name>`` parameters: the model's files, served from a temporary model
        directory (they need ``config``).
        """
        from rayinfer.deployments.control import deploy_models, trial_load  # it imports this module

        if not model or model.startswith(".") or "/" in model or not (self._repository / model).is_dir():
            raise InternalError(f"failed to load '{model}', failed to poll from model repository")
        override = parameters.get("config")
        if override is not None and not isinstance(override, str):
            raise InvalidArgError(f"failed to load '{model}': parameter 'config' must be a JSON string")
        files = file_parameters(model, parameters)
        if files and override is None:
            raise InvalidArgError(f"failed to load '{model}': 'file:' parameters need the 'config' parameter")
        root = write_model_directory(model, files) if files else self._repository
        try:
            versions = self._check_versions(root, model, override, trial_load)
        except BaseException:  # nothing was deployed from the new files
            if files:
                shutil.rmtree(root, ignore_errors=True)
            raise
        # From here on applications may run from ``root``: it is kept until the model is unloaded
        # or loaded again from elsewhere.
        previous = self._sources.pop(model, None)
        if files or override is not None:
            self._sources[model] = (root, override)
        if previous is not None and previous[0] not in (root, self._repository):
            shutil.rmtree(previous[0], ignore_errors=True)
        self._deploy_versions(root, model, override, versions, deploy_models)

    def _check_versions(self, root: Path, model: str, override: str | None,
                        trial_load: Any) -> list[tuple[str, int, bool]]:
        """The versions to deploy; a serving model's new versions are loaded on trial first."""
        entry = scan_model(root / model, override)
        serving = bool(model_apps(model, serve.status().applications))
        if entry.error is not None:
            if not serving:  # a serving version keeps serving
                self._load_errors[model] = entry.error
            raise InvalidArgError(f"failed to load '{model}': {entry.error}")
        latest = max(entry.versions)
        versions = [(model, v, v == latest) for v in entry.versions]
        if serving:
            try:  # a serving model keeps serving unless the new one loads
                trial_load(str(root), versions, self._control, override)
            except Exception as exc:
                raise InvalidArgError(f"failed to load '{model}': {as_serving_error(exc).message}") from None
        return versions

    def _deploy_versions(self, root: Path, model: str, override: str | None, versions: list[tuple[str, int, bool]],
                         deploy_models: Any) -> None:
        failures = deploy_models(str(root), versions, self._control, {model: override} if override else None)
        wanted = {model_app_name(*v) for v in versions}
        for name in model_apps(model, serve.status().applications):
            if name not in wanted:
                serve.delete(name, _blocking=False)
        if model in failures:
            self._load_errors[model] = failures[model]
            raise InvalidArgError(f"failed to load '{model}': {failures[model]}")
        self._load_errors.pop(model, None)

    def _unload_model(self, model: str) -> None:
        """Remove every version of the model (unknown or unloaded models: nothing to do, as Triton);
        returns once they are gone, so the model is no longer ready to either protocol."""
        names = model_apps(model, serve.status().applications)
        for name in names:
            serve.delete(name, _blocking=False)
        deadline = time.monotonic() + 60
        while names and time.monotonic() < deadline:
            apps = serve.status().applications
            names = [name for name in names if name in apps]
            time.sleep(0.1)
        source = self._sources.pop(model, None)
        if source is not None and source[0] != self._repository:
            shutil.rmtree(source[0], ignore_errors=True)
        self._load_errors.pop(model, None)
        for key in [k for k in self._stats if k[0] == model]:
            del self._stats[key]

    async def _index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """Triton's index: every model version with state and reason; ``ready`` keeps READY ones."""
        return [dict(s) for s in await self._model_states() if not ready_only or s["state"] == "READY"]

    async def _model_states(self) -> list[dict[str, Any]]:
        """One row per model version (or per broken model), cached briefly."""
        async with self._states_lock:
            if time.monotonic() - self._states_at > _STATE_CACHE_S:
                self._states = await asyncio.to_thread(self._read_states)
                self._states_at = time.monotonic()
            return self._states

    def _read_states(self) -> list[dict[str, Any]]:
        apps = serve.status().applications
        rows: list[dict[str, Any]] = []
        routes: dict[str, tuple[str, str]] = {}
        running: dict[str, int] = {}
        routed_before = {app for app, _ in self._routes.values()}
        for entry in scan_repository(self._repository):
            source = self._sources.get(entry.name)
            if source is not None:  # loaded with a config override or files of its own
                entry = scan_model(source[0] / entry.name, source[1])
            if entry.error is not None:
                rows.append({"name": entry.name, "state": "UNAVAILABLE", "reason": entry.error})
                continue
            latest = max(entry.versions)
            for version in entry.versions:
                app = apps.get(model_app_name(entry.name, version, version == latest))
                row = {"name": entry.name, "version": str(version)}
                if entry.name in self._load_errors:
                    row.update(state="UNAVAILABLE", reason=self._load_errors[entry.name])
                elif app is None:
                    row.update(state="UNAVAILABLE", reason="unloaded")
                elif status_name(app.status) in _SERVE_STATE:
                    row.update(state=_SERVE_STATE[status_name(app.status)], reason="")
                    # A served version being updated (DEPLOYING) keeps serving from its old
                    # replicas, so it stays READY (as in Triton, and for readiness probes); one
                    # deploying for the first time is not ready yet.
                    app_name = model_app_name(entry.name, version, version == latest)
                    if status_name(app.status) == "RUNNING" or (
                        status_name(app.status) == "DEPLOYING" and app_name in routed_before
                    ):
                        route = (app_name, model_deployment_name(entry.name, version))
                        routes[f"{entry.name}/{version}"] = route
                        deployment = app.deployments.get(route[1])
                        running[app_name] = sum(
                            n for state, n in (deployment.replica_states if deployment else {}).items()
                            if state == "RUNNING"
                        )
                        row["state"] = "READY"
                        if version == latest:
                            routes[f"{entry.name}/"] = route
                else:
                    row.update(state="UNAVAILABLE", reason=failure_reason(app))
                rows.append(row)
        self._routes = routes
        self._running = running
        return rows

    # ---- the front's routes ----------------------------------------------------------------

    async def _publish_routes(self) -> None:
        """Give the front the versions served right now and their running replicas' listeners
        (no-op without a front)."""
        if self._front is None:
            return
        async with self._routes_lock:
            await self._model_states()
            try:
                await self._front.publish(self._front_routes(await self._not_running()))
            except Exception:  # the front keeps its previous routes; the /v2 app forwards the rest
                logger.exception("could not update the front's routes")

    def _front_routes(self, not_running: AbstractSet[str] = frozenset()) -> dict[str, list[tuple[str, int]]]:
        """The front's routes: ``<model>/<version>`` -> the listeners of its replicas, less those
        in ``not_running`` (versions none of whose replicas is routable are left to Serve)."""
        now = time.monotonic()
        self._listeners = {k: v for k, v in self._listeners.items() if now - v[3] < _LISTENER_TTL_S}
        by_app: dict[str, list[tuple[str, int]]] = {}
        for replica, (app, host, port, _) in self._listeners.items():
            if replica not in not_running:
                by_app.setdefault(app, []).append((host, port))
        return {key: sorted(by_app[app]) for key, (app, _) in self._routes.items() if app in by_app}

    async def _not_running(self) -> set[str]:
        """Registered replicas Serve does not report RUNNING: one being stopped serves out Serve's
        draining period (30 s by default) and must get no new calls; one still starting gets
        none yet. Asked of Serve's controller only while some application has more registered
        listeners than running replicas (during an update, a restart or a scale-down)."""
        registered: dict[str, int] = {}
        for app, *_ in self._listeners.values():
            registered[app] = registered.get(app, 0) + 1
        if all(count <= self._running.get(app, 0) for app, count in registered.items() if app in self._running):
            return set()
        try:
            running = await asyncio.to_thread(_running_replicas)
        except Exception as exc:  # keep routing to every registered replica
            logger.debug("could not read the replicas' states: %s", exc)
            return set()
        return {replica for replica in self._listeners if replica not in running}

    async def register_listener(self, replica_key: str, app: str, host: str, port: int) -> None:
        """A model replica's listener, registered at start and again every few seconds."""
        known = replica_key in self._listeners
        self._listeners[replica_key] = (app, host, int(port), time.monotonic())
        if not known:
            await self._publish_routes()

    async def withdraw_listener(self, replica_key: str) -> None:
        """A model replica is stopping: returns once the front no longer routes to it."""
        if self._listeners.pop(replica_key, None) is not None:
            await self._publish_routes()

    async def _publish_routes_forever(self) -> None:
        while True:
            await self._publish_routes()
            await asyncio.sleep(_ROUTES_REFRESH_S)

    # ---- statistics reported by model replicas ---------------------------------------------

    def report_statistics(self, replica_key: str, model: str, version: str, snapshot: dict[str, Any]) -> None:
        self._stats.setdefault((model, version), {})[replica_key] = snapshot

    def model_statistics(self, model: str, version: str) -> dict[str, Any] | None:
        per_replica = self._stats.get((model, version))
        return merge_snapshots(list(per_replica.values())) if per_replica else None

    async def _render_metrics(self, cpu: CpuFigures | None, gpus: tuple[GpuFigures, ...]) -> str:
        """Triton's Prometheus text for every READY model version."""
        figures = []
        for row in await self._model_states():
            if row["state"] != "READY":
                continue
            name, version = row["name"], row["version"]
            pending = sum(s.get("pending_request_count", 0) for s in self._stats.get((name, version), {}).values())
            snapshot = self.model_statistics(name, version) or merge_snapshots([])
            figures.append(ModelFigures(name, version, snapshot, pending))
        return render(figures, cpu, gpus)

    def check_health(self) -> None:
        """Serve restarts this replica (and so the front) if the front has died."""
        if self._front is not None and not self._front.running:
            raise RuntimeError("the front (HAProxy) has exited")

    def __del__(self) -> None:
        for root, _ in getattr(self, "_sources", {}).values():
            if root != self._repository:
                shutil.rmtree(root, ignore_errors=True)
        metrics = getattr(self, "_metrics", None)
        if metrics is not None:
            metrics.stop()
        for name in ("_poll_task", "_routes_task"):
            task = getattr(self, name, None)
            if task is not None:
                task.cancel()
        front = getattr(self, "_front", None)
        if front is not None:
            front.stop()

    async def _all_stats(self) -> list[dict[str, Any]]:
        out = []
        for row in await self._model_states():
            if row["state"] != "READY":
                continue
            snapshot = self.model_statistics(row["name"], row["version"]) or merge_snapshots([])
            out.append(stats_to_json(row["name"], row["version"], snapshot))
        return out
