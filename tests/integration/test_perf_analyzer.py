"""NVIDIA's perf_analyzer, unmodified, completes short runs over HTTP and gRPC against a batched
model of the test server."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ANCHOR_PERF_ANALYZER = Path(__file__).resolve().parents[3] / "shared" / "anchors" / "triton" / "perf_analyzer"
PERF_ANALYZER = Path(os.environ.get("RAYINFER_PERF_ANALYZER", ANCHOR_PERF_ANALYZER))
ANCHOR_HOME = Path(os.environ.get("TRITON_ANCHOR", "/tmp/anchor-triton"))


def _available() -> bool:
    if "RAYINFER_PERF_ANALYZER" in os.environ:
        return PERF_ANALYZER.exists()
    return PERF_ANALYZER.exists() and (ANCHOR_HOME / "pa-venv" / "bin" / "perf_analyzer").exists()


pytestmark = pytest.mark.skipif(
    not _available(),
    reason="needs NVIDIA perf_analyzer: run ../shared/anchors/triton/setup, or set RAYINFER_PERF_ANALYZER",
)


@pytest.mark.parametrize("protocol", ["http", "grpc", "grpc-stream"])
def test_perf_analyzer_short_run(server, protocol):
    """grpc-stream: every client's requests on one stream for 3 s windows, long enough for its
    bandwidth probes (a PING as responses arrive) to pass 1000 in 10 s, which must not end the
    connection as a flood."""
    url = server["url"] if protocol == "http" else server["grpc_url"]
    stream = ["--streaming", "--measurement-interval", "3000"] if protocol == "grpc-stream" else \
        ["--measurement-interval", "1000"]
    result = subprocess.run(
        [str(PERF_ANALYZER), "-m", "batched", "-u", url, "-i", protocol.partition("-")[0], "--concurrency-range", "4:4",
         *stream, "--max-trials", "10", "--stability-percentage", "1000"],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    match = re.search(r"Concurrency: 4, throughput: ([0-9.]+) infer/sec", result.stdout)
    assert match and float(match.group(1)) > 0, result.stdout[-2000:]


def test_perf_analyzer_with_the_tuning_flags_of_the_design_documents(server, tmp_path):
    """The flags a tuning session uses: real input data with a batch size, synchronous calls, a
    percentile and a latency threshold (gRPC); then a variable-shape input, asynchronous calls
    at fixed request rates (HTTP)."""
    data = {"data": [{"INPUT0": list(range(16)), "INPUT1": [1] * 16}, {"INPUT0": [2] * 16, "INPUT1": list(range(16))}]}
    (tmp_path / "input.json").write_text(json.dumps(data))
    # These runs check the flags and what perf_analyzer reports, not the machine's stability: a
    # 2-core machine running the suite can vary p95 latency by more than 2x between windows.
    common = ["--measurement-interval", "1000", "--max-trials", "10", "--stability-percentage", "1000"]
    result = subprocess.run(
        [str(PERF_ANALYZER), "-m", "simple", "-u", server["grpc_url"], "-i", "grpc", "-b", "2",
         "--input-data", str(tmp_path / "input.json"), "--sync", "--concurrency-range", "2:2",
         "--percentile", "95", "--latency-threshold", "5000", *common],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Batch size: 2" in result.stdout and "p95 latency" in result.stdout, result.stdout[-2000:]
    assert re.search(r"Concurrency: 2, throughput: [1-9][0-9.]* infer/sec, latency \d+ usec", result.stdout)

    result = subprocess.run(
        [str(PERF_ANALYZER), "-m", "simple_identity", "-u", server["url"], "-i", "http", "--shape", "INPUT0:4",
         "--async", "--request-rate-range", "40:80:40", "--percentile", "99", *common],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    # (perf_analyzer prints the rate as "40" or, in some runs, "40.00")
    rates = re.findall(r"Request Rate: (\d+(?:\.\d+)?), throughput: ([0-9.]+) infer/sec", result.stdout)
    assert [float(rate) for rate, _ in rates] == [40, 80] and all(float(t) > 0 for _, t in rates), result.stdout[-2000:]


@pytest.mark.parametrize("model, protocol", [("fil_forest", "grpc"), ("mlp_openvino", "http"), ("tf_mlp", "grpc")])
def test_perf_analyzer_runs_against_each_cpu_backend(server, model, protocol):
    pytest.importorskip({"fil_forest": "xgboost", "mlp_openvino": "openvino", "tf_mlp": "tensorflow"}[model],
                        reason="needs the model's extra")
    url = server["url"] if protocol == "http" else server["grpc_url"]
    result = subprocess.run(
        [str(PERF_ANALYZER), "-m", model, "-u", url, "-i", protocol, "--concurrency-range", "4:4",
         "--measurement-interval", "1000", "--max-trials", "10", "--stability-percentage", "1000"],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    match = re.search(r"Concurrency: 4, throughput: ([0-9.]+) infer/sec", result.stdout)
    assert match and float(match.group(1)) > 0, result.stdout[-2000:]
