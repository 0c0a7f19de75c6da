"""A rollout's record (:class:`Rollout`: its versions, settings, state, weight, step and decisions),
as the ``/v2`` replica keeps it (:mod:`rayinfer.deployments.rollouts`) and saves it at each change
(:mod:`rayinfer.deployments.cluster_records`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rayinfer.repository.rollout_config import RolloutSettings
from rayinfer.serving.rollout_analysis import VersionFigures
from rayinfer.transport.router import VersionSplit

PROGRESSING, PROMOTED, ROLLED_BACK, ABORTED = "PROGRESSING", "PROMOTED", "ROLLED_BACK", "ABORTED"
STATES = (PROGRESSING, PROMOTED, ROLLED_BACK, ABORTED)
# Decisions kept per rollout (the oldest go first).
MAX_DECISIONS = 100


@dataclass
class Rollout:
    """One model's rollout: its versions, settings, where it stands and the decisions taken."""

    model: str
    stable: str
    candidate: str
    settings: RolloutSettings
    state: str = PROGRESSING
    step: int = 0
    weight: int = 0
    started_s: float = 0.0
    step_started_s: float = 0.0
    # Counts at the rollout's start (the stable version's) and at the step's (the candidate's).
    stable_start: dict[str, int] = field(default_factory=dict)
    candidate_start: dict[str, int] = field(default_factory=dict)
    stable_p99_us: float = math.nan  # the stable version's last known p99 latency
    decisions: list[dict[str, Any]] = field(default_factory=list)

    def split(self) -> VersionSplit | None:
        """The version-less requests' split, while both versions get some."""
        if self.state != PROGRESSING or not 0 < self.weight < 100:
            return None
        return VersionSplit(self.stable, self.candidate, self.weight, self.settings.sticky_header)

    def default_version(self) -> str | None:
        """Where version-less requests go when they are not split (None: the highest version)."""
        if self.state == PROMOTED:
            return None
        return self.candidate if self.state == PROGRESSING and self.weight == 100 else self.stable

    def as_dict(self) -> dict[str, Any]:
        """The rollout as the API reports it (and as it is saved)."""
        return {"model": self.model, "stable_version": self.stable, "candidate_version": self.candidate,
                "state": self.state, "step": self.step, "weight": self.weight, "started": self.started_s,
                "step_started": self.step_started_s, "settings": self.settings.as_dict(),
                "stable_start": self.stable_start, "candidate_start": self.candidate_start,
                "stable_p99_us": None if math.isnan(self.stable_p99_us) else self.stable_p99_us,
                "decisions": list(self.decisions)}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Rollout:
        settings = doc["settings"]
        return cls(doc["model"], doc["stable_version"], doc["candidate_version"],
                   RolloutSettings(**{**settings, "steps": tuple(settings["steps"])}), doc["state"], doc["step"],
                   doc["weight"], doc["started"], doc["step_started"], doc["stable_start"], doc["candidate_start"],
                   math.nan if doc.get("stable_p99_us") is None else doc["stable_p99_us"], doc["decisions"])


def counts_of(figures: VersionFigures) -> dict[str, int]:
    """A version's counts as a rollout keeps them."""
    return {"successes": figures.successes, "failures": figures.failures, "queue_ns": figures.queue_ns}


def figures_of(counts: dict[str, int]) -> VersionFigures:
    """The figures of counts a rollout kept (:func:`counts_of`)."""
    return VersionFigures(counts.get("successes", 0), counts.get("failures", 0), counts.get("queue_ns", 0))
