"""PoolDeployment: one pool of replicas that each host many model versions.

A small model's replica of its own costs a Ray worker process (about 100 MiB on top of the
model, docs/benchmarks.md); a pool replica holds every pooled model version as a
:class:`~rayinfer.deployments.hosted_model.HostedModel` in one process. Each hosted version
keeps what a dedicated replica gives it: its own core (batcher, statistics, config, errors), its
own listener, registered under its own application name (so the front, the route table and the
index see it as they see a dedicated replica), and its own statistics key.

Which versions the pool hosts is its ``user_config``
(:func:`~rayinfer.deployments.pool_control.pool_application`): a load or an unload deploys the
pool again with the new list, and Serve reconfigures the running replicas in place (:meth:`PoolDeployment.reconfigure`) without restarting them or the other models. A
version that fails to load is kept out with its reason (:meth:`PoolDeployment.hosting_report`),
which the deployer reads and reports as the model's load error; its neighbours go on serving.

Handle calls (the ``/v2`` replica's forwarded RPCs and HTTP requests, BLS, streams, an
ensemble's steps) carry the version's application name as Serve's multiplexed model id
(:mod:`model_handles`); each replica tells Serve which versions it holds, so that Serve's router
sends a call to a replica that holds its version first.

With ``max_models`` (--pool-max-models) a replica holds at most that many versions loaded: past
it, it unloads the least recently used version with nothing in flight (its listener withdrawn
and drained, its handle calls ended first), and keeps its spec. A request for an unloaded version
reaches the replica by handle (the front has no listener for it: the ``/v2`` replica forwards
it), which loads the version again while the request waits (--pool-load-timeout-secs).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve
from tritonclient.grpc import service_pb2 as pb

from rayinfer.adapters.python_backend import model_context
from rayinfer.deployments.cluster_records import delete_report, read_every_report, spec_digest, write_report
from rayinfer.deployments.hosted_model import HostedModel, HostingOptions
from rayinfer.deployments.names import POOL_DEPLOYMENT, POOL_KEY_SEP, SERVER_APP, SERVER_DEPLOYMENT, pool_key
from rayinfer.deployments.pool_spread import RequestRates, busy_versions, spread
from rayinfer.deployments.serve_internals import publish_multiplexed_models, replica_id
from rayinfer.protocol import log_settings
from rayinfer.protocol.errors import UnavailableError
from rayinfer.protocol.types import InferRequest, InferResponse
from rayinfer.serving.routes import ModelRoute

logger = logging.getLogger(__name__)

_STATS_PUSH_INTERVAL_S = 0.5
_LISTENER_REGISTER_INTERVAL_S = 2.0
# How often a replica samples its versions' request rates and, with --pool-scale-up-rpm, spreads
# busy versions (:mod:`pool_spread`).
_SPREAD_INTERVAL_S = 2.0
# Versions a pool replica loads at once (each load runs in a thread: file reads, a framework
# session).
_LOADS_AT_ONCE = 4
# How long a version being unloaded waits for the calls it is answering (as a listener drains).
_DRAIN_S = 10.0

# (model, version, options: the repository and HostingOptions' fields): one hosted version, by
# application name.
HostedSpec = tuple[str, int, dict[str, Any]]


@serve.deployment(name=POOL_DEPLOYMENT)
class PoolDeployment:
    """Hosts the pooled model versions its ``user_config`` lists, at most ``max_models`` of them
    loaded at once (0: all)."""

    async def __init__(self, start_log_settings: dict[str, Any] | None = None) -> None:
        log_settings.write_lines_here()
        if start_log_settings:
            log_settings.apply({**log_settings.default_settings(), **start_log_settings})
        context = serve.get_replica_context()
        self._context = context
        model_context.share_process()  # a Python model's pb_utils answers by its calls, not the process
        self._replica_id = replica_id(context)
        self._replica_key = f"{context.app_name}/{self._replica_id}"
        self._deployment = context.deployment
        self._server: Any = None
        # Every version this replica hosts (its user_config's), and those of them loaded now.
        self._specs: dict[str, HostedSpec] = {}
        self._hosted: dict[str, HostedModel] = {}
        self._failures: dict[str, str] = {}
        # Versions loaded once with their spec and unloaded since to keep within max_models:
        # the next request for one loads it again.
        self._evicted: set[str] = set()
        self._used: dict[str, float] = {}  # when a handle call last asked for a version (Unix time)
        self._loading: dict[str, asyncio.Task[None]] = {}  # loads again that requests wait for
        self._waiting: dict[str, int] = {}  # requests waiting for a version's load again (it is not unloaded meanwhile)
        self._load_errors: dict[str, str] = {}  # why a version's last load again failed (the next request tries again)
        # Each version's statistics, carried from one load of it to the next and reported under
        # one key per version, so that its figures go on across an unload.
        self._stats: dict[str, Any] = {}
        self._load_limit = asyncio.Semaphore(_LOADS_AT_ONCE)  # loads at start, on a change and again
        # What the replica runs on its own: versions draining after an unload or a reload, and
        # unloads down to max_models after a load again.
        self._background: set[asyncio.Task[None]] = set()
        self._locks: dict[str, asyncio.Lock] = {}  # one load, reload or unload of a version at a time
        self._max_models = 0
        self._load_timeout_s = 60.0
        # --pool-scale-up-rpm (0: never) and how many replicas the pool has: a busy version's
        # copies (pool_spread); each version's requests per minute here.
        self._scale_up_rpm = 0.0
        self._replicas = 1
        self._rates = RequestRates()
        self._spread_at = 0.0
        self._changing = asyncio.Lock()
        self._publishing = asyncio.Lock()  # one report put at a time (the last put is the newest)
        self._registered_at: dict[str, float] = {}
        # Each load of a version registers under a key of its own: the load that replaces it
        # (a reload) registers before the old one withdraws.
        self._loads = 0
        loop = asyncio.get_running_loop()
        self._report_task = loop.create_task(self._report_forever())
        self._control_task = loop.create_task(self._poll_control_forever())

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Host exactly the versions ``user_config["models"]`` lists ({application: spec}): new
        ones are loaded, changed ones loaded again and swapped in, gone ones drained and closed;
        then the least recently used are unloaded down to ``user_config["max_models"]``."""
        wanted: dict[str, HostedSpec] = {app: (str(s[0]), int(s[1]), dict(s[2]))
                                         for app, s in dict(user_config.get("models") or {}).items()}
        self._max_models = int(user_config.get("max_models") or 0)
        self._load_timeout_s = float(user_config.get("load_timeout_s") or 60.0)
        self._scale_up_rpm = float(user_config.get("scale_up_rpm") or 0.0)
        self._replicas = int(user_config.get("replicas") or 1)
        async with self._changing:
            gone = [app for app in self._specs if app not in wanted]
            changed = [app for app, spec in wanted.items() if self._specs.get(app) != spec]
            for app in gone:
                self._specs.pop(app, None)
                self._failures.pop(app, None)
                self._evicted.discard(app)
                self._used.pop(app, None)
                self._load_errors.pop(app, None)
                self._stats.pop(app, None)
            # A failing close or report never fails the reconfiguration (Serve would replace the
            # replica, and every pooled version with it): each is logged.
            await asyncio.gather(*(self._unload(app) for app in gone))

            async def load(app: str) -> None:
                async with self._load_limit, self._lock(app):
                    await self._load(app, wanted[app])
                await self._fit(keep=app)  # within max_models as it goes: a broken version fails now
                await self._publish_report()  # each version is ready as soon as it is loaded

            await asyncio.gather(*(load(app) for app in changed))
            await self._fit()
            await self._publish_report()
        gc.collect()

    def _lock(self, app: str) -> asyncio.Lock:
        return self._locks.setdefault(app, asyncio.Lock())

    async def _publish_report(self) -> None:
        """This replica's hosting report, to Ray's key-value store (:mod:`cluster_records`); tried
        three times, then logged (the deployer waits on it, up to its timeout)."""
        # One at a time, each taken when its turn comes: puts from threads at once could land in
        # any order, and an older report landing last would stand until the next change.
        async with self._publishing:
            report = json.dumps(self.hosting_report()).encode()
            for attempt in range(3):
                try:
                    await asyncio.to_thread(write_report, self._replica_id, report)
                    return
                except Exception as exc:  # noqa: BLE001  # the GCS did not answer: again, shortly
                    logger.warning("could not publish the pool's report (attempt %d): %s", attempt + 1, exc)
                    await asyncio.sleep(0.5)  # a GCS that did not answer: give it a moment, three tries in all

    def _publish_resident(self) -> None:
        """The versions loaded here, for Serve's router: a handle call for one goes to a replica
        that holds it first, one for a version no replica holds to the replica holding fewest."""
        try:
            publish_multiplexed_models(self._context, sorted(self._hosted))
        except Exception as exc:  # noqa: BLE001  # Serve routes without it (to any replica)
            logger.debug("could not tell Serve which models this replica holds: %s", exc)

    async def _load(self, app: str, spec: HostedSpec, again: bool = False) -> None:
        """Load ``app`` with ``spec`` (the caller holds its lock), replacing a loaded one;
        ``again``: a version unloaded to keep within max_models, for a request (a failure fails
        the requests waiting for it, and the next request tries again)."""
        model, version, options = spec
        if not again:
            self._failures.pop(app, None)
        self._loads += 1
        try:
            hosted = await HostedModel.load(
                options["repository"], model, version, HostingOptions(**_options(options)),
                replica_key=pool_key(self._replica_key, f"{app}{POOL_KEY_SEP}{self._loads}"), app_name=app,
                deployment=self._deployment,
                server=self._server_handle,
                stats_key=pool_key(self._replica_key, app),
            )
        except Exception as exc:  # this version only: its neighbours go on serving
            reason = str(exc) or type(exc).__name__
            if again:
                logger.error("model '%s' version %d failed to load again in the pool: %s", model, version, reason)
                self._load_errors[app] = reason
                return
            logger.error("model '%s' version %d failed to load in the pool: %s", model, version, reason)
            self._specs[app] = spec
            self._failures[app] = reason
            self._evicted.discard(app)
            self._registered_at.pop(app, None)
            await _close_quietly(self._hosted.pop(app, None))
            self._publish_resident()
            return
        if again and self._specs.get(app) != spec:  # unloaded from the server (or changed) meanwhile
            await _close_quietly(hosted)
            return
        # Its figures go on from its last load's.
        hosted.core.executor.stats = self._stats.setdefault(app, hosted.core.executor.stats)
        self._load_errors.pop(app, None)
        old = self._hosted.get(app)
        self._hosted[app] = hosted
        self._specs[app] = spec
        self._evicted.discard(app)
        self._used[app] = time.time()
        self._publish_resident()
        # A reload: the new load registers its listener before the old one withdraws and drains.
        await self._register(app, hosted)
        self._retire_later(old)

    async def _unload(self, app: str) -> None:
        async with self._lock(app):
            self._registered_at.pop(app, None)
            hosted = self._hosted.pop(app, None)
            self._publish_resident()
        await self._retire(hosted)

    def _retire_later(self, hosted: HostedModel | None, report: bool = False) -> None:
        """:meth:`_retire` without waiting for it: a version's drain never holds up a load (its
        own again, or another's whose calls come over this version's connections)."""
        if hosted is not None:
            self._in_background(self._retire(hosted, report))

    async def _retire(self, hosted: HostedModel | None, report: bool = False) -> None:
        """Close a version no longer in ``_hosted``: its handle calls in flight end first (up to
        the listener's drain time), then its listener drains and the model closes (``report``:
        then its last figures, which the ``/v2`` replica keeps)."""
        if hosted is None:
            return
        try:
            deadline = time.monotonic() + _DRAIN_S
            while hosted.handle_calls and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # the calls' ends are not signalled: look again shortly, up to the deadline
            await _close_quietly(hosted)
        finally:
            if report:
                try:
                    await hosted.report()
                except Exception as exc:  # noqa: BLE001  # the /v2 app may be gone with the server
                    logger.debug("could not report the last figures of '%s': %s", hosted.app_name, exc)

    # ---- within max_models ------------------------------------------------------------------

    async def _fit(self, keep: str | None = None) -> None:
        """Unload the least recently used versions with nothing in flight while more than
        ``max_models`` are loaded (never ``keep``, the version just loaded); with every one busy,
        the report loop tries again."""
        while self._max_models and len(self._hosted) > self._max_models:
            idle = [app for app, hosted in self._hosted.items() if app != keep and not hosted.busy
                    and not self._waiting.get(app) and not self._lock(app).locked()]
            if not idle:
                return
            app = min(idle, key=lambda a: max(self._used.get(a, 0.0), self._hosted[a].last_inference_s))
            await self._evict(app)

    async def _evict(self, app: str) -> None:
        async with self._lock(app):
            hosted = self._hosted.get(app)
            if hosted is None or hosted.busy or self._waiting.get(app):  # a request came meanwhile: it stays
                return
            del self._hosted[app]
            if app in self._specs:  # (not one being unloaded from the server)
                self._evicted.add(app)
            self._registered_at.pop(app, None)
            self._publish_resident()
            logger.info("model '%s' version %s unloaded from the pool to keep within --pool-max-models %d "
                        "(it loads again on its next request)", hosted.core.name, hosted.core.version,
                        self._max_models)
        # Drained without the version's lock: a request for it meanwhile loads it again at once.
        # (Drained under it, a client's connection that this version's listener holds, carrying
        # calls for another version being unloaded the same way, would wait on that version's
        # drain, and it on this one.)
        self._retire_later(hosted, report=True)

    async def _resident(self, app: str) -> HostedModel:
        """The loaded version ``app``; one unloaded to keep within max_models is loaded again
        (the caller waits up to load_timeout_s, counted as waiting so that it is not unloaded
        again before the caller has it)."""
        hosted = self._hosted.get(app)
        if hosted is None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self._load_timeout_s
            self._waiting[app] = self._waiting.get(app, 0) + 1
            try:
                while (hosted := self._hosted.get(app)) is None:
                    spec = self._specs.get(app)
                    if spec is None or app in self._failures:
                        reason = self._failures.get(app)
                        raise UnavailableError(f"model application '{app}' is not hosted by this pool replica"
                                               + (f": {reason}" if reason else ""))
                    task = self._loading.get(app) or self._start_load_again(app)
                    try:
                        await asyncio.wait_for(asyncio.shield(task), max(deadline - loop.time(), 0.0))
                    except asyncio.TimeoutError:
                        raise UnavailableError(f"model '{spec[0]}' version {spec[1]} did not load in the model pool "
                                               f"within {self._load_timeout_s:g} s (--pool-load-timeout-secs)") from None
                    if app not in self._hosted and app in self._load_errors:
                        raise UnavailableError(f"model '{spec[0]}' version {spec[1]} could not be loaded again: "
                                               f"{self._load_errors[app]}")
            finally:
                self._waiting[app] -= 1
                if not self._waiting[app]:
                    del self._waiting[app]
        self._used[app] = time.time()
        return hosted

    def _start_load_again(self, app: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(self._load_again(app))
        self._loading[app] = task
        task.add_done_callback(lambda _, app=app: self._loading.pop(app, None))
        return task

    async def _load_again(self, app: str) -> None:
        started = time.perf_counter()
        async with self._load_limit, self._lock(app):
            spec = self._specs.get(app)
            if app in self._hosted or spec is None or app in self._failures:
                return
            await self._load(app, spec, again=True)
        if app in self._hosted:
            logger.info("model '%s' version %d loaded again in the pool in %.0f ms", spec[0], spec[1],
                        (time.perf_counter() - started) * 1000)
        # The requests waiting for it go on now; the unloads down to max_models follow.
        self._in_background(self._settle(app))

    async def _settle(self, app: str) -> None:
        try:
            await self._fit(keep=app)
            await self._publish_report()
        except Exception:  # the version is loaded: what failed is tried again by the report loop
            logger.exception("could not unload idle models after loading '%s'", app)

    def _in_background(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @contextlib.asynccontextmanager
    async def _call(self) -> AsyncIterator[HostedModel]:
        """The hosted version a handle call names (Serve's multiplexed model id), counted in
        flight while the call lasts."""
        hosted = await self._resident(serve.get_multiplexed_model_id())
        hosted.handle_calls += 1
        try:
            yield hosted
        finally:
            hosted.handle_calls -= 1

    def hosting_report(self) -> dict[str, Any]:
        """What this replica hosts: {"loaded": {application: spec digest}, "evicted": {application:
        spec digest}, "failed": {application: [spec digest, reason]}, "rpm": {application: its
        requests per minute here}, "at": Unix time}."""
        return {"loaded": {app: spec_digest(self._specs[app]) for app in self._hosted if app in self._specs},
                "evicted": {app: spec_digest(self._specs[app]) for app in self._evicted if app in self._specs},
                "failed": {app: [spec_digest(self._specs[app]), reason] for app, reason in self._failures.items()
                           if app in self._specs},
                "rpm": {app: round(rpm, 1) for app, rpm in self._rates.per_minute().items()},
                "at": time.time()}

    # ---- busy versions on several replicas (--pool-scale-up-rpm) -----------------------------

    async def _spread(self) -> None:
        """Sample this replica's request counts; with --pool-scale-up-rpm, several replicas and a
        budget (without one every replica holds every version), publish them, keep the copies
        of busy versions here used, and load the busy versions :func:`pool_spread.spread` gives
        this replica."""
        self._rates.sample({app: _requests(self._stats[app]) for app in self._hosted if app in self._stats})
        if not (self._scale_up_rpm and self._max_models and self._replicas > 1):
            return
        await self._publish_report()
        reports = await asyncio.to_thread(read_every_report)
        now = time.time()
        busy = busy_versions(reports, self._scale_up_rpm, now)
        for app in busy & set(self._hosted):
            self._used[app] = now  # the budget unloads others first
        # Room for copies: free places, and versions that are not busy (each copy unloads one).
        # A replica full of busy versions adds none (one would push out another busy one, which
        # would come back the next round).
        room = self._max_models - len(self._hosted) + sum(app not in busy for app in self._hosted)
        for app in sorted(spread(reports, self._scale_up_rpm, now).get(self._replica_id, ())):
            spec = self._specs.get(app)
            if spec is None or app in self._hosted or app in self._failures or app in self._loading:
                continue
            if room <= 0:
                break
            room -= 1
            logger.info("model '%s' version %d is busy: loading a copy of it here too (--pool-scale-up-rpm %g)",
                        spec[0], spec[1], self._scale_up_rpm)
            self._start_load_again(app)

    # ---- handle calls (the hosted version: Serve's multiplexed model id) --------------------

    def _unloaded(self, app: str) -> bool:
        """Whether ``app`` is a version this replica serves that it unloaded (it loads on its next request)."""
        return app not in self._hosted and app in self._specs and app not in self._failures

    async def grpc_forwarded(self, method: str, payload: bytes) -> bytes:
        if method == "ModelReady" and self._unloaded(serve.get_multiplexed_model_id()):
            return pb.ModelReadyResponse(ready=True).SerializeToString()  # it loads on its next request
        async with self._call() as hosted:
            return await hosted.grpc_forwarded(method, payload)

    async def http_forwarded(self, method: str, route: ModelRoute, headers: dict[bytes, bytes],
                             body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        async with self._call() as hosted:
            return await hosted.http_forwarded(method, route, headers, body)

    async def bls_infer(self, request: InferRequest) -> InferResponse:
        async with self._call() as hosted:
            return await hosted.bls_infer(request)

    async def model_ready(self) -> bool:
        if self._unloaded(serve.get_multiplexed_model_id()):
            return True
        async with self._call() as hosted:
            return await hosted.core.ready()

    async def model_config_json(self) -> str:
        async with self._call() as hosted:
            return hosted.config_json()

    async def bls_stream(self, request: InferRequest, mark_final_alone: bool = False) -> Any:
        async with self._call() as hosted, \
                contextlib.aclosing(hosted.bls_stream(request, mark_final_alone)) as messages:
            async for message in messages:  # a caller that gives up closes the model's stream at once
                yield message

    async def grpc_stream(self, payload: bytes, trace_context: str | None = None,
                          read_walls: tuple[int, int] | None = None) -> Any:
        async with self._call() as hosted, \
                contextlib.aclosing(hosted.grpc_stream(payload, trace_context, read_walls)) as messages:
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
                hosted.replica_key, app, *hosted.listener_address, hosted.routes_sequences,
                ray.get_runtime_context().current_actor,
            )
            if self._hosted.get(app) is hosted:  # not one replaced or unloaded meanwhile
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
        """Register each hosted version's listener every few seconds; push what changed; unload
        versions that were busy when max_models was passed, once they are idle."""
        while True:
            now = time.monotonic()
            for app, hosted in list(self._hosted.items()):
                if now - self._registered_at.get(app, float("-inf")) >= _LISTENER_REGISTER_INTERVAL_S:
                    await self._register(app, hosted)
            await asyncio.sleep(_STATS_PUSH_INTERVAL_S)
            for hosted in list(self._hosted.values()):
                await hosted.report()
            if time.monotonic() - self._spread_at >= _SPREAD_INTERVAL_S:
                self._spread_at = time.monotonic()
                try:
                    await self._spread()
                except Exception as exc:  # noqa: BLE001  # Ray's store did not answer: the next round tries again
                    logger.warning("could not spread busy models over the pool's replicas: %s", exc)
            if self._max_models and len(self._hosted) > self._max_models and not self._changing.locked():
                try:
                    await self._fit()
                    await self._publish_report()
                except Exception:  # noqa: BLE001  # tried again on the next round
                    logger.exception("could not unload idle models from the pool")

    async def __del__(self) -> None:
        for name in ("_report_task", "_control_task"):
            task = getattr(self, name, None)
            if task is not None:
                task.cancel()
        await asyncio.gather(*(hosted.close() for hosted in getattr(self, "_hosted", {}).values()),
                             *list(getattr(self, "_background", ())), return_exceptions=True)
        if hasattr(self, "_replica_id"):
            try:
                await asyncio.to_thread(delete_report, self._replica_id)
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


def _requests(stats: Any) -> int:
    """A version's requests answered so far (successes and failures) by its statistics."""
    return int(stats.durations["success"][0] + stats.durations["fail"][0])


def _options(values: dict[str, Any]) -> dict[str, Any]:
    """HostingOptions' fields from a spec's JSON-able values (less the repository and the load)."""
    out = {key: value for key, value in values.items() if key not in ("repository", "load")}
    out["restricted"] = tuple((kind, tuple(v)) for kind, v in dict(values.get("restricted") or {}).items())
    return out
