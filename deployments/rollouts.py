"""Rollouts: a model's new version (the candidate) served beside the one before it (the stable
version), given a rising share of the requests that name no version, judged at each step and
promoted or rolled back by the ``/v2`` replica.

A rollout starts when a load (explicit mode, or a poll) brings a new highest version of a model
whose config or load request has ``rollout_steps`` (:mod:`rayinfer.repository.rollout_config`),
or through the API (:meth:`Rollouts.start`). Its stable version is kept served beyond the
model's version policy (:attr:`~rayinfer.serving.model_control.ModelController.kept`) until the
candidate is promoted; then the policy applies again (a version it does not select is unloaded).

Every second each progressing rollout is judged (:func:`~rayinfer.serving.rollout_analysis.judge`)
on the figures the model replicas report; a failed check rolls it back at once (weight 0, the
stable version answers every version-less request), a passed step moves it to the next weight,
and the last step promotes it. Each decision is logged with its figures and kept with the
rollout (the API and ``rayinfer rollout status`` show it); the metrics port shows each rollout's
weight and state. Rollouts are saved in Ray's key-value store (the GCS) at each change: a new
``/v2`` replica takes them up where the last one left them; a new server (a new Ray cluster)
starts with none.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from prometheus_client.core import GaugeMetricFamily

from rayinfer.deployments.cluster_records import save_rollouts, saved_rollouts
from rayinfer.deployments.control_channel import ROLLOUT_SPLIT, ControlMessage
from rayinfer.deployments.rollout_store import (
    ABORTED, MAX_DECISIONS, PROGRESSING, PROMOTED, ROLLED_BACK, STATES, Rollout, counts_of, figures_of,
)
from rayinfer.protocol.errors import InvalidArgError, NotFoundError
from rayinfer.repository.rollout_config import RolloutSettings, rollout_settings, settings_from
from rayinfer.deployments.serve_state import deployed_versions
from rayinfer.repository.scanner import scan_model
from rayinfer.serving.rollout_analysis import VersionFigures, figures_since, judge, version_figures
from rayinfer.serving.shadow import ShadowCounts
from rayinfer.transport.router import VersionSplit

if TYPE_CHECKING:
    from rayinfer.deployments.v2_api import V2Api

logger = logging.getLogger(__name__)

# How often progressing rollouts are judged.
TICK_S = 1.0
# POST /v2/repository/models/<model>/rollout/<action>
ROLLOUT_ACTIONS = ("start", "promote", "abort", "weight")
# How long telling the model replicas of a new split may take (one that is late takes it later).
_TELL_TIMEOUT_S = 1.0


class Rollouts:
    """The server's rollouts (at most one per model), their routing and their judging."""

    def __init__(self, api: V2Api, server_id: str) -> None:
        self._api = api
        self._server_id = server_id
        self._rollouts: dict[str, Rollout] = {}
        # model -> the stable version's replicas' shadow counts (for its rollout's candidate)
        self._shadow: dict[str, dict[str, ShadowCounts]] = {}
        self._changes = asyncio.Lock()
        for doc in saved_rollouts(server_id):
            rollout = Rollout.from_dict(doc)
            self._rollouts[rollout.model] = rollout
        if self._rollouts:
            logger.info("rollouts taken up: %s", ", ".join(f"'{r.model}' {r.state} at {r.weight}%"
                                                          for r in self._rollouts.values()))
        self._apply()

    # ---- the API --------------------------------------------------------------------------------

    def status(self, model: str) -> dict[str, Any]:
        rollout = self._rollouts.get(model)
        if rollout is None:
            raise NotFoundError(f"model '{model}' has no rollout")
        doc = rollout.as_dict()
        if rollout.settings.shadow_percent:
            doc["shadow"] = self.shadow_counts(model).as_dict()
        if rollout.state == PROGRESSING:
            candidate, stable = self._figures(rollout, time.time())
            doc["figures"] = {"candidate": candidate.as_dict(), "stable": stable.as_dict()}
        return doc

    def all(self) -> list[dict[str, Any]]:
        return [self.status(model) for model in sorted(self._rollouts)]

    async def start(self, model: str, stable: str, candidate: str, settings: RolloutSettings, why: str) -> dict[str, Any]:
        """Start rolling ``candidate`` out beside ``stable`` (both served); replaces a rollout of
        the model that has ended (or one in progress, logged)."""
        await self._api.state.refresh()
        for version in (stable, candidate):
            if self._api.state.route(model, version) is None:
                raise InvalidArgError(f"rollout of '{model}': version {version} is not served")
        if stable == candidate:
            raise InvalidArgError(f"rollout of '{model}': the stable and candidate versions are both {stable}")
        async with self._changes:
            now = time.time()
            rollout = Rollout(model, stable, candidate, settings, weight=settings.steps[0], started_s=now,
                              step_started_s=now)
            candidate_now, stable_now = self._current(rollout, now)
            rollout.candidate_start, rollout.stable_start = counts_of(candidate_now), counts_of(stable_now)
            shadow = f" (and a copy of {settings.shadow_percent}% of version {stable}'s)" if settings.shadow_percent else ""
            self._decide(rollout, "started", f"{why}: version {candidate} gets {rollout.weight}% of the requests"
                                              f"{shadow} beside version {stable}")
            previous = self._rollouts.get(model)
            if previous is not None and previous.state == PROGRESSING:
                logger.warning("rollout of '%s': the rollout of version %s at %d%% is replaced", model,
                               previous.candidate, previous.weight)
            self._rollouts[model] = rollout
            self._shadow.pop(model, None)
            await self._publish()
        return self.status(model)

    async def promote(self, model: str) -> dict[str, Any]:
        """Promote a progressing (or rolled-back) candidate at once."""
        async with self._changes:
            rollout = self._progressing(model, (PROGRESSING, ROLLED_BACK, ABORTED))
            await self._promote(rollout, "promoted by request")
        return self.status(model)

    async def abort(self, model: str) -> dict[str, Any]:
        """Stop a progressing rollout: the stable version answers every version-less request."""
        async with self._changes:
            rollout = self._progressing(model, (PROGRESSING,))
            rollout.state, rollout.weight = ABORTED, 0
            self._decide(rollout, "aborted", "aborted by request: the stable version answers every request")
            await self._publish()
        return self.status(model)

    async def set_weight(self, model: str, weight: int) -> dict[str, Any]:
        """Give a progressing rollout's candidate ``weight`` percent (its step starts again)."""
        if not 0 <= weight <= 100:
            raise InvalidArgError(f"rollout of '{model}': weight must be between 0 and 100, got {weight}")
        async with self._changes:
            rollout = self._progressing(model, (PROGRESSING,))
            rollout.weight = weight
            self._restart_step(rollout, time.time())
            self._decide(rollout, "weight", f"weight set to {weight}% by request")
            await self._publish()
        return self.status(model)

    async def act(self, model: str, action: str, doc: dict[str, Any]) -> dict[str, Any]:
        """One of :data:`ROLLOUT_ACTIONS` by request (``doc``: the request's JSON body)."""
        if not isinstance(doc, dict):
            raise InvalidArgError("a rollout request's body must be a JSON object")
        if action == "promote":
            return await self.promote(model)
        if action == "abort":
            return await self.abort(model)
        if action == "weight":
            weight = doc.get("weight")
            if not isinstance(weight, int) or isinstance(weight, bool):
                raise InvalidArgError(f"rollout of '{model}': 'weight' must be a whole number of percent")
            return await self.set_weight(model, weight)
        await self._api.state.refresh()
        served = self._api.state.served_versions(model)
        if not served:
            raise NotFoundError(f"model '{model}' is not served")
        parameters = doc.get("parameters") or {}
        if not isinstance(parameters, dict):
            raise InvalidArgError("'parameters' of a rollout request must be a JSON object")
        candidate = str(doc.get("candidate_version") or served[-1])
        below = [v for v in served if int(v) < int(candidate)] if candidate.isdigit() else []
        stable = str(doc.get("stable_version") or (below[-1] if below else ""))
        if not stable:
            raise InvalidArgError(f"rollout of '{model}': no version is served below version {candidate}: "
                                  f"name 'stable_version'")
        given = {str(k): v for k, v in parameters.items()}
        if self._settings(model, {}) is None:  # the config has none: the default steps
            given.setdefault("rollout_steps", ",".join(str(s) for s in RolloutSettings().steps))
        settings = self._settings(model, given) or RolloutSettings()
        return await self.start(model, stable, candidate, settings, "started by request")

    def _progressing(self, model: str, states: tuple[str, ...]) -> Rollout:
        rollout = self._rollouts.get(model)
        if rollout is None:
            raise NotFoundError(f"model '{model}' has no rollout")
        if rollout.state not in states:
            raise InvalidArgError(f"rollout of '{model}' is {rollout.state}")
        return rollout

    # ---- loads ----------------------------------------------------------------------------------

    async def load(self, model: str, parameters: dict[str, Any]) -> None:
        """Load ``model`` (model control's load); a new highest version of a model with rollout
        settings starts a rollout beside the version served before it."""
        controller, state = self._api.controller, self._api.state
        settings = self._settings(model, parameters)
        # What Serve runs, not what the repository's new files would give (in poll mode the
        # default application may still run the version before the new folder).
        before = await asyncio.to_thread(deployed_versions, model) if settings is not None else []
        current = self._rollouts.get(model)
        if settings is not None and before:
            stable = int(current.stable) if current is not None and current.state != PROMOTED else max(before)
            controller.kept[model] = stable
        try:
            await asyncio.to_thread(controller.load, model, parameters)
        finally:
            state.invalidate()
        entry = controller.scan(model, parameters.get("config"))
        latest = max(entry.versions) if entry.versions else None
        stable_kept = controller.kept.get(model)
        if settings is not None and stable_kept is not None and latest is not None and latest > stable_kept \
                and (current is None or current.candidate != str(latest) or current.state != PROGRESSING):
            await self._api.routes.wait_routed(model)
            await self.start(model, str(stable_kept), str(latest), settings, f"version {latest} loaded")
        elif current is None or current.state == PROMOTED:
            controller.kept.pop(model, None)

    def _settings(self, model: str, parameters: dict[str, Any]) -> RolloutSettings | None:
        """The load request's rollout settings on top of the model config's."""
        entry = scan_model(self._api.controller.repository / model, parameters.get("config"))
        from_config = rollout_settings(entry.config.parameters, model) if entry.config is not None else None
        given = {k[len("rollout_"):]: str(v) for k, v in parameters.items() if k.startswith("rollout_")}
        if not given:
            return from_config
        if from_config is None and "steps" not in given:
            raise InvalidArgError(f"model '{model}': the rollout parameters need 'rollout_steps' (e.g. '10,50,100')")
        return settings_from(given, model, from_config)

    def forget(self, model: str) -> None:
        """The model was unloaded: its rollout ends with it."""
        self._shadow.pop(model, None)
        if self._rollouts.pop(model, None) is not None:
            logger.info("model '%s' was unloaded: its rollout ends", model)
            self._apply()
            save_rollouts(self._server_id, [r.as_dict() for r in self._rollouts.values()])

    # ---- judging --------------------------------------------------------------------------------

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                async with self._changes:
                    await self.tick()
            except Exception:  # one bad tick must not end the judging
                logger.exception("could not judge the rollouts")

    async def tick(self) -> None:
        """Judge each progressing rollout once."""
        now = time.time()
        for rollout in [r for r in self._rollouts.values() if r.state == PROGRESSING]:
            candidate, stable = self._figures(rollout, now)
            shadow = self.shadow_counts(rollout.model) if rollout.settings.shadow_percent else None
            verdict = judge(candidate, stable, rollout.settings, now - rollout.step_started_s, shadow)
            figures = {"candidate": candidate.as_dict(), "stable": stable.as_dict(),
                       **({"shadow": shadow.as_dict()} if shadow is not None else {})}
            if verdict.passed is False:
                rollout.state, rollout.weight = ROLLED_BACK, 0
                self._decide(rollout, "rolled_back", f"step {rollout.step + 1} failed: {verdict.reason}", figures,
                             level=logging.WARNING)
                await self._publish()
            elif verdict.passed and rollout.settings.automatic:
                await self._next_step(rollout, verdict.reason, figures, now)

    async def _next_step(self, rollout: Rollout, reason: str, figures: dict[str, Any], now: float) -> None:
        steps = rollout.settings.steps
        if rollout.weight >= 100 or rollout.step + 1 >= len(steps):
            await self._promote(rollout, f"step {rollout.step + 1} passed: {reason}", figures)
            return
        rollout.step += 1
        rollout.weight = steps[rollout.step]
        self._restart_step(rollout, now)
        self._decide(rollout, "step", f"step {rollout.step} passed: {reason}; version {rollout.candidate} now gets "
                                      f"{rollout.weight}%", figures)
        await self._publish()

    async def _promote(self, rollout: Rollout, reason: str, figures: dict[str, Any] | None = None) -> None:
        rollout.state, rollout.weight = PROMOTED, 100
        self._decide(rollout, "promoted", f"{reason}; version {rollout.candidate} answers every request", figures)
        await self._publish()
        # The stable version is no longer kept: the version policy says whether it stays.
        removed = await asyncio.to_thread(self._api.controller.release_kept, rollout.model)
        if removed is not None:
            logger.info("rollout of '%s': version %s unloaded (its version policy does not select it)",
                        rollout.model, removed)
            self._api.state.invalidate()

    def _figures(self, rollout: Rollout, now: float) -> tuple[VersionFigures, VersionFigures]:
        """The candidate's figures over the step and the stable version's over the rollout (with
        its last known p99)."""
        candidate_now, stable_now = self._current(rollout, now)
        if not math.isnan(stable_now.p99_us):
            rollout.stable_p99_us = stable_now.p99_us
        stable = figures_since(stable_now, figures_of(rollout.stable_start))
        return (figures_since(candidate_now, figures_of(rollout.candidate_start)),
                replace(stable, p99_us=rollout.stable_p99_us))

    def _current(self, rollout: Rollout, now: float) -> tuple[VersionFigures, VersionFigures]:
        merged = self._api.statistics.merged
        return (version_figures(merged(rollout.model, rollout.candidate), now),
                version_figures(merged(rollout.model, rollout.stable), now))

    def _restart_step(self, rollout: Rollout, now: float) -> None:
        rollout.step_started_s = now
        rollout.candidate_start = counts_of(self._current(rollout, now)[0])

    def _decide(self, rollout: Rollout, action: str, reason: str, figures: dict[str, Any] | None = None,
                level: int = logging.INFO) -> None:
        """Keep and log one decision, with the figures it was made on."""
        decision = {"time": time.time(), "action": action, "weight": rollout.weight, "reason": reason}
        if figures is not None:
            decision["figures"] = figures
        rollout.decisions = [*rollout.decisions, decision][-MAX_DECISIONS:]
        logger.log(level, "rollout of '%s' (version %s beside %s): %s%s", rollout.model, rollout.candidate,
                   rollout.stable, reason, f"; figures: {json.dumps(figures)}" if figures else "")

    # ---- routing and keeping ----------------------------------------------------------------------

    def _apply(self) -> None:
        """Give Serve's state the rollouts' default versions and splits, and model control the
        stable versions to keep."""
        state, controller = self._api.state, self._api.controller
        changed = set(state.default_versions) | set(self._rollouts)
        state.default_versions = {m: v for m, r in self._rollouts.items() if (v := r.default_version()) is not None}
        state.splits = {m: s for m, r in self._rollouts.items() if (s := r.split()) is not None}
        for model, rollout in self._rollouts.items():
            if rollout.state != PROMOTED:
                controller.kept[model] = int(rollout.stable)
        state.apply_defaults(changed)  # at once: a rollback must not wait for a read of Serve

    async def _publish(self) -> None:
        """Route by the rollouts as they are now, on every front and in the model replicas that
        hold clients' connections (told at once, as the fronts are); save them."""
        self._apply()
        save_rollouts(self._server_id, [r.as_dict() for r in self._rollouts.values()])
        await asyncio.gather(self._api.routes.publish(), *(self._tell_split(model) for model in list(self._rollouts)))

    def split_message(self, model: str) -> dict[str, Any]:
        """What the replicas of ``model``'s stable and candidate versions follow on the
        connections they hold: the split, and whether each answers version-less requests."""
        rollout = self._rollouts[model]
        return {"model": model, "split": self.split_of(model, rollout.stable),
                "version_less": {v: self.routes_version_less(model, v) for v in (rollout.stable, rollout.candidate)}}

    async def _tell_split(self, model: str) -> None:
        routes = self._api.routes
        late = await routes.channel.send(routes.model_replicas(model), ControlMessage(ROLLOUT_SPLIT, self.split_message(model)),
                                         _TELL_TIMEOUT_S)
        for replica in late:  # it takes the split when it next polls, or registers
            logger.warning("model replica %s did not take the rollout's split of %s in time", replica, model)

    def shadow_target(self, model: str, version: str) -> dict[str, Any] | None:
        """Where a replica of ``model`` at ``version`` sends its shadow requests: the candidate,
        when the replica serves the stable version of a progressing rollout with shadow traffic."""
        rollout = self._rollouts.get(model)
        if rollout is None or rollout.state != PROGRESSING or not rollout.settings.shadow_percent \
                or version != rollout.stable or rollout.weight >= 100:
            return None
        route = self._api.state.routes.get(f"{model}/{rollout.candidate}")
        if route is None:
            return None
        return {"candidate": rollout.candidate, "app": route[0], "deployment": route[1],
                "percent": rollout.settings.shadow_percent, "tolerance": rollout.settings.shadow_tolerance}

    def report_shadow(self, replica: str, model: str, candidate: str, counts: dict[str, int]) -> None:
        rollout = self._rollouts.get(model)
        if rollout is not None and rollout.candidate == candidate and rollout.state == PROGRESSING:
            self._shadow.setdefault(model, {})[replica] = ShadowCounts(**counts)

    def shadow_counts(self, model: str) -> ShadowCounts:
        """The rollout's shadow counts, over the stable version's replicas."""
        total = ShadowCounts()
        for counts in self._shadow.get(model, {}).values():
            total.add(counts)
        return total

    def split_for(self, model: str) -> VersionSplit | None:
        rollout = self._rollouts.get(model)
        return rollout.split() if rollout is not None else None

    def routes_version_less(self, model: str, version: str) -> bool:
        """Whether a replica of ``model`` at ``version`` may answer version-less requests on the
        connections it holds (else it relays them to the front, which splits them)."""
        rollout = self._rollouts.get(model)
        if rollout is None:
            return True
        if rollout.state == PROMOTED:  # the highest version's, as without a rollout
            return version != rollout.stable
        return rollout.split() is None and rollout.default_version() == version

    def split_of(self, model: str, version: str) -> dict[str, Any] | None:
        """The split a replica of ``model`` at ``version`` takes part in (the fields of its
        :class:`VersionSplit`), or None: it answers the version-less requests the acceptor places
        on it by their turns (:class:`~rayinfer.transport.router.ConnectionTurn`)."""
        split = self.split_for(model)
        return asdict(split) if split is not None and version in (split.stable, split.candidate) else None

    # ---- metrics ------------------------------------------------------------------------------------

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """The rollouts' gauges for the metrics port (a prometheus_client collector)."""
        weight = GaugeMetricFamily("rayinfer_rollout_weight", "Percent of a model's version-less requests its "
                                   "rollout's candidate version gets", labels=["model", "stable_version", "candidate_version"])
        state = GaugeMetricFamily("rayinfer_rollout_state", "A model's rollout state (1: the state it is in)",
                                  labels=["model", "state"])
        for model, rollout in sorted(self._rollouts.items()):
            weight.add_metric([model, rollout.stable, rollout.candidate], rollout.weight)
            for name in STATES:
                state.add_metric([model, name], 1.0 if rollout.state == name else 0.0)
        agreement = GaugeMetricFamily("rayinfer_rollout_shadow_agreement", "Share of a rollout's shadow requests "
                                      "whose candidate answer agreed with the stable version's", labels=["model"])
        for model, rollout in sorted(self._rollouts.items()):
            shadow = self.shadow_counts(model)
            if rollout.settings.shadow_percent and shadow.compared:
                agreement.add_metric([model], shadow.agreed / shadow.compared)
        yield from (weight, state, agreement)

