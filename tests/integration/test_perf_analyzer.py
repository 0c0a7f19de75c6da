"""NVIDIA's perf_analyzer, unmodified, completes short runs over HTTP and gRPC against a batched
model of the test server."""

from __future__ import annotations

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


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_perf_analyzer_short_run(server, protocol):
    url = server["url"] if protocol == "http" else server["grpc_url"]
    result = subprocess.run(
        [str(PERF_ANALYZER), "-m", "batched", "-u", url, "-i", protocol, "--concurrency-range", "4:4",
         "--measurement-interval", "1000", "--max-trials", "4", "--stability-percentage", "100"],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    match = re.search(r"Concurrency: 4, throughput: ([0-9.]+) infer/sec", result.stdout)
    assert match and float(match.group(1)) > 0, result.stdout[-2000:]
