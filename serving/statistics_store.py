"""The statistics every model replica reports, held in one place (the ``/v2`` replica).

Replicas report cumulative snapshots; a version's figures are the sum over its replicas, so the
statistics extension and the metrics port read the same numbers.
"""

from __future__ import annotations

from typing import Any

from rayinfer.protocol.custom_metrics import Family, merge_families
from rayinfer.protocol.statistics import merge_snapshots


class StatisticsStore:
    """The latest snapshot of each replica, per (model, version)."""

    def __init__(self) -> None:
        self._snapshots: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}

    def report(self, replica: str, model: str, version: str, snapshot: dict[str, Any]) -> None:
        self._snapshots.setdefault((model, version), {})[replica] = snapshot

    def merged(self, model: str, version: str) -> dict[str, Any]:
        """The version's figures summed over its replicas (zeros when none reported)."""
        return merge_snapshots(list(self._snapshots.get((model, version), {}).values()))

    def pending(self, model: str, version: str) -> int:
        """Requests waiting for execution in every replica of the version."""
        return sum(s.get("pending_request_count", 0) for s in self._snapshots.get((model, version), {}).values())

    def custom_metrics(self) -> list[Family]:
        """Every model's own metric families, summed over processes. A process's families are
        all its models' (a pool replica holds many Python models, and reports them with each):
        each process counts once, by its newest report."""
        newest: dict[str, tuple[int, list[Family]]] = {}
        for replicas in self._snapshots.values():
            for key, snapshot in replicas.items():
                families = snapshot.get("custom_metrics")
                if families is None:  # not a model with families of its own
                    continue
                # The newest report of a process counts, even an empty one (its families deleted).
                process = snapshot.get("custom_metrics_process") or key
                version = snapshot.get("custom_metrics_version", 0)
                if process not in newest or version > newest[process][0]:
                    newest[process] = (version, families)
        return merge_families(families for _, families in newest.values())

    def forget(self, model: str) -> None:
        """Drop every version of an unloaded model."""
        for key in [k for k in self._snapshots if k[0] == model]:
            del self._snapshots[key]
