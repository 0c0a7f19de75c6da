"""What a model replica (:class:`~rayinfer.deployments.model.ModelDeployment`) tells the ``/v2``
replica and hears from it.

Every :data:`_LISTENER_REGISTER_INTERVAL_S` the replica registers its listener, and the answer
carries the server's current settings for it: the in-flight bound, the connection limits, a
rollout's split and shadow traffic, a sequence model's routing slots, the logging and trace
settings. Every :data:`_STATS_PUSH_INTERVAL_S` it pushes its statistics when they changed (and an
in-place ensemble member's, as one more replica of that member), its finished traces and its
shadow counts. Changes that cannot wait for the next registration come on the control channel
(:mod:`control_channel`), which the replica polls. A request that names a shared memory region
this replica has not mapped asks for its registration. Each of these calls fails quietly while
the ``/v2`` app is absent or restarting, and is made again on the next round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray import serve

from rayinfer.deployments.control_channel import (
    ROLLOUT_SPLIT,
    SEQUENCE_SLOTS,
    SHM_FORGET,
    TRACE_SETTINGS,
    ControlMessage,
)
from rayinfer.deployments.names import SERVER_APP, SERVER_DEPLOYMENT
from rayinfer.deployments.shadow_sender import ShadowSender
from rayinfer.protocol import log_settings
from rayinfer.protocol.errors import UnavailableError
from rayinfer.protocol.limits import ConnectionLimits
from rayinfer.protocol.shared_memory import Registration
from rayinfer.serving.model_core import ModelCore
from rayinfer.serving.replica_listener import ReplicaListener
from rayinfer.serving.replica_routes import ReplicaRoutes
from rayinfer.serving.sequence_routing import SequenceRoutes
from rayinfer.serving.trace import TraceSettings

logger = logging.getLogger("rayinfer.deployments.model")

# The replica's statistics are pushed (when they changed) this often.
_STATS_PUSH_INTERVAL_S = 0.5
# The replica's listener is registered with the ``/v2`` replica this often (which forgets
# a listener not registered again within a few intervals: a replica that died).
_LISTENER_REGISTER_INTERVAL_S = 2.0
# How long a replica waits for the /v2 replica to tell it a shared memory region's registration.
_SHM_FETCH_S = 10.0


class ServerLink:
    """The ``/v2`` replica's side of a model replica, a part of ``ModelDeployment`` (its state
    is set in ``ModelDeployment.__init__``)."""

    _core: ModelCore
    _listener: ReplicaListener
    _routes: ReplicaRoutes
    _sequences: SequenceRoutes | None
    _shadow: ShadowSender
    _shadow_reported: dict[str, int]
    _members: Any  # an ensemble's EnsembleMembers, or None
    _server: Any  # the handle to the /v2 app, once made
    _pushed: dict[str, tuple[int, ...]]  # the statistics last pushed, by the key they were reported under
    _replica_key: str
    _app_name: str
    _listener_address: tuple[str, int]

    def _server_handle(self) -> Any:
        """One handle to the ``/v2`` app for the replica's life: each new handle builds a router."""
        if self._server is None:
            self._server = serve.get_deployment_handle(SERVER_DEPLOYMENT, SERVER_APP)
        return self._server

    def _trace_settings(self, doc: dict[str, Any]) -> None:
        """The trace extension's settings from the ``/v2`` replica: this model's apply."""
        settings = TraceSettings.from_dict(doc)
        self._core.tracer.configure(settings.of(self._core.name), settings.version, settings.opentelemetry)

    def _take_control(self, message: ControlMessage) -> None:
        """A change the ``/v2`` replica sent on the control channel."""
        if message.kind == TRACE_SETTINGS:
            self._trace_settings(message.body)
        elif message.kind == SHM_FORGET:  # a region unregistered (every one of its kind for "")
            self._core.shm.unregister(message.body["name"], message.body["kind"])
        elif message.kind == SEQUENCE_SLOTS and self._sequences is not None:
            self._sequences.update(message.body)
        elif message.kind == ROLLOUT_SPLIT and message.body["model"] == self._core.name:
            # A rollout of this model changed (Rollouts.split_message): its stable and candidate
            # versions' parts in it.
            if self._core.version in message.body["version_less"]:
                self._routes.take_split(message.body["version_less"][self._core.version], message.body["split"])

    async def _poll_control_forever(self) -> None:
        """Take the ``/v2`` replica's changes as they come (:mod:`control_channel`)."""
        epoch, acked = None, 0
        while True:
            try:
                answer_epoch, messages = await self._server_handle().control_poll.remote(self._replica_key, epoch, acked)
            except Exception as exc:  # the server app may not be deployed (yet), or restarts
                logger.debug("could not poll the control channel: %s", exc)
                # Tried again as registration is: what was missed meanwhile comes with it.
                await asyncio.sleep(_LISTENER_REGISTER_INTERVAL_S)
                continue
            if answer_epoch != epoch:
                epoch, acked = answer_epoch, 0
            for seq, message in messages:
                try:
                    self._take_control(message)
                except Exception:
                    logger.exception("could not take the server's %s", message.kind)
                acked = max(acked, seq)

    async def _shared_memory_region(self, name: str) -> Registration | None:
        """A shared memory region a request names that this replica has not mapped:
        its registration with the ``/v2`` replica (None if there is none)."""
        try:
            return await asyncio.wait_for(self._server_handle().shared_memory_region.remote(name), _SHM_FETCH_S)
        except asyncio.TimeoutError:
            raise UnavailableError(f"shared memory region '{name}': the server did not answer in time") from None

    async def _merged_statistics(self, version: str, snapshot: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """Report this replica's figures and read back every replica's sum (one Ray call);
        this replica's own figures when the ``/v2`` app is absent (a hand-written Serve config)."""
        try:
            merged = await self._server_handle().report_statistics.remote(
                self._replica_key, self._core.name, self._core.version, snapshot, version
            )
            self._pushed[self._replica_key] = _change_key(snapshot)
            return merged
        except Exception as exc:
            logger.debug("falling back to this replica's statistics: %s", exc)
            return []

    async def _report_forever(self) -> None:
        """Register the listener every few seconds; push statistics when they changed."""
        registered_at = float("-inf")
        limit_values: Any = None
        while True:
            if time.monotonic() - registered_at >= _LISTENER_REGISTER_INTERVAL_S:
                try:
                    settings = await self._server_handle().register_listener.remote(
                        self._replica_key, self._app_name, *self._listener_address, self._sequences is not None
                    )
                    registered_at = time.monotonic()
                    self._listener.max_inflight = settings.get("max_inflight", self._listener.max_inflight)
                    self._routes.take_split(settings.get("version_less", True), settings.get("split"))
                    shadowing = self._shadow.configure(settings.get("shadow"))
                    self._core.on_answer = self._shadow.offer if shadowing and not self._core.decoupled else None
                    if settings.get("connection_limits") != limit_values:  # the flags, as at the last registration
                        limit_values = settings.get("connection_limits")
                        self._listener.limits = ConnectionLimits.from_values(limit_values)
                    if self._sequences is not None:
                        self._sequences.update(settings.get("sequence_slots"))
                    # The logging extension's (again: loggers created since get them too).
                    log_settings.apply(settings["log"])
                    self._trace_settings(settings["trace"])
                except Exception as exc:  # the server app may not be deployed (yet)
                    logger.debug("could not register the listener: %s", exc)
            await asyncio.sleep(_STATS_PUSH_INTERVAL_S)
            await self._report_shadow()
            for key, core in self._reported_cores():
                traces = core.tracer.collect()  # an in-place member's: its steps' child traces
                if traces:
                    try:
                        await self._server_handle().report_traces.remote(core.name, traces)
                    except Exception as exc:  # the server app may be gone: those traces are lost
                        logger.debug("could not report traces: %s", exc)
                snapshot = core.snapshot()
                if _change_key(snapshot) == self._pushed.get(key):
                    continue
                try:
                    await self._server_handle().report_statistics.remote(key, core.name, core.version, snapshot)
                    self._pushed[key] = _change_key(snapshot)
                except Exception as exc:  # the server app may not be deployed (yet)
                    logger.debug("could not publish statistics: %s", exc)

    async def _report_shadow(self) -> None:
        """The shadow counts, when they changed."""
        target, counts = self._shadow.target, self._shadow.counts.as_dict()
        if target is None or counts == self._shadow_reported:
            return
        try:
            await self._server_handle().report_shadow.remote(self._replica_key, self._core.name, target["candidate"], counts)
            self._shadow_reported = counts
        except Exception as exc:  # the server app may be gone: the counts go with the next report
            logger.debug("could not report shadow counts: %s", exc)

    def _reported_cores(self) -> list[tuple[str, ModelCore]]:
        """(key, core) of the model served here and of an ensemble's members running here,
        whose figures count as those of one more replica of the member."""
        cores = [(self._replica_key, self._core)]
        if self._members is not None and self._members.in_place is not None:
            cores += [(f"{self._replica_key}/in-place/{core.name}", core) for core in self._members.in_place.cores()]
        return cores


def _change_key(snapshot: dict[str, Any]) -> tuple[int, ...]:
    durations = snapshot["durations"]  # successes count the response cache's hits, which execute nothing
    return (snapshot["execution_count"], durations["success"][0], durations["fail"][0],
            snapshot["pending_request_count"], snapshot.get("custom_metrics_version", 0))
