"""Per-model inference statistics in the shape of Triton's statistics extension."""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Any

from rayinfer.protocol.latency_summary import LatencySummary, merge_summaries

_DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit",
              "cache_miss")
_BATCH_DURATIONS = ("compute_input", "compute_infer", "compute_output")
# The durations kept as latency summaries too (Triton's nv_inference_*_summary_us), per request.
SUMMARIES = ("request", "queue", "compute_input", "compute_infer", "compute_output")
# Triton's family of the time to first response, and its bucket bounds, in milliseconds (a config's
# model_metrics may give others).
FIRST_RESPONSE_HISTOGRAM = "nv_inference_first_response_histogram_ms"
FIRST_RESPONSE_BUCKETS_MS = (100.0, 500.0, 2000.0, 5000.0)


@dataclass
class ModelStatistics:
    """Cumulative counters of one model version in one replica; snapshots add up across replicas.

    Durations are kept as ``[count, ns]`` pairs, as the statistics extension reports them.
    """

    inference_count: int = 0
    execution_count: int = 0
    # When it last answered (Unix time, s, full precision: a pool unloads the version used least
    # recently, and several may answer within one millisecond); Triton reports it in whole ms.
    last_inference_s: float = 0.0
    durations: dict[str, list[int]] = field(default_factory=lambda: {k: [0, 0] for k in _DURATIONS})
    batch_stats: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    # Failures other than the model's own (Triton's REJECTED, CANCELED, OTHER), by reason.
    failure_reasons: dict[str, int] = field(default_factory=dict)
    # Each successful request's durations, for quantiles (cached requests count in request and queue).
    summaries: dict[str, LatencySummary] = field(default_factory=lambda: {k: LatencySummary() for k in SUMMARIES})
    # Time to first response (nv_inference_first_response_histogram_ms): the buckets' upper
    # bounds in ms, the requests in each (the last: above every bound) and their sum in whole ms.
    # A decoupled model's is recorded as its first response leaves (record_first_response), any
    # other's as its request ends.
    first_response_buckets: tuple[float, ...] = FIRST_RESPONSE_BUCKETS_MS
    decoupled: bool = False
    first_response_counts: list[int] = field(default_factory=list)
    first_response_sum_ms: int = 0

    def __post_init__(self) -> None:
        self.first_response_counts = [0] * (len(self.first_response_buckets) + 1)

    def record_success(self, request_ns: int, queue_ns: int) -> None:
        self._add("success", request_ns)
        self._add("queue", queue_ns)
        now = time.time()
        self.last_inference_s = now
        self.summaries["request"].record(request_ns / 1000, now)
        self.summaries["queue"].record(queue_ns / 1000, now)
        if not self.decoupled:
            self.record_first_response(request_ns)

    def record_failure(self, request_ns: int, reason: str = "BACKEND") -> None:
        """A failed request; ``reason`` as the failure metric labels it (BACKEND: the model's)."""
        self._add("fail", request_ns)
        if reason != "BACKEND":
            self.failure_reasons[reason] = self.failure_reasons.get(reason, 0) + 1
        elif not self.decoupled:  # its error is its response
            self.record_first_response(request_ns)
        self.last_inference_s = time.time()

    @property
    def last_inference_ms(self) -> int:
        """Triton's ``last_inference``: :attr:`last_inference_s` in whole milliseconds."""
        return int(self.last_inference_s * 1000)

    def record_first_response(self, ns: int) -> None:
        """A request's first response, ``ns`` after the request arrived (counted in whole ms, as Triton does)."""
        ms = ns // 1_000_000
        self.first_response_counts[bisect.bisect_left(self.first_response_buckets, ms)] += 1
        self.first_response_sum_ms += ms

    def record_execution(
        self, requests: int, rows: int, input_ns: int, infer_ns: int, output_ns: int
    ) -> None:
        """One model execution of ``requests`` requests holding ``rows`` rows in total."""
        self.execution_count += 1
        self.inference_count += rows
        per_batch = self.batch_stats.setdefault(rows, {k: [0, 0] for k in _BATCH_DURATIONS})
        now = time.time()
        for key, ns in (("compute_input", input_ns), ("compute_infer", infer_ns), ("compute_output", output_ns)):
            # Each request in the execution is charged the execution's time, as Triton does.
            pair = self.durations[key]
            pair[0] += requests
            pair[1] += ns * requests
            per_batch[key][0] += 1
            per_batch[key][1] += ns
            self.summaries[key].record(ns / 1000, now, requests)

    def record_cache_hit(self, request_ns: int, lookup_ns: int) -> None:
        """A request answered from the response cache: a success with no execution."""
        self._add("cache_hit", lookup_ns)
        self.record_success(request_ns, 0)

    def record_cache_miss(self, ns: int) -> None:
        """A request not in the cache: its lookup and insertion time."""
        self._add("cache_miss", ns)

    def _add(self, key: str, ns: int) -> None:
        pair = self.durations[key]
        pair[0] += 1
        pair[1] += ns

    def snapshot(self) -> dict[str, Any]:
        """A plain-data copy, safe to send to another process."""
        return {
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "last_inference": self.last_inference_ms,
            "durations": {k: list(v) for k, v in self.durations.items()},
            "batch_stats": {b: {k: list(v) for k, v in d.items()} for b, d in self.batch_stats.items()},
            "failure_reasons": dict(self.failure_reasons),
            "summaries": {k: v.snapshot() for k, v in self.summaries.items()},
            "first_response": {"buckets": list(self.first_response_buckets),
                               "counts": list(self.first_response_counts), "sum_ms": self.first_response_sum_ms},
        }


def merge_snapshots(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum snapshots of the same model version taken in different replicas."""
    total = ModelStatistics().snapshot()
    for snap in snapshots:
        total["inference_count"] += snap["inference_count"]
        total["execution_count"] += snap["execution_count"]
        total["last_inference"] = max(total["last_inference"], snap["last_inference"])
        for key, (count, ns) in snap["durations"].items():
            pair = total["durations"].setdefault(key, [0, 0])
            pair[0] += count
            pair[1] += ns
        total["response_cache"] = total.get("response_cache", False) or snap.get("response_cache", False)
        total["cache_evictions"] = total.get("cache_evictions", 0) + snap.get("cache_evictions", 0)
        for reason, count in snap.get("failure_reasons", {}).items():
            total["failure_reasons"][reason] = total["failure_reasons"].get(reason, 0) + count
        for size, per in snap["batch_stats"].items():
            dest = total["batch_stats"].setdefault(int(size), {k: [0, 0] for k in _BATCH_DURATIONS})
            for key, (count, ns) in per.items():
                dest[key][0] += count
                dest[key][1] += ns
    histograms = [snap["first_response"] for snap in snapshots if "first_response" in snap]
    if histograms:  # the replicas of one version share its config, and so its buckets
        first = total["first_response"] = {"buckets": list(histograms[0]["buckets"]),
                                           "counts": [0] * len(histograms[0]["counts"]), "sum_ms": 0}
        for histogram in histograms:
            if histogram["buckets"] == first["buckets"]:
                first["counts"] = [a + b for a, b in zip(first["counts"], histogram["counts"])]
                first["sum_ms"] += histogram["sum_ms"]
    for key in SUMMARIES:
        total["summaries"][key] = merge_summaries(
            [total["summaries"][key], *(snap["summaries"][key] for snap in snapshots if "summaries" in snap)])
    return total


def stats_to_json(name: str, version: str, snap: dict[str, Any]) -> dict[str, Any]:
    """One entry of ``model_stats`` in Triton's JSON form."""
    inference_stats = {k: {"count": c, "ns": ns} for k, (c, ns) in snap["durations"].items()}
    return {
        "name": name,
        "version": version,
        "last_inference": snap["last_inference"],
        "inference_count": snap["inference_count"],
        "execution_count": snap["execution_count"],
        "inference_stats": inference_stats,
        "response_stats": {},
        "batch_stats": [
            {"batch_size": size, **{k: {"count": c, "ns": ns} for k, (c, ns) in per.items()}}
            for size, per in sorted(snap["batch_stats"].items())
        ],
        "memory_usage": [],
    }
