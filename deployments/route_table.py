"""The front's route table: which replica listeners serve each model version.

Model replicas register their listener with the ``/v2`` replica when they start and every few
seconds; :class:`RouteTable` keeps them, drops those not heard from (and logs why each such
replica stopped: Ray's record of its death, or that it is alive but silent), leaves out replicas
Serve does not report RUNNING, and publishes ``<model>/<version>`` -> listeners to the front. For a
sequence model's version the listeners are one per routing slot
(:mod:`rayinfer.serving.sequence_routing`), in slot order; its replicas are told the same table
before the front is, and read it again when they register.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from collections.abc import Set as AbstractSet
from typing import Any

from rayinfer.deployments.control_channel import SEQUENCE_SLOTS, ControlChannel, ControlMessage
from rayinfer.deployments.front import route_key_is_safe
from rayinfer.deployments.names import model_apps, replica_of
from rayinfer.deployments.serve_internals import actor_death
from rayinfer.deployments.serve_state import NOT_RESIDENT, ServeState, running_replicas
from rayinfer.serving.sequence_routing import assign_slots, previous_owners

logger = logging.getLogger(__name__)

# A model replica's listener not registered again within this long is forgotten.
LISTENER_TTL_S = 6.0
# How long the table waits for a replica to take its sequence model's new slots.
_TELL_TIMEOUT_S = 1.0
# How long a replica that stopped registering has to answer Ray before it is reported silent.
_DEATH_CHECK_S = 5.0
# Of Ray's record of a replica's death, this many characters go to the log.
_DEATH_CAUSE_CHARS = 600
# Ray's words for an actor that was stopped (Serve stops a replica with ray.kill once it drained).
_STOPPED = "killed by `ray.kill`"


class RouteTable:
    """Registered listeners, and what of them the front (if any) routes to."""

    def __init__(self, state: ServeState, front: Any = None) -> None:
        self._state = state
        self._front = front  # a rayinfer.deployments.front.Front, or None
        # The registered replicas' control channel (their registration keys name them).
        self.channel = ControlChannel()
        self._lock = asyncio.Lock()
        # replica -> (application, host, port, last registered)
        self._listeners: dict[str, tuple[str, str, int, float]] = {}
        # Sequence models' applications, and each one's slots' replicas as last published,
        # and the replica each slot was taken from, while it runs.
        self._sequence_apps: set[str] = set()
        self._slots: dict[str, list[str]] = {}
        self._previous: dict[str, list[str | None]] = {}
        # The same as the replicas are told it (listeners), by application.
        self._tables: dict[str, dict[str, Any]] = {}
        self._sent: dict[str, dict[str, Any]] = {}  # the tables the replicas were last given
        # Models being unloaded (``withdrawn``): the front routes none of their versions.
        self._withdrawn: set[str] = set()
        # The registered replicas' Ray actors, asked why a replica died when it stops registering
        # without having withdrawn; and those questions while they run.
        self._actors: dict[str, Any] = {}
        self._death_checks: set[asyncio.Task] = set()
        # Replicas that withdrew, and when: a registration of theirs sent before they withdrew
        # and arriving after is dropped.
        self._gone: dict[str, float] = {}

    async def register(self, replica: str, app: str, host: str, port: int, sequences: bool = False,
                       actor: Any = None) -> None:
        """A model replica's listener, registered at start and again every few seconds
        (``sequences``: its model routes sequences by slot; ``actor``: its Ray actor)."""
        if replica in self._gone:
            return
        known = replica in self._listeners
        self._listeners[replica] = (app, host, int(port), time.monotonic())
        if actor is not None:
            self._actors[replica] = actor
        if sequences:
            self._sequence_apps.add(app)
        if not known:
            await self.publish()
            if self._front is None:  # no publication: the replicas' slots are assigned here
                self._routes(set())
                await self._tell_slots()

    def _forget_poller(self, key: str) -> None:
        """Drop the mailbox of the replica ``key`` names (a dedicated one's, which withdrew or
        died). A pool replica's is kept: it polls on while it hosts no version, and a new mailbox
        would count its messages afresh under the acknowledgements it already sent."""
        if replica_of(key) == key:
            self.channel.forget(key)

    def slot_table(self, app: str) -> dict[str, Any] | None:
        """A sequence model application's slot table as last published: ``listeners``, one per
        slot, and ``previous``, the listener of the replica each slot was taken from, or None."""
        return self._tables.get(app)

    async def _tell_slots(self) -> None:
        """Give the replicas of each sequence model whose slots moved its new table, at once
        (before the front routes by it: a replica that still gets a call by the old table sends
        it on by the new one)."""
        changed = [(app, table) for app, table in self._tables.items() if table != self._sent.get(app)]
        late = await asyncio.gather(*(self.channel.send(self.replicas(app), ControlMessage(SEQUENCE_SLOTS, {**table, "app": app}),
                                                        _TELL_TIMEOUT_S) for app, table in changed))
        for replica in (replica for replicas in late for replica in replicas):
            # It takes them when it next polls, and reads the table again when it next registers.
            logger.warning("model replica %s did not take its new sequence slots in time", replica)
        self._sent = dict(self._tables)

    async def withdraw(self, replica: str) -> None:
        """A model replica is stopping: returns once the front no longer routes to it (at once
        when its model is being unloaded: the front routes none of its versions already, and
        that unload holds the table until Serve has stopped this very replica)."""
        entry = self._listeners.pop(replica, None)
        self._actors.pop(replica, None)
        self._gone[replica] = time.monotonic()
        self._forget_poller(replica)
        if entry is not None and not any(model_apps(model, [entry[0]]) for model in self._withdrawn):
            await self.publish()

    async def publish(self) -> None:
        """Give the front the versions served now and their running replicas' listeners."""
        if self._front is None:
            return
        async with self._lock:
            await self._state.refresh()
            try:
                routes = {key: listeners for key, listeners in self._routes(await self._not_running()).items()
                          if key.split("/", 1)[0] not in self._withdrawn}  # models being unloaded
                await self._tell_slots()
                await self._front.publish(routes, frozenset(
                    key for key, (app, _) in self._state.routes.items() if key in routes and app in self._slots),
                    {model: split.front_entry() for model, split in self._state.splits.items()})
            except Exception:  # the front keeps its previous routes; the /v2 app forwards the rest
                logger.exception("could not update the front's routes")

    @contextlib.asynccontextmanager
    async def withdrawn(self, model: str) -> AsyncIterator[None]:
        """Stop routing every version of ``model`` for the duration of the block (its unload):
        publications meanwhile leave it out, so none routes it again while Serve still reports it
        running (other models' publications, and other unloads, go on); Serve is read afresh
        afterwards."""
        async with self._lock:
            self._withdrawn.add(model)
            self._state.forget_routes(model)
            if self._front is not None:
                routes = {k: v for k, v in self._front.published.items() if not k.startswith(f"{model}/")}
                try:
                    await self._front.publish(routes, self._front.sequence_keys)
                except Exception:  # the /v2 app answers what the front still routes to a removed app
                    logger.exception("could not withdraw '%s' from the front's routes", model)
        try:
            yield
        finally:
            self._withdrawn.discard(model)
            self._state.invalidate()

    async def wait_routed(self, *models: str, timeout_s: float = 15.0) -> None:
        """Wait (a little) until the front routes every served version of ``models`` (but pooled
        versions the pool holds unloaded: they have no listener until their next request)."""
        deadline = time.monotonic() + timeout_s
        while self._front is not None and time.monotonic() < deadline:
            await self.publish()
            rows = await self._state.refresh()
            unloaded = {self._state.routes.get(f"{row['name']}/{row['version']}", ("",))[0] for row in rows
                        if row.get("reason") == NOT_RESIDENT}
            wanted = {k for k, (app, *_) in self._state.routes.items()
                      if k.split("/", 1)[0] in models and app not in unloaded}
            if wanted <= set(self._front.published):
                return
            # New replicas register their listener on their own schedule: look again shortly
            # (until the deadline).
            await asyncio.sleep(0.1)

    def routes_version(self, model: str, version: str) -> bool:
        """Whether the front routes ``model``'s ``version`` to a replica (True without a front, and
        for a name the front's maps cannot hold: the ``/v2`` application routes those)."""
        key = f"{model}/{version}"
        return self._front is None or not route_key_is_safe(key) or key in self._front.published

    def listeners(self, app: str) -> list[tuple[str, int]]:
        """The listeners registered by the replicas of ``app`` (fresh ones only)."""
        now = time.monotonic()
        return sorted((host, port) for a, host, port, seen in self._listeners.values()
                      if a == app and now - seen < LISTENER_TTL_S)

    def replicas(self, app: str | None = None) -> list[str]:
        """The replicas (registration keys) of ``app``, or of every model, registered lately."""
        now = time.monotonic()
        return sorted(replica for replica, (a, _, _, seen) in self._listeners.items()
                      if (app is None or a == app) and now - seen < LISTENER_TTL_S)

    def model_replicas(self, model: str) -> list[str]:
        """The replicas of every version of ``model``, registered lately."""
        apps = model_apps(model, {entry[0] for entry in self._listeners.values()})
        return [replica for app in sorted(apps) for replica in self.replicas(app)]

    def _routes(self, not_running: AbstractSet[str]) -> dict[str, list[tuple[str, int]]]:
        """``<model>/<version>`` -> the listeners of its replicas, less those in ``not_running``
        (versions none of whose replicas is routable are left to Serve)."""
        now = time.monotonic()
        for replica in [k for k, at in self._gone.items() if now - at >= 2 * LISTENER_TTL_S]:
            del self._gone[replica]
        for replica in [k for k, v in self._listeners.items() if now - v[3] >= LISTENER_TTL_S]:
            app, host, port, _ = self._listeners.pop(replica)
            self._forget_poller(replica)
            actor = self._actors.pop(replica, None)
            if actor is not None:
                task = asyncio.get_running_loop().create_task(self._report_lost(replica, app, f"{host}:{port}", actor))
                self._death_checks.add(task)
                task.add_done_callback(self._death_checks.discard)
        by_app: dict[str, list[tuple[str, int]]] = {}
        replicas: dict[str, list[str]] = {}
        for replica, (app, host, port, _) in self._listeners.items():
            if replica not in not_running:
                by_app.setdefault(app, []).append((host, port))
                replicas.setdefault(app, []).append(replica)
        for app in list(self._slots):
            if app not in replicas:
                for table in (self._slots, self._previous, self._tables):
                    table.pop(app, None)
        for app in self._sequence_apps & set(replicas):
            before = self._slots.get(app)
            slots = self._slots[app] = assign_slots(before, replicas[app])
            previous = self._previous[app] = previous_owners(before, slots, self._previous.get(app), replicas[app])
            by_app[app] = [self._listeners[replica][1:3] for replica in slots]  # type: ignore[misc]
            self._tables[app] = {"listeners": [list(a) for a in by_app[app]],
                                 "previous": [list(self._listeners[r][1:3]) if r else None for r in previous]}
        return {key: by_app[app] if app in self._slots else sorted(by_app[app])
                for key, (app, _) in self._state.routes.items() if app in by_app}

    @staticmethod
    async def _report_lost(replica: str, app: str, listener: str, actor: Any) -> None:
        """A replica stopped registering without withdrawing: log why, as Ray recorded it (the
        calls it held failed when its connections closed; Serve starts a replacement)."""
        try:
            cause = await actor_death(actor, _DEATH_CHECK_S)
        except Exception as exc:  # noqa: BLE001  # Ray could not say: the loss is still reported
            cause = f"Ray could not say why ({exc})"
        if cause is None:
            logger.warning("model replica %s of application '%s' (listener %s) has not registered its listener "
                           "for %g s though it is alive (a blocked event loop?)", replica, app, listener, LISTENER_TTL_S)
            return
        if _STOPPED in cause:  # Serve stopped it without its withdrawal arriving (a failed health check)
            logger.warning("model replica %s of application '%s' (listener %s) was stopped by Serve before it "
                           "withdrew (a failed health check, or a stop that did not drain in time)", replica, app, listener)
            return
        if len(cause) > _DEATH_CAUSE_CHARS:
            cause = cause[:_DEATH_CAUSE_CHARS] + "..."
        logger.error("model replica %s of application '%s' (listener %s) was lost: %s", replica, app, listener, cause)

    async def _not_running(self) -> set[str]:
        """Registered replicas Serve does not report RUNNING: one being stopped serves out Serve's
        draining period and must get no new calls; one still starting gets none yet. Asked of
        Serve's controller only while some application has more registered listeners than
        running replicas (during an update, a restart or a scale-down)."""
        registered: dict[str, int] = {}
        for app, *_ in self._listeners.values():
            registered[app] = registered.get(app, 0) + 1
        running = self._state.running
        if all(count <= running.get(app, 0) for app, count in registered.items() if app in running):
            return set()
        try:
            replicas = await asyncio.to_thread(running_replicas)
        except Exception as exc:  # keep routing to every registered replica
            logger.debug("could not read the replicas' states: %s", exc)
            return set()
        return {replica for replica in self._listeners if replica_of(replica) not in replicas}
