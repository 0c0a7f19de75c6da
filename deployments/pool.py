"""PoolDeployment: one pool of replicas that each host many model versions.

A small model's replica of its own costs a Ray worker process (about 100 MiB on top of the
model, docs/benchmarks.md); a pool replica holds every pooled model version as a
:class:`~rayinfer.deployments.hosted_model.HostedModel` in one process. Each hosted version
keeps what a dedicated replica gives it: its own core (batcher, statistics, config, errors), its
own listener, registered under its own application name (so the front, the route table and the
index see it as they see a dedicated replica), and its own statistics key.

Which versions the pool hosts is its ``user_config`` (:func:`pool_application`): a load or an
unload deploys the pool again with the new list, and Serve reconfigures the running replicas in
place (:meth:`PoolDeployment.reconfigure`) without restarting them or the other models. A
version that fails to load is kept out with its reason (:meth:`PoolDeployment.hosting_report`),
which the deployer reads and reports as the model's load error; its neighbours go on serving.

Handle calls (the ``/v2`` replica's forwarded RPCs, BLS, streams, an ensemble's steps) carry the
version's application name as Serve's multiplexed model id (:mod:`model_handles`).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import time
import uuid
from typing import Any

import ray
from ray import serve
from ray.serve.schema import LoggingConfig

from rayinfer.deployments.hosted_model import HostedModel, HostingOptions, change_key
from rayinfer.deployments.names import POOL_DEPLOYMENT, POOL_KEY_SEP, SERVER_APP, SERVER_DEPLOYMENT, pool_key
from rayinfer.deployments.pool_reports import KV_NAMESPACE, report_key, spec_digest
from rayinfer.deployments.serve_internals import kv_delete, kv_put, replica_id, with_code_version
from rayinfer.protocol import log_settings
from rayinfer.protocol.errors import UnavailableError
from rayinfer.protocol.types import InferRequest, InferResponse

logger = logging.getLogger(__name__)

_STATS_PUSH_INTERVAL_S = 0.5
_LISTENER_REGISTER_INTERVAL_S = 2.0
# Versions a pool replica loads at once (each load runs in a thread: file reads, a framework
# session).
_LOADS_AT_ONCE = 4

# (model, version, options: the repository and HostingOptions' fields): one hosted version, by
# application name.
HostedSpec = tuple[str, int, dict[str, Any]]


@serve.deployment(name=POOL_DEPLOYMENT)
class PoolDeployment:
    """Hosts the pooled model versions its ``user_config`` lists."""

    async def __init__(self, start_log_settings: dict[str, Any] | None = None) -> None:
        log_settings.write_lines_here()
        if start_log_settings:
            log_settings.apply({**log_settings.default_settings(), **start_log_settings})
        context = serve.get_replica_context()
        self._replica_id = replica_id(context)
        self._replica_key = f"{context.app_name}/{self._replica_id}"
        self._deployment = context.deployment
        self._server: Any = None
        self._hosted: dict[str, HostedModel] = {}
        self._specs: dict[str, HostedSpec] = {}
        self._failures: dict[str, str] = {}
        self._changing = asyncio.Lock()
        self._registered_at: dict[str, float] = {}
        # Each load of a version registers under a key of its own: the load that replaces it
        # (a reload) registers before the old one withdraws.
        self._loads = 0
        loop = asyncio.get_running_loop()
        self._report_task = loop.create_task(self._report_forever())
        self._control_task = loop.create_task(self._poll_control_forever())

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Host exactly the versions ``user_config["models"]`` lists ({application: spec}): new
        ones are loaded, changed ones loaded again and swapped in, gone ones drained and closed."""
        wanted: dict[str, HostedSpec] = {app: (str(s[0]), int(s[1]), dict(s[2]))
                                         for app, s in dict(user_config.get("models") or {}).items()}
        async with self._changing:
            gone = [app for app in self._specs if app not in wanted]
            changed = [app for app, spec in wanted.items() if self._specs.get(app) != spec]
            for app in gone:
                self._specs.pop(app, None)
                self._failures.pop(app, None)
            # A failing close or report never fails the reconfiguration (Serve would replace the
            # replica, and every pooled version with it): each is logged.
            await asyncio.gather(*(self._close(app) for app in gone))
            limit = asyncio.Semaphore(_LOADS_AT_ONCE)

            async def load(app: str) -> None:
                async with limit:
                    await self._load(app, wanted[app])
                await self._publish_report()  # each version is ready as soon as it is loaded

            await asyncio.gather(*(load(app) for app in changed))
            await self._publish_report()
        gc.collect()

    async def _publish_report(self) -> None:
        """This replica's hosting report, to Ray's key-value store (:mod:`pool_reports`); tried
        three times, then logged (the deployer waits on it, up to its timeout)."""
        report = json.dumps(self.hosting_report()).encode()
        for attempt in range(3):
            try:
                await asyncio.to_thread(kv_put, report_key(self._replica_id), report, KV_NAMESPACE)
                return
            except Exception as exc:  # noqa: BLE001  # the GCS did not answer: again, shortly
                logger.warning("could not publish the pool's report (attempt %d): %s", attempt + 1, exc)
                await asyncio.sleep(0.5)  # a GCS that did not answer: give it a moment, three tries in all

    async def _load(self, app: str, spec: HostedSpec) -> None:
        model, version, options = spec
        self._failures.pop(app, None)
        self._loads += 1
        try:
            hosted = await HostedModel.load(
                options["repository"], model, version, HostingOptions(**_options(options)),
                replica_key=pool_key(self._replica_key, f"{app}{POOL_KEY_SEP}{self._loads}"), app_name=app,
                deployment=self._deployment,
                server=self._server_handle,
            )
        except Exception as exc:  # this version only: its neighbours go on serving
            reason = str(exc) or type(exc).__name__
            logger.error("model '%s' version %d failed to load in the pool: %s", model, version, reason)
            self._specs[app] = spec
            self._failures[app] = reason
            self._registered_at.pop(app, None)
            await _close_quietly(self._hosted.pop(app, None))
            return
        old = self._hosted.get(app)
        self._hosted[app] = hosted
        self._specs[app] = spec
        # A reload: the new load registers its listener before the old one withdraws and drains.
        await self._register(app, hosted)
        await _close_quietly(old)

    async def _close(self, app: str) -> None:
        self._registered_at.pop(app, None)
        await _close_quietly(self._hosted.pop(app, None))

    # ---- handle calls (the hosted version: Serve's multiplexed model id) --------------------

    def _model(self) -> HostedModel:
        app = serve.get_multiplexed_model_id()
        hosted = self._hosted.get(app)
        if hosted is None:
            reason = self._failures.get(app)
            raise UnavailableError(f"model application '{app}' is not hosted by this pool replica"
                                   + (f": {reason}" if reason else ""))
        return hosted

    def hosting_report(self) -> dict[str, Any]:
        """What this replica hosts: {"loaded": {application: spec digest}, "failed": {application:
        [spec digest, reason]}}."""
        return {"loaded": {app: spec_digest(self._specs[app]) for app in self._hosted if app in self._specs},
                "failed": {app: [spec_digest(self._specs[app]), reason] for app, reason in self._failures.items()
                           if app in self._specs}}

    async def grpc_forwarded(self, method: str, payload: bytes) -> bytes:
        return await self._model().grpc_forwarded(method, payload)

    async def bls_infer(self, request: InferRequest) -> InferResponse:
        return await self._model().bls_infer(request)

    async def model_ready(self) -> bool:
        return await self._model().core.ready()

    def model_config_json(self) -> str:
        return self._model().config_json()

    async def bls_stream(self, request: InferRequest, mark_final_alone: bool = False) -> Any:
        async with contextlib.aclosing(self._model().bls_stream(request, mark_final_alone)) as messages:
            async for message in messages:  # a caller that gives up closes the model's stream at once
                yield message

    async def grpc_stream(self, payload: bytes, trace_context: str | None = None,
                          read_walls: tuple[int, int] | None = None) -> Any:
        async with contextlib.aclosing(self._model().grpc_stream(payload, trace_context, read_walls)) as messages:
            async for message in messages:
                yield message

    # ---- the /v2 replica --------------------------------------------------------------------

    def _server_handle(self) -> Any:
        if self._server is None:
            self._server = serve.get_deployment_handle(SERVER_DEPLOYMENT, SERVER_APP)
        return self._server

    async def _register(self, app: str, hosted: HostedModel) -> None:
        try:
            settings = await self._server_handle().register_listener.remote(
                hosted.replica_key, app, *hosted.listener_address, False, ray.get_runtime_context().current_actor,
            )
            if self._hosted.get(app) is hosted:  # not one replaced meanwhile (a reload)
                self._registered_at[app] = time.monotonic()
            hosted.take_settings(settings)
        except Exception as exc:  # the server app may not be deployed (yet)
            logger.debug("could not register the listener of '%s': %s", app, exc)

    async def _poll_control_forever(self) -> None:
        """One long poll for the whole replica; each message goes to every hosted version."""
        epoch, acked = None, 0
        while True:
            try:
                answer_epoch, messages = await self._server_handle().control_poll.remote(self._replica_key, epoch, acked)
            except Exception as exc:
                logger.debug("could not poll the control channel: %s", exc)
                # The /v2 app is not deployed yet, or restarts: poll again as registration does.
                await asyncio.sleep(_LISTENER_REGISTER_INTERVAL_S)
                continue
            if answer_epoch != epoch:
                epoch, acked = answer_epoch, 0
            for seq, message in messages:
                for hosted in list(self._hosted.values()):
                    try:
                        hosted.take_control(message)
                    except Exception:
                        logger.exception("model '%s' could not take the server's %s", hosted.core.name, message.kind)
                acked = max(acked, seq)

    async def _report_forever(self) -> None:
        """Register each hosted version's listener every few seconds; push statistics that changed."""
        while True:
            now = time.monotonic()
            for app, hosted in list(self._hosted.items()):
                if now - self._registered_at.get(app, float("-inf")) >= _LISTENER_REGISTER_INTERVAL_S:
                    await self._register(app, hosted)
            await asyncio.sleep(_STATS_PUSH_INTERVAL_S)
            for hosted in list(self._hosted.values()):
                await hosted.report_shadow()
                for key, core in hosted.reported_cores():
                    traces = core.tracer.collect()
                    if traces:
                        try:
                            await self._server_handle().report_traces.remote(core.name, traces)
                        except Exception as exc:  # the server app may be gone: those traces are lost
                            logger.debug("could not report traces: %s", exc)
                    snapshot = core.snapshot()
                    if change_key(snapshot) == hosted.pushed.get(key):
                        continue
                    try:
                        await self._server_handle().report_statistics.remote(key, core.name, core.version, snapshot)
                        hosted.pushed[key] = change_key(snapshot)
                    except Exception as exc:
                        logger.debug("could not publish statistics: %s", exc)

    async def __del__(self) -> None:
        for name in ("_report_task", "_control_task"):
            task = getattr(self, name, None)
            if task is not None:
                task.cancel()
        await asyncio.gather(*(hosted.close() for hosted in getattr(self, "_hosted", {}).values()))
        if hasattr(self, "_replica_id"):
            try:
                await asyncio.to_thread(kv_delete, report_key(self._replica_id), KV_NAMESPACE)
            except Exception as exc:  # noqa: BLE001  # the GCS may be going away with the server
                logger.debug("could not remove the pool's report: %s", exc)


async def _close_quietly(hosted: HostedModel | None) -> None:
    """Close a hosted version; a failure is logged (the pool's other versions serve on)."""
    if hosted is None:
        return
    try:
        await hosted.close()
    except Exception:
        logger.exception("could not close model '%s' cleanly", getattr(getattr(hosted, "core", None), "name", "?"))


def _options(values: dict[str, Any]) -> dict[str, Any]:
    """HostingOptions' fields from a spec's JSON-able values (less the repository and the load)."""
    out = {key: value for key, value in values.items() if key not in ("repository", "load")}
    out["restricted"] = tuple((kind, tuple(v)) for kind, v in dict(values.get("restricted") or {}).items())
    return out


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


def pool_application(models: dict[str, HostedSpec], *, replicas: int, num_cpus: float,
                     actor_options: dict[str, Any], log_level: str, log_settings_at_start: dict[str, Any] | None,
                     max_ongoing_requests: int, version: str) -> Any:
    """The pool's application, hosting ``models`` ({application: spec}) on ``replicas`` replicas.
    ``version``: the pool's code version, the same for every deploy of one server, so that a new
    list of models reconfigures the running replicas instead of replacing them."""
    deployment = PoolDeployment.options(
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={**actor_options, "num_cpus": num_cpus},
        user_config={"models": {app: list(spec) for app, spec in sorted(models.items())}},
        health_check_period_s=5.0,
        graceful_shutdown_timeout_s=10.0,
        graceful_shutdown_wait_loop_s=0.2,
        max_constructor_retry_count=1,
        logging_config=LoggingConfig(enable_access_log=False, log_level=log_level),
    )
    return with_code_version(deployment, version).bind(log_settings_at_start or None)
