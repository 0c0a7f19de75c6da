"""The ``/v2`` replica's operations, protocol-neutral: its HTTP routes and gRPC methods both
call :class:`V2Api`.

It answers server metadata, readiness, the repository index, statistics (held here: model
replicas report theirs) and Triton's errors for models that are unknown or not available, and
runs model control (load, unload, polling) through the
:class:`~rayinfer.serving.model_control.ModelController`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily

import rayinfer
from rayinfer.deployments.control_channel import SHM_FORGET, TRACE_SETTINGS, ControlMessage
from rayinfer.deployments.route_table import RouteTable
from rayinfer.deployments.serve_state import NOT_RESIDENT, ServeState, cluster_gpus
from rayinfer.protocol.custom_metrics import CustomMetricsCollector
from rayinfer.protocol.errors import InvalidArgError, NotFoundError, ServingError, UnavailableError
from rayinfer.protocol.host_figures import CpuFigures, GpuFigures
from rayinfer.protocol.metrics import CacheFigures, ModelFigures, render
from rayinfer.protocol.statistics import stats_to_json
from rayinfer.protocol import log_settings
from rayinfer.protocol.shared_memory import SYSTEM, Registration, SharedMemoryRegistry
from rayinfer.serving.model_control import ModelController
from rayinfer.serving import response_cache
from rayinfer.serving.statistics_store import StatisticsStore
from rayinfer.serving.trace import TraceSettings
from rayinfer.serving.trace_writer import TraceWriter

logger = logging.getLogger(__name__)

# How long the /v2 replica waits for each model replica to take a change (a region forgotten,
# trace settings).
_REPLICA_PUSH_TIMEOUT_S = 5.0

EXTENSIONS = [
    "classification",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "model_repository",
    "model_configuration",
    "schedule_policy",
    "sequence",
    "logging",
    "system_shared_memory",
    "trace",
]
# Named too where the cluster has GPUs.
CUDA_EXTENSION = "cuda_shared_memory"
# How long the cluster's GPU count is taken as known.
_GPU_COUNT_TTL_S = 10.0


class ModelControlLock:
    """Model control's exclusion: a load (or a poll's changes) runs alone; unloads of different
    models run together (each waits for its Serve applications to go, seconds each), one at a
    time per model."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._loading = False
        self._unloading: set[str] = set()

    @contextlib.asynccontextmanager
    async def loading(self) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._loading and not self._unloading)
            self._loading = True
        try:
            yield
        finally:
            async with self._changed:
                self._loading = False
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def unloading(self, model: str) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._loading and model not in self._unloading)
            self._unloading.add(model)
        try:
            yield
        finally:
            async with self._changed:
                self._unloading.discard(model)
                self._changed.notify_all()


class V2Api:
    """What the ``/v2`` endpoints answer, over Serve's state, model control, the front's route
    table and the statistics store."""

    def __init__(self, server_id: str, strict_readiness: bool, controller: ModelController,
                 state: ServeState, routes: RouteTable, poll_secs: float = 15.0,
                 trace: dict[str, Any] | None = None) -> None:
        self._server_id = server_id
        self._strict = strict_readiness
        self.controller = controller
        self.state = state
        self.routes = routes
        self.statistics = StatisticsStore()
        self._poll_secs = poll_secs
        self._control = ModelControlLock()
        # Called with a model's name once it is unloaded (to drop what was kept for it).
        self.on_unload: list[Callable[[str], None]] = []
        # The logging extension's settings; model replicas take them when they register.
        self.log_settings = log_settings.default_settings()
        log_settings.apply(self.log_settings)
        # The system and CUDA shared memory regions clients registered.
        self.shm = SharedMemoryRegistry()
        self._gpus_seen = (0.0, -_GPU_COUNT_TTL_S)  # (the cluster's GPUs, when counted)
        # The trace extension: settings (model replicas take them) and the trace files.
        self.trace_settings = TraceSettings(dict(trace)) if trace else TraceSettings()
        self.traces = TraceWriter()
        # The response cache's size on each node (0: none; the metrics port then shows no gauges).
        self.cache_size_bytes = 0
        # Models loaded at start that have not been deployed (or failed) yet: not ready meanwhile.
        self.startup_pending: set[str] = set()
        # The rollouts (a rayinfer.deployments.rollouts.Rollouts, set by the /v2 replica): loads
        # go through them.
        self.rollouts: Any = None

    def set_log_settings(self, settings: dict[str, Any]) -> dict[str, Any]:
        """New log settings: applied here at once, in model replicas when they next register
        (within a few seconds)."""
        self.log_settings = settings
        log_settings.apply(settings)
        return settings

    # ---- shared memory ----------------------------------------------------------------------

    def shm_register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Register a region clients name in requests (mapped here to check it exists and is
        large enough); model replicas map it when a request first names it."""
        self.shm.register(name, key, offset, byte_size)

    def shm_register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """Register a CUDA region (kept here, which has no GPU; a model replica opens its handle
        when a request first names it). A cluster without GPUs refuses it, as a Triton built
        without GPU support does."""
        self.require_gpus(name)
        self.shm.register_cuda(name, raw_handle, device_id, byte_size)

    def require_gpus(self, region: str) -> None:
        """Triton's answer to a CUDA register where the cluster has no GPU (before the request's
        body is read, as a Triton built without GPU support does)."""
        if not self.cluster_has_gpus():
            raise InvalidArgError(f"failed to register CUDA shared memory region: '{region}', GPUs not supported")

    def cluster_has_gpus(self) -> bool:
        """Whether the Ray cluster has GPUs (logical ones included), counted at most every 10 s."""
        gpus, counted = self._gpus_seen
        if time.monotonic() - counted > _GPU_COUNT_TTL_S:
            gpus = cluster_gpus()
            self._gpus_seen = (gpus, time.monotonic())
        return gpus > 0

    def shm_registration(self, name: str) -> Registration | None:
        try:
            return self.shm.registration(name)
        except NotFoundError:
            return None

    async def shm_unregister(self, name: str = "", kind: str = SYSTEM) -> None:
        """Forget a region of ``kind`` (every one for an empty name), here and in every model
        replica: a request naming it afterwards gets Triton's NOT_FOUND error."""
        self.shm.unregister(name, kind)
        # A replica going away keeps nothing; one that stays keeps a stale mapping (logged).
        await self._tell_replicas(ControlMessage(SHM_FORGET, {"kind": kind, "name": name}),
                                  f"forget {kind} shared memory region '{name or '(all)'}'")

    # ---- trace --------------------------------------------------------------------------------

    async def trace_setting(self, model: str, update: dict[str, Any] | None = None) -> dict[str, Any]:
        """The trace settings of ``model`` (the server's for ""), after ``update`` (checked by
        :func:`~rayinfer.serving.trace.parse_update`); model replicas get new settings before
        this answers."""
        if model and not any(row["name"] == model for row in await self.index(ready_only=True)):
            raise InvalidArgError(f"Request for unknown model : {model}")
        if update:
            self.trace_settings.update(model, update)
            await self._push_trace_settings()
        return self.trace_settings.of(model)

    async def report_traces(self, model: str, traces: list[dict[str, Any]]) -> None:
        """Traces a model replica took: written out, and taken off the count left (every replica
        hears at once when that spends it; the traces of an ensemble's steps, and those taken for
        a client's trace context, are not taken off the count)."""
        for trace in traces:  # a step's trace follows its ensemble's settings
            if not trace.get("exported"):  # (the opentelemetry mode's spans are exported by the replicas)
                self.traces.add([trace], self.trace_settings.of(trace.get("owner") or model))
        sampled = sum(1 for trace in traces if trace.get("counted", True))
        if sampled and self.trace_settings.spend(model, sampled):
            await self._push_trace_settings()

    async def _push_trace_settings(self) -> None:
        await self._tell_replicas(ControlMessage(TRACE_SETTINGS, self.trace_settings.as_dict()),
                                  "take the new trace settings")

    async def _tell_replicas(self, message: ControlMessage, what: str) -> None:
        """Give ``message`` to every registered model replica over the control channel, at
        once; a replica that has not taken it in time is logged (it takes it when it next polls)."""
        for replica in await self.routes.channel.send(self.routes.replicas(), message, _REPLICA_PUSH_TIMEOUT_S):
            logger.warning("model replica %s did not %s in time", replica, what)

    def server_metadata(self) -> dict[str, Any]:
        extensions = EXTENSIONS + [CUDA_EXTENSION] if self.cluster_has_gpus() else EXTENSIONS
        return {"name": self._server_id, "version": rayinfer.__version__, "extensions": extensions}

    async def ready(self) -> bool:
        """Strict readiness: every model is READY; in explicit mode only the models rayinfer was
        asked to load count (as in Triton), and of those not the versions it was not asked for."""
        if not self._strict:
            return True
        rows = await self.state.refresh()
        self.startup_pending -= self.state.deployed | set(self.controller.load_errors)
        if self.startup_pending:
            return False
        if self.controller.explicit:
            asked = self.state.deployed | set(self.controller.load_errors)
            rows = [row for row in rows if row["name"] in asked and row.get("reason") != "unloaded"]
        # A ready model is also routed by the front (when there is one): its first request
        # goes straight to a replica; a pooled one the pool unloaded has no listener until then.
        return all(row["state"] == "READY" and (row.get("reason") == NOT_RESIDENT
                                                or self.routes.routes_version(row["name"], row["version"]))
                   for row in rows)

    async def index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """Triton's index: every model version with state and reason; ``ready`` keeps READY ones."""
        return [dict(r) for r in await self.state.refresh() if not ready_only or r["state"] == "READY"]

    async def unavailable_model(self, name: str, version: str | None) -> ServingError:
        """Triton's error for a model (version) that is unknown or not ready, with the reason."""
        states = [s for s in await self.state.refresh() if s["name"] == name]
        if not states:
            return NotFoundError(f"Request for unknown model: '{name}' is not found")
        if version is not None and not any(s.get("version") == version for s in states):
            return NotFoundError(f"Request for unknown model: '{name}' version {version} is not found")
        reasons = "; ".join(s["reason"] for s in states if s.get("reason"))
        suffix = f" ({reasons})" if reasons else ""
        if version is not None:
            return NotFoundError(f"Request for unknown model: '{name}' version {version} is not at ready state{suffix}")
        return NotFoundError(f"Request for unknown model: '{name}' has no available versions{suffix}")

    # ---- statistics ---------------------------------------------------------------------------

    async def report_statistics(self, replica: str, model: str, version: str, snapshot: dict[str, Any],
                                wanted: str | None = None) -> list[tuple[str, dict[str, Any]]]:
        """Keep a replica's figures; with ``wanted`` ("" for every served version), answer that
        model's figures summed over replicas."""
        self.statistics.report(replica, model, version, snapshot)
        if wanted is None:
            return []
        if not wanted:
            await self.state.refresh()
        versions = [wanted] if wanted else (self.state.served_versions(model) or [version])
        return [(v, self.statistics.merged(model, v)) for v in versions]

    async def model_stats(self, name: str, version: str) -> list[dict[str, Any]]:
        """Statistics in Triton's JSON form: every READY version, or those of one model."""
        rows = [r for r in await self.state.refresh() if r["state"] == "READY"]
        if name:
            rows = [r for r in rows if r["name"] == name and version in ("", r["version"])]
            if not rows:
                raise await self.unavailable_model(name, version or None)
        return [stats_to_json(r["name"], r["version"], self.statistics.merged(r["name"], r["version"])) for r in rows]

    async def render_metrics(self, cpu: CpuFigures | None, gpus: tuple[GpuFigures, ...],
                             summary_quantiles: tuple[float, ...] = (), counter_latencies: bool = True,
                             histogram_latencies: bool = False) -> str:
        """Triton's Prometheus text for every READY model version (rendered off the event loop:
        a few milliseconds for tens of models); ``summary_quantiles``, ``counter_latencies`` and
        ``histogram_latencies`` as --metrics-config sets them."""
        figures = [
            ModelFigures(r["name"], r["version"], self.statistics.merged(r["name"], r["version"]),
                         self.statistics.pending(r["name"], r["version"]))
            for r in await self.state.refresh() if r["state"] == "READY"
        ]
        custom = CustomMetricsCollector(self.statistics.custom_metrics())
        copies = GaugeMetricFamily("rayinfer_model_copies", "Loaded copies of a model version whose listeners the "
                                   "front routes to: its replicas, or the model pool's replicas that hold it loaded",
                                   labels=["model", "version"])
        for figure in figures:
            app, _ = self.state.routes.get(f"{figure.name}/{figure.version}") or ("", "")
            copies.add_metric([figure.name, figure.version], len(self.routes.listeners(app)) if app else 0)
        extra: list[Any] = [custom, _Families([copies])]
        if self.rollouts is not None:
            extra.append(self.rollouts)

        def rendered() -> str:
            cache = None
            if self.cache_size_bytes:  # the node's cache: read here, off the loop
                used, entries = response_cache.usage(response_cache.default_root())
                evictions = sum(f.snapshot.get("cache_evictions", 0) for f in figures)
                cache = CacheFigures(self.cache_size_bytes, used, entries, evictions)
            return render(figures, cpu, gpus, extra=extra, cache=cache, summary_quantiles=summary_quantiles,
                          counter_latencies=counter_latencies, histogram_latencies=histogram_latencies)

        return await asyncio.to_thread(rendered)

    # ---- model control ------------------------------------------------------------------------

    async def change_model(self, action: str, model: str, parameters: dict[str, Any]) -> None:
        """Load or unload ``model`` (explicit mode only); returns when it is done and, for a
        load, when the front routes it."""
        if not self.controller.explicit:
            raise UnavailableError("explicit model load / unload is not allowed if polling is enabled")
        if action == "load":
            async with self._control.loading():
                try:
                    await self._load(model, parameters)
                finally:
                    self.state.invalidate()
                await self.routes.wait_routed(model)
            return
        async with self._control.unloading(model):
            self.startup_pending.discard(model)  # unloaded before it was ever served
            await self._unload(model)
            if _truthy(parameters.get("unload_dependents")):  # an ensemble's members too
                self.state.invalidate()
                await self.state.refresh()
                served = sorted(self.state.deployed)
                members = await asyncio.to_thread(self.controller.dependents_to_unload, model, served)
                await asyncio.gather(*(self._unload(member) for member in members))  # together

    async def _load(self, model: str, parameters: dict[str, Any]) -> None:
        """Load ``model`` (through the rollouts, which may start one for a new version)."""
        if self.rollouts is not None:
            await self.rollouts.load(model, parameters)
        else:
            await asyncio.to_thread(self.controller.load, model, parameters)

    async def _unload(self, model: str) -> None:
        """Take the model out of the front's routes, then remove its applications."""
        async with self.routes.withdrawn(model):
            await asyncio.to_thread(self.controller.unload, model)
        self.statistics.forget(model)
        for forget in self.on_unload:
            forget(model)

    async def poll_forever(self, repository: Path) -> None:
        """Poll mode: load new and changed models, unload removed ones, every ``poll_secs``."""
        from rayinfer.repository.poll import PollPlan, repository_fingerprints

        plan: PollPlan | None = None  # from the first scan: what is on disk at start is served
        while True:
            try:
                await asyncio.to_thread(self.controller.refresh)  # an s3:// repository's copy
                current = await asyncio.to_thread(repository_fingerprints, repository)
                if plan is None:
                    plan = PollPlan(current)
                    continue
                to_load, to_unload = plan.step(current)
                async with self._control.loading():  # the poll's unloads and loads, as one
                    for model in to_unload:
                        logger.info("poll: model '%s' was removed; unloading it", model)
                        await self._unload(model)
                    for model in to_load:
                        logger.info("poll: model '%s' is new or changed; loading it", model)
                        try:
                            await self._load(model, {})
                        except ServingError as exc:
                            logger.error("poll: %s", exc.message)
                    if to_load or to_unload:
                        self.state.invalidate()
                        await self.routes.publish()
            except Exception:  # one bad poll must not end polling
                logger.exception("poll: scanning the repository failed")
            finally:
                # Poll mode is periodic by definition: Triton's --repository-poll-secs.
                await asyncio.sleep(self._poll_secs)


class _Families:
    """A prometheus_client collector of families built already."""

    def __init__(self, families: list[GaugeMetricFamily]) -> None:
        self._families = families

    def collect(self) -> Any:
        return iter(self._families)


def _truthy(value: Any) -> bool:
    """A load/unload parameter's boolean (JSON true, or "true" from a string parameter)."""
    return value is True or (isinstance(value, str) and value.lower() == "true")
