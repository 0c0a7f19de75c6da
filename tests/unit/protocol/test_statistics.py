"""Model statistics: counters, merging replica snapshots, and Triton's JSON shape."""

from __future__ import annotations

import pickle

from rayinfer.protocol.statistics import ModelStatistics, merge_snapshots, stats_to_json

DURATION_KEYS = {"success", "fail", "queue", "compute_input", "compute_infer", "compute_output"}


def _replica() -> ModelStatistics:
    stats = ModelStatistics()
    # One execution holding 2 requests with 5 rows in total, then both succeed.
    stats.record_execution(requests=2, rows=5, input_ns=10, infer_ns=100, output_ns=20)
    stats.record_success(request_ns=300, queue_ns=50)
    stats.record_success(request_ns=200, queue_ns=40)
    stats.record_failure(request_ns=7)
    return stats


def test_counters() -> None:
    snap = _replica().snapshot()
    assert snap["inference_count"] == 5
    assert snap["execution_count"] == 1
    assert snap["last_inference"] > 0
    assert snap["durations"]["success"] == [2, 500]
    assert snap["durations"]["queue"] == [2, 90]
    assert snap["durations"]["fail"] == [1, 7]
    # Each request in the execution is charged the execution's time.
    assert snap["durations"]["compute_input"] == [2, 20]
    assert snap["durations"]["compute_infer"] == [2, 200]
    assert snap["durations"]["compute_output"] == [2, 40]
    assert snap["batch_stats"] == {
        5: {"compute_input": [1, 10], "compute_infer": [1, 100], "compute_output": [1, 20]}
    }


def test_batch_stats_keyed_by_rows() -> None:
    stats = ModelStatistics()
    stats.record_execution(1, 1, 1, 2, 3)
    stats.record_execution(1, 1, 1, 2, 3)
    stats.record_execution(3, 8, 1, 2, 3)
    snap = stats.snapshot()
    assert snap["execution_count"] == 3
    assert snap["inference_count"] == 10
    assert sorted(snap["batch_stats"]) == [1, 8]
    assert snap["batch_stats"][1]["compute_infer"] == [2, 4]
    assert snap["batch_stats"][8]["compute_infer"] == [1, 2]


def test_snapshot_is_a_copy_and_pickles() -> None:
    stats = _replica()
    snap = stats.snapshot()
    stats.record_failure(1)
    assert snap["durations"]["fail"] == [1, 7]
    assert pickle.loads(pickle.dumps(snap)) == snap


def test_merge_snapshots_sums_replicas() -> None:
    a = _replica().snapshot()
    other = ModelStatistics()
    other.record_execution(requests=1, rows=5, input_ns=1, infer_ns=2, output_ns=3)
    other.record_execution(requests=1, rows=1, input_ns=1, infer_ns=2, output_ns=3)
    other.record_success(request_ns=10, queue_ns=1)
    b = other.snapshot()
    b["batch_stats"] = {str(k): v for k, v in b["batch_stats"].items()}  # as after a JSON hop
    total = merge_snapshots([a, b])
    assert total["inference_count"] == 11
    assert total["execution_count"] == 3
    assert total["last_inference"] == max(a["last_inference"], b["last_inference"])
    assert total["durations"]["success"] == [3, 510]
    assert total["durations"]["compute_infer"] == [4, 204]
    assert total["batch_stats"][5]["compute_infer"] == [2, 102]
    assert total["batch_stats"][1]["compute_output"] == [1, 3]
    assert a["durations"]["success"] == [2, 500]  # inputs untouched


def test_merge_of_nothing_is_zero() -> None:
    total = merge_snapshots([])
    assert total["inference_count"] == 0 and total["batch_stats"] == {}
    assert all(v == [0, 0] for v in total["durations"].values())


def test_stats_to_json_shape() -> None:
    stats = _replica()
    stats.record_execution(1, 2, 1, 1, 1)
    doc = stats_to_json("simple", "1", stats.snapshot())
    assert doc["name"] == "simple" and doc["version"] == "1"
    assert doc["inference_count"] == 7 and doc["execution_count"] == 2
    assert isinstance(doc["last_inference"], int)
    assert DURATION_KEYS <= set(doc["inference_stats"])
    assert doc["inference_stats"]["success"] == {"count": 2, "ns": 500}
    assert doc["inference_stats"]["fail"] == {"count": 1, "ns": 7}
    assert doc["inference_stats"]["cache_hit"] == {"count": 0, "ns": 0}
    assert isinstance(doc["batch_stats"], list)
    assert [b["batch_size"] for b in doc["batch_stats"]] == [2, 5]
    assert doc["batch_stats"][1]["compute_infer"] == {"count": 1, "ns": 100}
    assert set(doc["batch_stats"][0]) == {"batch_size", "compute_input", "compute_infer", "compute_output"}


def test_the_last_inference_keeps_its_order_within_one_millisecond(monkeypatch) -> None:
    """Triton's last_inference is in whole ms; the full-precision time tells two versions that
    answered within one millisecond apart (a pool unloads the one used least recently)."""
    import rayinfer.protocol.statistics as statistics

    first, second = ModelStatistics(), ModelStatistics()
    for stats, now in ((first, 1_000.0002), (second, 1_000.0006)):
        monkeypatch.setattr(statistics.time, "time", lambda now=now: now)
        stats.record_success(request_ns=300, queue_ns=50)
    assert first.last_inference_ms == second.last_inference_ms == 1_000_000
    assert first.last_inference_s < second.last_inference_s
    monkeypatch.setattr(statistics.time, "time", lambda: 1_000.0009)
    first.record_failure(request_ns=7)
    assert first.last_inference_s > second.last_inference_s and first.last_inference_ms == 1_000_000
