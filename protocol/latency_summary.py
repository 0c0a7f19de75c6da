"""Latency summaries with quantiles (Triton's ``--metrics-config summary_latencies=true``),
kept so that the figures of several replicas add up.

Each replica counts its requests' durations in log-spaced buckets (each 2% wider than the one
before, so a quantile is within about 1% of the true value) per window of ``max_age_s /
age_buckets`` seconds of wall-clock time, keeping the last ``age_buckets`` windows: a quantile
covers the requests of about the last ``max_age_s`` seconds, as Triton's summaries
(prometheus-cpp's ``max_age`` of 60 s in 5 ``age_buckets``) do. Windows start at multiples of
their length, so the windows of different replicas line up and merge by adding counts. Count and
sum are cumulative, as a Prometheus summary's are.
"""

from __future__ import annotations

import math
from typing import Any

RATIO = 1.02
MAX_AGE_S = 60.0
AGE_BUCKETS = 5
WINDOW_S = MAX_AGE_S / AGE_BUCKETS
_PER_LOG_RATIO = 1.0 / math.log(RATIO)
_PER_WINDOW = 1.0 / WINDOW_S
_log = math.log


class LatencySummary:
    """Durations of one kind (request, queue, ...) of one model version in one replica."""

    __slots__ = ("count", "sum_us", "_windows", "_window", "_counts")

    def __init__(self) -> None:
        self.count = 0
        self.sum_us = 0.0
        self._windows: dict[int, dict[int, int]] = {}
        self._window = -1  # the window being counted, and its counts
        self._counts: dict[int, int] = {}

    def record(self, us: float, now_s: float, times: int = 1) -> None:
        """``times`` durations of ``us`` microseconds, ending at ``now_s`` (wall clock)."""
        window = int(now_s * _PER_WINDOW)
        if window != self._window:
            self._start(window)
        index = int(_log(us) * _PER_LOG_RATIO) + 1 if us >= 1.0 else 0
        counts = self._counts
        counts[index] = counts.get(index, 0) + times
        self.count += times
        self.sum_us += us * times

    def _start(self, window: int) -> None:
        self._window = window
        self._counts = self._windows.setdefault(window, {})
        for old in [w for w in self._windows if w <= window - AGE_BUCKETS]:
            del self._windows[old]

    def snapshot(self) -> dict[str, Any]:
        """Plain data: ``count``, ``sum_us`` and each window's bucket counts."""
        return {"count": self.count, "sum_us": self.sum_us,
                "windows": {w: dict(c) for w, c in self._windows.items()}}


def merge_summaries(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """The sum of summary snapshots of one kind taken in different replicas."""
    total: dict[str, Any] = {"count": 0, "sum_us": 0.0, "windows": {}}
    for snap in snapshots:
        total["count"] += snap["count"]
        total["sum_us"] += snap["sum_us"]
        for window, counts in snap["windows"].items():
            dest = total["windows"].setdefault(int(window), {})
            for index, n in counts.items():
                dest[int(index)] = dest.get(int(index), 0) + n
    return total


def quantiles(snapshot: dict[str, Any], wanted: tuple[float, ...], now_s: float) -> dict[float, float]:
    """Each wanted quantile of the durations recorded in the windows of the last ``MAX_AGE_S``
    seconds, in microseconds (NaN when there were none, as a Prometheus summary reports it)."""
    current = int(now_s // WINDOW_S)
    counts: dict[int, int] = {}
    for window, per in snapshot["windows"].items():
        if current - AGE_BUCKETS < int(window) <= current:
            for index, n in per.items():
                counts[int(index)] = counts.get(int(index), 0) + n
    total = sum(counts.values())
    if not total:
        return {q: math.nan for q in wanted}
    ordered = sorted(counts.items())
    out = {}
    for q in wanted:
        rank, seen, index = q * total, 0, ordered[-1][0]
        for index, n in ordered:
            seen += n
            if seen >= rank:
                break
        # Bucket i > 0 holds [RATIO**(i-1), RATIO**i): its geometric middle.
        out[q] = RATIO ** (index - 0.5) if index else 0.5
    return out
