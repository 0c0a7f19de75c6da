"""Latency summaries (--metrics-config summary_latencies=true): quantiles within their
buckets' precision, windows that age out, replicas' figures that add up, and Triton's text."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rayinfer.protocol import latency_summary
from rayinfer.protocol.latency_summary import LatencySummary, merge_summaries, quantiles
from rayinfer.protocol.metrics import DEFAULT_QUANTILES, ModelFigures, parse_metrics_config, render
from rayinfer.protocol.statistics import ModelStatistics, merge_snapshots

NOW = 1_000_000.0


def test_quantiles_are_within_the_buckets_precision() -> None:
    durations = np.random.default_rng(0).lognormal(mean=6, sigma=1, size=20_000)
    summary = LatencySummary()
    for us in durations:
        summary.record(float(us), NOW)
    found = quantiles(summary.snapshot(), DEFAULT_QUANTILES, NOW)
    for q in DEFAULT_QUANTILES:
        assert found[q] == pytest.approx(float(np.quantile(durations, q)), rel=0.03), q
    assert summary.count == 20_000 and summary.sum_us == pytest.approx(float(durations.sum()))


def test_old_windows_age_out_but_count_and_sum_stay() -> None:
    summary = LatencySummary()
    summary.record(10_000.0, NOW, times=50)
    later = NOW + latency_summary.MAX_AGE_S + latency_summary.WINDOW_S
    summary.record(100.0, later)
    found = quantiles(summary.snapshot(), (0.5, 0.99), later)
    assert found[0.99] == pytest.approx(100.0, rel=0.02)  # the slow minute-old requests are gone
    assert summary.count == 51
    assert math.isnan(quantiles(LatencySummary().snapshot(), (0.5,), NOW)[0.5])


def test_replicas_summaries_merge_into_one() -> None:
    fast, slow = LatencySummary(), LatencySummary()
    fast.record(100.0, NOW, times=90)
    slow.record(5_000.0, NOW, times=10)
    merged = merge_summaries([fast.snapshot(), slow.snapshot()])
    found = quantiles(merged, (0.5, 0.95), NOW)
    assert found[0.5] == pytest.approx(100.0, rel=0.02) and found[0.95] == pytest.approx(5_000.0, rel=0.02)
    assert merged["count"] == 100


def test_statistics_keep_every_summary_per_request() -> None:
    a, b = ModelStatistics(), ModelStatistics()
    a.record_execution(requests=3, rows=3, input_ns=1_000, infer_ns=400_000, output_ns=2_000)
    for _ in range(3):
        a.record_success(request_ns=900_000, queue_ns=50_000)
    b.record_success(request_ns=100_000, queue_ns=0)  # a cache hit: no execution
    merged = merge_snapshots([a.snapshot(), b.snapshot()])["summaries"]
    assert {k: v["count"] for k, v in merged.items()} == {
        "request": 4, "queue": 4, "compute_input": 3, "compute_infer": 3, "compute_output": 3}


def test_the_text_is_tritons() -> None:
    stats = ModelStatistics()
    stats.record_execution(requests=1, rows=1, input_ns=43_000, infer_ns=324_000, output_ns=52_000)
    stats.record_success(request_ns=1_070_000, queue_ns=624_000)
    text = render([ModelFigures("m", "1", stats.snapshot())], None, summary_quantiles=DEFAULT_QUANTILES)
    lines = text.splitlines()
    assert "# TYPE nv_inference_request_summary_us summary" in lines
    assert ("# HELP nv_inference_request_summary_us Summary of inference request duration in microseconds "
            "(includes cached requests)") in lines
    assert 'nv_inference_request_summary_us_count{model="m",version="1"} 1' in lines
    assert 'nv_inference_request_summary_us_sum{model="m",version="1"} 1070' in lines
    median = next(line for line in lines if line.startswith('nv_inference_request_summary_us{model="m",version="1",quantile="0.5"}'))
    assert float(median.split()[-1]) == pytest.approx(1070, rel=0.02)
    for family in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert f"# TYPE nv_inference_{family}_summary_us summary" in lines
    assert sum(line.startswith("nv_inference_queue_summary_us{") for line in lines) == len(DEFAULT_QUANTILES)
    without = render([ModelFigures("m", "1", stats.snapshot())], None)
    assert "summary_us" not in without and "nv_inference_request_duration_us" in without


def test_counter_latencies_false_drops_the_duration_counters() -> None:
    stats = ModelStatistics()
    stats.record_success(request_ns=1_000, queue_ns=0)
    text = render([ModelFigures("m", "1", stats.snapshot())], None, counter_latencies=False)
    assert "nv_inference_request_duration_us" not in text and "nv_inference_request_success" in text


@pytest.mark.parametrize("values, expected", [
    ([], ((), True, False)),
    (["summary_latencies=true"], (DEFAULT_QUANTILES, True, False)),
    (["summary_latencies=true", "summary_quantiles=0.5:0.05,0.99:0.001"], ((0.5, 0.99), True, False)),
    (["counter_latencies=false"], ((), False, False)),
    (["histogram_latencies=true"], ((), True, True)),
])
def test_metrics_config_values(values, expected) -> None:
    assert parse_metrics_config(values) == expected


@pytest.mark.parametrize("value, message", [
    ("summary_latencies", "takes SETTING=VALUE"),
    ("summary_latencies=yes", "summary_latencies must be true or false"),
    ("summary_quantiles=1.5:0.1", "must lie between 0 and 1"),
    ("histogram_latencies=1", "histogram_latencies must be true or false"),
    ("summary_latency=true", "setting 'summary_latency' is not supported"),
])
def test_bad_metrics_config_values_are_named(value, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_metrics_config([value])
