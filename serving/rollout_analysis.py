"""Judging a rollout's candidate against its stable version, on the figures the server holds.

Each model version's statistics (summed over its replicas, :mod:`rayinfer.protocol.statistics`)
give cumulative request counts and durations and the latency summaries' last minute. A step's
figures are the difference between the counts now and at the step's start
(:func:`figures_since`); :func:`judge` compares the candidate's with the stable version's:

- failure rate: the candidate's share of failed requests over the step may exceed the stable
  version's (over the whole rollout, which has more requests) by ``max_failure_rate``;
- latency: the candidate's p99 request latency (the last minute) may be ``max_latency_ratio``
  times the stable version's, plus ``latency_slack_ms``; judged once the candidate has answered
  :data:`LATENCY_MIN_REQUESTS` in the step (the p99 of fewer is their slowest one);
- queue time: the candidate's mean over the step may be ``max_queue_ratio`` times the stable
  version's, plus the same slack;
- shadow agreement (with ``shadow_percent``): the share of shadow requests over the rollout whose
  answers agreed (:mod:`rayinfer.serving.shadow`) must be at least ``min_agreement``, judged once
  ``step_requests`` were compared. A shadow-only step (weight 0) counts the shadow requests as
  the candidate's.

A check is judged once the candidate has answered ``step_requests`` requests in the step; the
step passes once every check passes and ``step_seconds`` have gone by. A step fails as soon as
one check fails.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from rayinfer.protocol.latency_summary import quantiles
from rayinfer.repository.rollout_config import RolloutSettings
from rayinfer.serving.shadow import ShadowCounts

# Successful requests of the candidate in a step before its p99 latency is judged.
LATENCY_MIN_REQUESTS = 100


@dataclass(frozen=True, slots=True)
class VersionFigures:
    """One version's counts (cumulative, or over a step), and its p99 request latency over the
    last minute (NaN when it answered none)."""

    successes: int = 0
    failures: int = 0
    queue_ns: int = 0
    p99_us: float = math.nan

    @property
    def requests(self) -> int:
        return self.successes + self.failures

    @property
    def failure_rate(self) -> float:
        return self.failures / self.requests if self.requests else 0.0

    @property
    def queue_ms(self) -> float:
        return self.queue_ns / self.successes / 1e6 if self.successes else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(requests=self.requests, failure_rate=round(self.failure_rate, 4), queue_ms=round(self.queue_ms, 3))
        out["p99_ms"] = None if math.isnan(self.p99_us) else round(self.p99_us / 1000, 3)
        del out["p99_us"]
        return out

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> VersionFigures:
        p99 = doc.get("p99_ms")
        return cls(int(doc.get("successes", 0)), int(doc.get("failures", 0)), int(doc.get("queue_ns", 0)),
                   math.nan if p99 is None else float(p99) * 1000)


def version_figures(snapshot: dict[str, Any], now_s: float) -> VersionFigures:
    """A version's cumulative figures from its merged statistics snapshot."""
    durations = snapshot.get("durations", {})
    summary = snapshot.get("summaries", {}).get("request")
    p99 = quantiles(summary, (0.99,), now_s)[0.99] if summary else math.nan
    return VersionFigures(int(durations.get("success", (0, 0))[0]), int(durations.get("fail", (0, 0))[0]),
                          int(durations.get("queue", (0, 0))[1]), p99)


def figures_since(now: VersionFigures, start: VersionFigures) -> VersionFigures:
    """The counts between ``start`` and ``now`` (a replica that restarted counts from zero: never
    below zero), with ``now``'s p99."""
    return VersionFigures(max(0, now.successes - start.successes), max(0, now.failures - start.failures),
                          max(0, now.queue_ns - start.queue_ns), now.p99_us)


@dataclass(frozen=True, slots=True)
class Verdict:
    """``passed``: True (the step may end), False (roll back), None (not judged yet);
    ``reason``: why, with the figures that decided."""

    passed: bool | None
    reason: str


def shadow_verdict(shadow: ShadowCounts, settings: RolloutSettings) -> Verdict | None:
    """A failed verdict when too few shadow answers agreed (None: agreement holds, or too few
    were compared yet)."""
    labels = settings.shadow_compare == "labels"
    compared, agreed = (shadow.labelled, shadow.labels_agreed) if labels else (shadow.compared, shadow.agreed)
    if not settings.shadow_percent or compared < max(1, settings.step_requests):
        return None
    if agreed / compared >= settings.min_agreement:
        return None
    what = "labels" if labels else "answers"
    return Verdict(False, f"shadow {what} agreed {agreed / compared:.1%} of the time ({agreed} of {compared}), "
                          f"under {settings.min_agreement:.1%}")


def judge(candidate: VersionFigures, stable: VersionFigures, settings: RolloutSettings,
          step_elapsed_s: float, shadow: ShadowCounts | None = None) -> Verdict:
    """The verdict on a step (``candidate``: its figures over the step; ``stable``: over the
    rollout, with its last known p99; ``shadow``: the rollout's shadow requests)."""
    failed = shadow_verdict(shadow, settings) if shadow is not None else None
    if failed is not None:
        return failed
    if candidate.requests < max(1, settings.step_requests):
        return Verdict(None, f"waiting for requests: the candidate answered {candidate.requests} of the "
                             f"{settings.step_requests} this step needs")
    allowed = stable.failure_rate + settings.max_failure_rate
    if candidate.failure_rate > allowed:
        return Verdict(False, f"failure rate {candidate.failure_rate:.1%} ({candidate.failures} of {candidate.requests}) "
                              f"is over {allowed:.1%} (stable {stable.failure_rate:.1%} + {settings.max_failure_rate:.1%})")
    slack_us = settings.latency_slack_ms * 1000
    if candidate.successes >= LATENCY_MIN_REQUESTS and not math.isnan(candidate.p99_us) and not math.isnan(stable.p99_us):
        limit = stable.p99_us * settings.max_latency_ratio + slack_us
        if candidate.p99_us > limit:
            return Verdict(False, f"p99 latency {candidate.p99_us / 1000:.2f} ms is over {limit / 1000:.2f} ms "
                                  f"(stable {stable.p99_us / 1000:.2f} ms x {settings.max_latency_ratio:g} "
                                  f"+ {settings.latency_slack_ms:g} ms)")
    if candidate.successes and stable.successes:
        limit_ms = stable.queue_ms * settings.max_queue_ratio + settings.latency_slack_ms
        if candidate.queue_ms > limit_ms:
            return Verdict(False, f"mean queue time {candidate.queue_ms:.2f} ms is over {limit_ms:.2f} ms "
                                  f"(stable {stable.queue_ms:.2f} ms x {settings.max_queue_ratio:g} "
                                  f"+ {settings.latency_slack_ms:g} ms)")
    if step_elapsed_s < settings.step_seconds:
        return Verdict(None, f"every check passes; the step lasts {settings.step_seconds:g} s "
                             f"({step_elapsed_s:.0f} s so far)")
    return Verdict(True, f"every check passed over {candidate.requests} requests and {step_elapsed_s:.0f} s")
