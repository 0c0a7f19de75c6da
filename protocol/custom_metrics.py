"""Models' own metrics (a Python model's ``pb_utils.MetricFamily``) on the metrics port.

Each replica reports its families as plain data; :func:`merge_families` sums them over replicas
(counters, gauges and histograms alike, per label set) and :class:`CustomMetricsCollector`
renders them beside Triton's ``nv_*`` families, under the names the model gave.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.metrics_core import Metric

# One family: {"name", "description", "kind": "counter" | "gauge" | "histogram", "metrics": [...]},
# each metric {"labels": {...}, "value": float} or, for a histogram, {"labels": {...},
# "buckets": [upper bounds], "counts": [observations per bucket], "sum": float, "count": int}.
Family = dict[str, Any]

# This process, in its reports: a process's families are every model's in it (Triton's rule:
# one family of a name, whichever model made it), so each process counts once.
PROCESS_KEY = uuid.uuid4().hex


def merge_families(reports: Iterable[list[Family]]) -> list[Family]:
    """The families of every report, summed per (name, label set); the first report of a name
    gives its description and kind, a later one of another kind is left out."""
    merged: dict[str, Family] = {}
    for families in reports:
        for family in families:
            target = merged.setdefault(family["name"], {**family, "metrics": {}})
            if target["kind"] != family["kind"]:
                continue
            for metric in family["metrics"]:
                key = tuple(sorted(metric["labels"].items()))
                current = target["metrics"].get(key)
                if current is None:
                    target["metrics"][key] = {k: (list(v) if isinstance(v, list) else v) for k, v in metric.items()}
                elif family["kind"] == "histogram" and current["buckets"] == metric["buckets"]:
                    current["counts"] = [a + b for a, b in zip(current["counts"], metric["counts"])]
                    current["sum"] += metric["sum"]
                    current["count"] += metric["count"]
                elif family["kind"] != "histogram":
                    current["value"] += metric["value"]
    return [{**family, "metrics": list(family["metrics"].values())} for family in merged.values()]


class CustomMetricsCollector:
    """A prometheus_client collector over merged families (counters keep the model's names)."""

    def __init__(self, families: list[Family]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            name, kind = family["name"], family["kind"]
            metric = Metric(name, family["description"], kind)
            for sample in family["metrics"]:
                labels = {str(k): str(v) for k, v in sample["labels"].items()}
                if kind != "histogram":
                    metric.add_sample(name, labels, float(sample["value"]))
                    continue
                cumulative = 0
                for bound, count in zip(sample["buckets"], sample["counts"]):
                    cumulative += count
                    metric.add_sample(f"{name}_bucket", {**labels, "le": _bound(bound)}, float(cumulative))
                metric.add_sample(f"{name}_bucket", {**labels, "le": "+Inf"}, float(sample["count"]))
                metric.add_sample(f"{name}_sum", labels, float(sample["sum"]))
                metric.add_sample(f"{name}_count", labels, float(sample["count"]))
            yield metric


def _bound(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
