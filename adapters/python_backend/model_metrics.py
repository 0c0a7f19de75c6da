"""``pb_utils.MetricFamily`` and ``Metric``: a Python model's own metrics, kept per process and
reported with the replica's statistics (see :func:`metrics_snapshot`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from rayinfer.adapters.python_backend.errors import TritonModelException


class MetricFamily:
    """A family of the model's own metrics, exported on the metrics port beside Triton's and
    summed over the model's replicas. ``kind``: COUNTER, GAUGE or HISTOGRAM."""

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2
    _KINDS = {COUNTER: "counter", GAUGE: "gauge", HISTOGRAM: "histogram"}

    name: str
    description: str
    kind: int

    def __init__(self, name: str, description: str, kind: int) -> None:
        if kind not in self._KINDS:
            raise TritonModelException(f"metric family '{name}': unknown kind {kind}")
        with _metrics_lock:
            existing = _families.get(name)
            if existing is not None and (existing.kind, existing.description) != (kind, description):
                raise TritonModelException(f"metric family '{name}' exists with another kind or description")
            self.name = name
            self.description = description
            self.kind = kind
            self._metrics: dict[tuple, Metric] = existing._metrics if existing is not None else {}
            _families[name] = self

    def Metric(self, labels: dict[str, str] | None = None, buckets: Sequence[float] | None = None) -> Metric:  # noqa: N802
        labels = dict(labels or {})
        if self.kind == self.HISTOGRAM and not buckets:
            raise TritonModelException(f"histogram metric of family '{self.name}' needs buckets")
        key = tuple(sorted(labels.items()))
        with _metrics_lock:
            metric = self._metrics.get(key)
            if metric is None:
                metric = self._metrics[key] = Metric(self, labels, sorted(buckets or ()))
            return metric

    def _snapshot(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "kind": self._KINDS[self.kind],
                "metrics": [m._snapshot() for m in self._metrics.values()]}


class Metric:
    """One labelled metric of a :class:`MetricFamily`."""

    def __init__(self, family: MetricFamily, labels: dict[str, str], buckets: list[float]) -> None:
        self._family = family
        self._labels = labels
        self._value = 0.0
        self._buckets = buckets
        self._counts = [0] * len(buckets)
        self._sum = 0.0
        self._count = 0

    def increment(self, value: float) -> None:
        if self._family.kind == MetricFamily.HISTOGRAM:
            raise TritonModelException("increment() is not supported for histograms")
        if self._family.kind == MetricFamily.COUNTER and value < 0:
            raise TritonModelException("a counter cannot be incremented by a negative value")
        self._change(lambda: setattr(self, "_value", self._value + value))

    def set(self, value: float) -> None:
        if self._family.kind != MetricFamily.GAUGE:
            raise TritonModelException("set() is only supported for gauges")
        self._change(lambda: setattr(self, "_value", float(value)))

    def observe(self, value: float) -> None:
        if self._family.kind != MetricFamily.HISTOGRAM:
            raise TritonModelException("observe() is only supported for histograms")

        def record() -> None:
            index = next((i for i, bound in enumerate(self._buckets) if value <= bound), None)
            if index is not None:
                self._counts[index] += 1
            self._sum += value
            self._count += 1

        self._change(record)

    def value(self) -> float:
        if self._family.kind == MetricFamily.HISTOGRAM:
            raise TritonModelException("value() is not supported for histograms")
        return self._value

    def _change(self, update: Any) -> None:
        global _metrics_version
        with _metrics_lock:
            update()
            _metrics_version += 1

    def _snapshot(self) -> dict[str, Any]:
        if self._family.kind == MetricFamily.HISTOGRAM:
            return {"labels": dict(self._labels), "buckets": list(self._buckets), "counts": list(self._counts),
                    "sum": self._sum, "count": self._count}
        return {"labels": dict(self._labels), "value": self._value}


_families: dict[str, MetricFamily] = {}
_metrics_lock = threading.Lock()
_metrics_version = 0


def metrics_snapshot() -> tuple[int, list[dict[str, Any]]]:
    """(a number that changes with every update, every family as plain data) of this process."""
    with _metrics_lock:
        return _metrics_version, [family._snapshot() for family in _families.values()]
