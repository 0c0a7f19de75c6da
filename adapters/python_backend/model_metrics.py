"""``pb_utils.MetricFamily`` and ``Metric``: a Python model's own metrics, kept per process and
reported with the replica's statistics (see :func:`metrics_snapshot`).

Triton's rules: families are registered by name (one of the same name and kind shares the first
one's values and description; another kind is an error), a metric's labels name its value (two
metrics with the same labels share it), a histogram needs ascending buckets, a counter only
grows, and a metric whose ``MetricFamily`` object was deleted refuses every operation. A
family leaves the metrics port once every ``MetricFamily`` object of its name is deleted.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

from rayinfer.adapters.python_backend.errors import TritonModelException

_CLEARED = ("Invalid metric operation as the corresponding 'MetricFamily' has been deleted. The 'MetricFamily' "
            "object should be deleted AFTER its corresponding 'Metric' objects have been deleted.")


class _Value:
    """The value of one labelled metric (a histogram's bucket counts, sum and count)."""

    def __init__(self, labels: dict[str, str], buckets: list[float]) -> None:
        self.labels = labels
        self.value = 0.0
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def snapshot(self, histogram: bool) -> dict[str, Any]:
        if histogram:
            return {"labels": dict(self.labels), "buckets": list(self.buckets), "counts": list(self.counts),
                    "sum": self.sum, "count": self.count}
        return {"labels": dict(self.labels), "value": self.value}


class _Registered:
    """A family as the metrics port shows it: shared by the ``MetricFamily`` objects of its name."""

    def __init__(self, name: str, description: str, kind: int) -> None:
        self.name = name
        self.description = description
        self.kind = kind
        self.values: dict[tuple, _Value] = {}
        self.owners = 0


class MetricFamily:
    """A family of the model's own metrics, exported on the metrics port beside Triton's and
    summed over the model's replicas. ``kind``: COUNTER, GAUGE or HISTOGRAM."""

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2
    _KINDS = {COUNTER: "counter", GAUGE: "gauge", HISTOGRAM: "histogram"}

    def __init__(self, name: str, description: str, kind: int) -> None:
        if not isinstance(name, str) or not isinstance(description, str):
            raise TypeError("MetricFamily(): 'name' and 'description' must be str")
        if kind not in self._KINDS or isinstance(kind, bool):
            raise TritonModelException(f"Error when creating MetricFamily: unknown metric kind {kind!r}")
        global _metrics_version
        with _metrics_lock:
            registered = _families.get(name)
            if registered is not None and registered.kind != kind:
                raise TritonModelException(
                    f"Error when creating MetricFamily: a metric family named '{name}' already exists as a "
                    f"{self._KINDS[registered.kind]}, not a {self._KINDS[kind]}")
            if registered is None:
                registered = _families[name] = _Registered(name, description, kind)
                _metrics_version += 1
            registered.owners += 1
        self._registered = registered
        self._metrics: weakref.WeakSet[Metric] = weakref.WeakSet()

    @property
    def name(self) -> str:
        return self._registered.name

    @property
    def description(self) -> str:
        return self._registered.description

    @property
    def kind(self) -> int:
        return self._registered.kind

    def Metric(self, labels: dict[str, str] | None = None, buckets: Sequence[float] | None = None) -> Metric:  # noqa: N802
        if labels is None:
            labels = {}
        if not isinstance(labels, dict):
            raise TritonModelException("Labels must be a dictionary.")
        if self.kind == self.HISTOGRAM:
            if buckets is None:
                raise TritonModelException("Failed to create metric. Missing required buckets.")
            if not isinstance(buckets, (list, tuple)):
                raise TritonModelException("Buckets must be a list.")
            bounds = [float(b) for b in buckets]
            if any(a >= b for a, b in zip(bounds, bounds[1:])):
                raise TritonModelException(f"Error when creating Metric: histogram buckets must be in increasing "
                                           f"order, got {list(buckets)}")
        elif buckets is not None:
            raise TritonModelException("Unexpected buckets found.")
        else:
            bounds = []
        key = tuple(sorted((str(k), str(v)) for k, v in labels.items()))
        global _metrics_version
        with _metrics_lock:
            value = self._registered.values.get(key)
            if value is None:
                value = self._registered.values[key] = _Value(dict(key), bounds)
                _metrics_version += 1
        metric = Metric(self, value)
        self._metrics.add(metric)
        return metric

    def __del__(self) -> None:
        global _metrics_version
        if "_registered" not in self.__dict__:  # its constructor raised
            return
        registered: _Registered = self._registered
        for metric in list(self._metrics):
            metric._cleared = True
        with _metrics_lock:
            registered.owners -= 1
            if registered.owners == 0 and _families.get(registered.name) is registered:
                del _families[registered.name]
                _metrics_version += 1

    def _snapshot(self) -> dict[str, Any]:
        return _family_snapshot(self._registered)


class Metric:
    """One labelled metric of a :class:`MetricFamily` (made by ``MetricFamily.Metric``)."""

    def __init__(self, family: MetricFamily, value: _Value) -> None:
        self._cleared = False  # set when its family object is deleted (it holds no reference to it)
        self._kind = family.kind
        self._value = value

    def increment(self, value: float) -> None:
        self._check()
        if self._kind == MetricFamily.HISTOGRAM:
            raise TritonModelException("Failed to increment metric value: a histogram does not support increment")
        if self._kind == MetricFamily.COUNTER and value < 0:
            raise TritonModelException("Failed to increment metric value: a counter cannot be incremented by a "
                                       f"negative value ({value})")
        self._change(lambda: setattr(self._value, "value", self._value.value + float(value)))

    def set(self, value: float) -> None:
        self._check()
        if self._kind != MetricFamily.GAUGE:
            raise TritonModelException("Failed to set metric value: only a gauge can be set")
        self._change(lambda: setattr(self._value, "value", float(value)))

    def observe(self, value: float) -> None:
        self._check()
        if self._kind != MetricFamily.HISTOGRAM:
            raise TritonModelException("Failed to observe metric value: only a histogram can observe")
        state = self._value

        def record() -> None:
            index = next((i for i, bound in enumerate(state.buckets) if value <= bound), None)
            if index is not None:
                state.counts[index] += 1
            state.sum += value
            state.count += 1

        self._change(record)

    def value(self) -> float:
        self._check()
        if self._kind == MetricFamily.HISTOGRAM:
            raise TritonModelException("Failed to get metric value: a histogram has no single value")
        return self._value.value

    def _check(self) -> None:
        if self._cleared:
            raise TritonModelException(_CLEARED)

    @staticmethod
    def _change(update: Any) -> None:
        global _metrics_version
        with _metrics_lock:
            update()
            _metrics_version += 1


def _family_snapshot(registered: _Registered) -> dict[str, Any]:
    histogram = registered.kind == MetricFamily.HISTOGRAM
    return {"name": registered.name, "description": registered.description,
            "kind": MetricFamily._KINDS[registered.kind],
            "metrics": [v.snapshot(histogram) for v in registered.values.values()]}


_families: dict[str, _Registered] = {}
_metrics_lock = threading.Lock()
_metrics_version = 0


def metrics_snapshot() -> tuple[int, list[dict[str, Any]]]:
    """(a number that changes with every update, every family as plain data) of this process."""
    with _metrics_lock:
        return _metrics_version, [_family_snapshot(f) for f in _families.values()]
