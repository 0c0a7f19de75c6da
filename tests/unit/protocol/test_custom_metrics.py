"""Models' own metric families: summed over replicas and rendered beside Triton's (no Ray)."""

from __future__ import annotations

from rayinfer.protocol.custom_metrics import CustomMetricsCollector, merge_families
from rayinfer.protocol.metrics import render


def _replica(count: float, latency: list[int]) -> list[dict]:
    return [
        {"name": "requests_seen", "description": "Requests seen", "kind": "counter",
         "metrics": [{"labels": {"route": "a"}, "value": count}]},
        {"name": "input_size", "description": "Input sizes", "kind": "histogram",
         "metrics": [{"labels": {}, "buckets": [1, 10], "counts": latency, "sum": 12.5, "count": sum(latency) + 1}]},
    ]


def test_families_are_summed_over_replicas_and_rendered_with_their_own_names() -> None:
    merged = merge_families([_replica(2, [1, 1]), _replica(3, [0, 2])])
    text = render([], None, extra=[CustomMetricsCollector(merged)])
    lines = text.splitlines()
    assert "# TYPE requests_seen counter" in lines
    assert 'requests_seen{route="a"} 5' in lines
    assert "# TYPE input_size histogram" in lines
    assert 'input_size_bucket{le="1"} 1' in lines
    assert 'input_size_bucket{le="10"} 4' in lines
    assert 'input_size_bucket{le="+Inf"} 6' in lines
    assert "input_size_sum 25" in lines and "input_size_count 6" in lines


def test_a_family_reported_with_another_kind_is_left_out() -> None:
    gauge = [{"name": "requests_seen", "description": "x", "kind": "gauge", "metrics": [{"labels": {}, "value": 9}]}]
    merged = merge_families([_replica(1, [0, 0]), gauge])
    assert [m["value"] for m in merged[0]["metrics"]] == [1]
