"""Triton's response cache through unmodified tritonclient, over HTTP and gRPC: the session server
runs with ``--cache-config local,size=1048576`` and ``cached`` (add_sub, two replicas) sets
``response_cache { enable: true }``. A repeated request is answered without running the model
whichever replica the front picks, and shows in Triton's statistics and ``nv_cache_*`` metrics."""

from __future__ import annotations

import re
import urllib.request
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from waiting import WaitTimeout, wait_until

MODEL = "cached"


def _inputs(module: Any, a: np.ndarray) -> list[Any]:
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(np.ones((1, 16), np.int32))
    return inputs


def _stats(module: Any, client: Any, model: str = MODEL) -> dict[str, Any]:
    kwargs = {"as_json": True} if module is grpcclient else {}
    stats = client.get_inference_statistics(model, **kwargs)["model_stats"][0]
    inference = stats["inference_stats"]
    return {"execution_count": int(stats.get("execution_count", 0)),
            **{key: int(inference.get(key, {}).get("count", 0)) for key in ("success", "cache_hit", "cache_miss")}}


def _settled_stats(module: Any, client: Any) -> dict[str, int]:
    """The statistics once two readings a replica report apart agree (earlier tests' requests
    may still be on their way from the other replica)."""
    previous: dict[str, int] = {}

    def same() -> dict[str, int] | None:
        nonlocal previous
        now = _stats(module, client)
        agreed, previous = now == previous, now
        return now if agreed else None

    return wait_until(same, "the statistics to settle", timeout_s=30, interval_s=0.7)


def _metrics(server: dict) -> str:
    with urllib.request.urlopen(server["metrics_url"], timeout=10) as response:
        return response.read().decode()


def _metric(text: str, name: str, model: str = MODEL) -> float | None:
    match = re.search(rf'^{name}\{{model="{model}",version="1"\}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else None


def test_a_repeated_request_is_answered_from_the_cache(proto: tuple[Any, Any], server: dict) -> None:
    module, client = proto
    # A request no other test sends (each protocol its own), so that its first call misses.
    a = np.full((1, 16), 1000 + int(module is grpcclient), np.int32)
    before = _settled_stats(module, client)
    results = [client.infer(MODEL, _inputs(module, a)) for _ in range(8)]
    for result in results:
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + 1)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - 1)
    expected = {"execution_count": before["execution_count"] + 1, "success": before["success"] + 8,
                "cache_hit": before["cache_hit"] + 7, "cache_miss": before["cache_miss"] + 1}
    # One execution for eight answers, whichever of the two replicas the front picked for each
    # (sharing between two cache objects is checked in tests/unit/serving/test_response_cache_store.py).
    last: dict[str, int] = {}

    def settled() -> bool:
        last.update(_stats(module, client))
        return last == expected

    try:
        wait_until(settled, "the statistics", timeout_s=30, interval_s=0.3)
    except WaitTimeout:
        assert (before, last) == (before, expected)
    other = np.full((1, 16), 2000 + int(module is grpcclient), np.int32)
    np.testing.assert_array_equal(client.infer(MODEL, _inputs(module, other)).as_numpy("OUTPUT0"), other + 1)
    wait_until(lambda: _stats(module, client)["cache_miss"] == expected["cache_miss"] + 1,
               "a different request to miss", timeout_s=30, interval_s=0.3)


def test_cache_metrics_follow_the_statistics(proto: tuple[Any, Any], server: dict) -> None:
    module, client = proto
    a = np.full((1, 16), 3000 + int(module is grpcclient), np.int32)
    for _ in range(3):
        client.infer(MODEL, _inputs(module, a))
    stats = _stats(module, client)

    def metrics_agree() -> bool:
        text = _metrics(server)
        return (_metric(text, "nv_cache_num_hits_per_model") == stats["cache_hit"]
                and _metric(text, "nv_cache_num_misses_per_model") == stats["cache_miss"])

    wait_until(metrics_agree, "nv_cache_* to match the statistics", timeout_s=30, interval_s=0.5)
    text = _metrics(server)
    assert (_metric(text, "nv_cache_hit_duration_per_model") or 0) > 0
    assert (_metric(text, "nv_cache_miss_duration_per_model") or 0) > 0
    assert _metric(text, "nv_cache_num_hits_per_model", "simple") is None  # no cache there
    gauges = dict(line.split(" ", 1) for line in text.splitlines() if line.startswith("nv_cache_") and "{" not in line)
    assert float(gauges["nv_cache_num_entries"]) >= 1 and 0 < float(gauges["nv_cache_util"]) < 1
    assert float(gauges["nv_cache_num_lookups"]) == float(gauges["nv_cache_num_hits"]) + float(
        gauges["nv_cache_num_misses"])


def test_a_model_without_response_cache_runs_every_request(proto: tuple[Any, Any]) -> None:
    module, client = proto
    a = np.full((1, 16), 7, np.int32)
    before = _stats(module, client, "simple")
    for _ in range(3):
        client.infer("simple", _inputs(module, a))
    wait_until(lambda: _stats(module, client, "simple")["success"] == before["success"] + 3,
               "simple's statistics", timeout_s=30, interval_s=0.3)
    after = _stats(module, client, "simple")
    assert after["cache_hit"] == 0 and after["execution_count"] >= before["execution_count"] + 3
