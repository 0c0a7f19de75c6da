"""Triton's metrics port on a real server: exact counts after a known number of requests."""

from __future__ import annotations

import inspect
import json
import re
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import add_sub_inputs
from rayinfer.protocol import metrics
from waiting import wait_until

SAMPLE = re.compile(r'^(\w+)(?:\{(.*)\})? (\S+)$')


def scrape(url: str) -> tuple[str, dict[tuple[str, frozenset], float]]:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        match = SAMPLE.match(line)
        assert match, f"not a Prometheus sample: {line!r}"
        name, labels, value = match.groups()
        pairs = frozenset(tuple(p.split("=", 1)) for p in labels.split(",")) if labels else frozenset()
        samples[(name, frozenset((k, v.strip('"')) for k, v in pairs))] = float(value)
    return text, samples


def model_value(samples, metric: str, model: str, version: str = "1", **extra: str) -> float:
    return samples[(metric, frozenset({("model", model), ("version", version), *extra.items()}))]


COUNTERS = ("nv_inference_request_success", "nv_inference_count", "nv_inference_exec_count")


def wait_for(url: str, model: str, metric: str, target: float, timeout_s: float = 15.0):
    """Model replicas report every half second: poll until ``metric`` reaches ``target``; the samples."""
    def reached():
        _, samples = scrape(url)
        return samples if model_value(samples, metric, model) >= target else None

    return wait_until(reached, f"{metric} of '{model}' to reach {target:g}", timeout_s=timeout_s)


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server["url"])
    yield c
    c.close()


def add_sub(client, model: str, rows: int) -> None:
    """One request of ``rows`` rows (0: a model without a batch dimension)."""
    a = np.ones((rows, 16) if rows else (16,), dtype=np.int32)
    client.infer(model, add_sub_inputs(a, a))


def test_triton_metric_families_and_labels(server):
    text, samples = scrape(server["metrics_url"])
    for family, kind in [
        ("nv_inference_request_success", "counter"), ("nv_inference_request_failure", "counter"),
        ("nv_inference_count", "counter"), ("nv_inference_exec_count", "counter"),
        ("nv_inference_request_duration_us", "counter"), ("nv_inference_queue_duration_us", "counter"),
        ("nv_inference_compute_input_duration_us", "counter"), ("nv_inference_compute_infer_duration_us", "counter"),
        ("nv_inference_compute_output_duration_us", "counter"), ("nv_inference_pending_request_count", "gauge"),
        ("nv_cpu_utilization", "gauge"), ("nv_cpu_memory_total_bytes", "gauge"), ("nv_cpu_memory_used_bytes", "gauge"),
    ]:
        assert f"# TYPE {family} {kind}\n" in text
    for reason in ("OTHER", "BACKEND", "CANCELED", "REJECTED"):
        assert model_value(samples, "nv_inference_request_failure", "simple", reason=reason) >= 0
    # Every READY version has its own series; models that failed to load have none.
    assert model_value(samples, "nv_inference_count", "versioned", "2") >= 0
    assert not any(dict(labels).get("model") == "broken_config" for _, labels in samples)
    total = samples[("nv_cpu_memory_total_bytes", frozenset())]
    assert 0 < samples[("nv_cpu_memory_used_bytes", frozenset())] <= total
    assert 0.0 <= samples[("nv_cpu_utilization", frozenset())] <= 1.0


def test_counts_are_exact_after_known_requests(server, client):
    url = server["metrics_url"]
    _, before = scrape(url)
    for _ in range(3):
        add_sub(client, "nobatch", 0)
    add_sub(client, "batched", 2)
    add_sub(client, "batched", 3)
    samples = wait_for(url, "nobatch", "nv_inference_exec_count",
                       model_value(before, "nv_inference_exec_count", "nobatch") + 3)
    samples = wait_for(url, "batched", "nv_inference_count",
                       model_value(before, "nv_inference_count", "batched") + 5)

    def delta(metric: str, model: str) -> float:
        return model_value(samples, metric, model) - model_value(before, metric, model)

    assert [delta(m, "nobatch") for m in COUNTERS] == [3, 3, 3]
    # Two sequential requests of 2 and 3 rows: 2 requests, 5 inferences, 2 executions.
    assert [delta(m, "batched") for m in COUNTERS] == [2, 5, 2]
    assert delta("nv_inference_request_duration_us", "nobatch") > 0
    assert delta("nv_inference_compute_infer_duration_us", "nobatch") > 0
    assert model_value(samples, "nv_inference_pending_request_count", "nobatch") == 0


def test_metrics_agree_with_the_statistics_extension(server, client):
    add_sub(client, "nobatch", 0)
    stats = client.get_inference_statistics("nobatch", "1")["model_stats"][0]  # also reports them now
    _, samples = scrape(server["metrics_url"])
    assert model_value(samples, "nv_inference_request_success", "nobatch") == stats["inference_stats"]["success"]["count"]
    assert model_value(samples, "nv_inference_count", "nobatch") == stats["inference_count"]
    assert model_value(samples, "nv_inference_exec_count", "nobatch") == stats["execution_count"]
    assert model_value(samples, "nv_inference_queue_duration_us", "nobatch") == stats["inference_stats"]["queue"]["ns"] // 1000


def test_latency_summaries_follow_the_requests(server, client):
    """The session server runs with --metrics-config summary_latencies=true: Triton's summaries,
    their count equal to the successes and their quantiles in the range of the request times."""
    for _ in range(5):
        add_sub(client, "nobatch", 0)
    stats = client.get_inference_statistics("nobatch", "1")["model_stats"][0]["inference_stats"]
    successes = stats["success"]["count"]
    samples = wait_for(server["metrics_url"], "nobatch", "nv_inference_request_summary_us_count", successes)
    assert model_value(samples, "nv_inference_request_summary_us_count", "nobatch") == successes
    median = model_value(samples, "nv_inference_request_summary_us", "nobatch", quantile="0.5")
    slowest = model_value(samples, "nv_inference_request_summary_us", "nobatch", quantile="0.999")
    assert 0 < median <= slowest
    assert model_value(samples, "nv_inference_compute_infer_summary_us_count", "nobatch") >= 5
    for quantile in ("0.5", "0.9", "0.95", "0.99", "0.999"):
        assert model_value(samples, "nv_inference_queue_summary_us", "nobatch", quantile=quantile) >= 0


def test_model_replicas_report_none_of_rays_own_metrics(server):
    """Ray keeps the metric series of a process after it exits, so every reload would leave a
    model replica's (about 80) in Ray's processes: model replicas run with Ray's metrics off
    (``--replica-ray-metrics`` turns them on), the ``/v2`` and ``/v1`` replicas (one each, for the
    server's life) with them on."""
    def replicas_reporting() -> set[str] | None:
        with urllib.request.urlopen(server["ray_metrics_url"], timeout=30) as response:
            lines = response.read().decode().splitlines()
        # Each Serve replica reports this gauge itself, labelled with its application.
        apps = {re.search(r'application="([^"]*)"', line).group(1) for line in lines
                if line.startswith("ray_serve_replica_processing_queries{")}
        return apps if {"rayinfer", "openai"} <= apps else None  # Ray exports every 10 s

    assert wait_until(replicas_reporting, "the /v2 and /v1 replicas' Ray metrics", timeout_s=60,
                      interval_s=2.0) == {"rayinfer", "openai"}


DASHBOARD = Path(__file__).resolve().parents[2] / "ray-configs" / "grafana" / "rayinfer.json"
# Families only a machine with NVIDIA GPUs (and NVML) reports.
GPU_FAMILIES = ("nv_gpu_", "nv_energy_")


def test_the_grafana_dashboard_queries_only_metrics_the_server_exports(server):
    """Every metric a query of ray-configs/grafana/rayinfer.json names is on the metrics port or
    among Ray's own metrics of this server (GPU families: among those rayinfer reports on a GPU)."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queries.append(dashboard["templating"]["list"][1]["query"]["query"])
    named = {name for query in queries for name in re.findall(r"\b((?:nv|ray)_[a-z_]+)\b", query)}
    assert len(named) >= 15

    def exported() -> set[str] | None:
        names = {name for name, _ in scrape(server["metrics_url"])[1]}
        with urllib.request.urlopen(server["ray_metrics_url"], timeout=30) as response:
            names |= {line.split("{", 1)[0].split(" ", 1)[0] for line in response.read().decode().splitlines()
                      if line and not line.startswith("#")}
        # Ray exports every 10 s; its latency histogram appears once the /v2 replica has answered.
        return names if "ray_serve_deployment_processing_latency_ms_bucket" in names else None

    urllib.request.urlopen(f"http://{server['url']}/v2", timeout=10).read()  # a request the /v2 replica answers
    names = wait_until(exported, "Ray's metrics of the /v2 replica", timeout_s=60, interval_s=2.0)
    gpu_source = inspect.getsource(metrics)
    missing = sorted(n for n in named - names if not (n.startswith(GPU_FAMILIES) and f'"{n}"' in gpu_source))
    assert not missing, f"the dashboard queries metrics this server does not export: {missing}"
