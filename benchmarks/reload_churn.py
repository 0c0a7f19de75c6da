#!/usr/bin/env python3
"""Reload churn: does the server's memory level off when a model is unloaded and loaded again
and again? Memory of each of the server's processes (by kind) every few cycles, for rayinfer and,
in the same run, for the Triton anchor doing the same.

    .venv/bin/python benchmarks/reload_churn.py [--cycles 90] [--every 10] [--no-triton]

Both servers run in explicit mode inside a private network namespace and churn the anchor's
Python model ``identity_fp32`` (../shared/anchors/models, unmodified): each cycle unloads it,
loads it again and calls it once, with no other traffic. rayinfer serves the example repository
beside it (``simple`` loaded at start); Triton serves ``identity_fp32`` alone (the anchor has the
Python backend only). Prints the PSS of each kind of process (Serve's controller, its proxy, the
/v2 replica, model replicas, the raylet, GCS, Ray's dashboard and agents, HAProxy; tritonserver
and its Python-backend stubs) every ``--every`` cycles, and writes the tables to
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import tempfile
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

from compare_triton import (PYTHON_MODEL, ROOT, ensure_anchor, in_private_netns, processes, python_model_repository,
                            reexec_in_netns, start_rayinfer, start_triton, stop_server, stop_triton, wait_ready, write_doc)
from scaling import memory_kib

PORT = 18950
RAY_METRICS_PORT = 18945
RAY_EXPORT_WAIT_S = 15.0
TRITON_PORT = 18970
MARKS = ("<!-- reload_churn:begin -->", "<!-- reload_churn:end -->")
BODY = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": [0.5] * 16}]}).encode()
# Process kinds, by the first match in the command line (else the command's first word).
KINDS = (("ServeController", "Serve controller"), ("ProxyActor", "Serve proxy"),
         ("ServeReplica:rayinfer:", "/v2 replica"), (f"ServeReplica:{PYTHON_MODEL}:", f"{PYTHON_MODEL} replica"),
         ("ServeReplica:simple:", "simple replica"), ("haproxy", "HAProxy"), ("raylet", "raylet"),
         ("gcs_server", "GCS"), ("DashboardAgent", "dashboard agent"), ("RuntimeEnvAgent", "runtime env agent"),
         ("dashboard.py", "dashboard"), ("log_monitor", "log monitor"), ("rayinfer", "rayinfer CLI"),
         ("triton_python_backend_stub", "Python backend stub"), ("tritonserver", "tritonserver"))

Row = tuple[int, float, dict[str, float]]
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def post(port: int, path: str, body: bytes) -> None:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=300) as response:
        response.read()


def memory_by_kind(before: set[int], marks: tuple[str, ...]) -> dict[str, float]:
    """PSS in MiB of the server's processes (started since ``before``, their command line holding
    one of ``marks``), by kind."""
    kinds: dict[str, float] = defaultdict(float)
    for pid, cmd in processes().items():
        if pid in before or not any(mark in cmd for mark in marks):
            continue
        figures = memory_kib(pid)
        if figures is None:
            continue
        kind = next((name for mark, name in KINDS if mark in cmd), cmd.split(" ", 1)[0].rsplit("/", 1)[-1])
        kinds[kind] += figures[0] / 1024
    return dict(kinds)


def churn(port: int, cycles: int, every: int, memory) -> list[Row]:
    """``cycles`` rounds of unload, load and one call of the Python model; memory every ``every``."""
    post(port, f"/v2/models/{PYTHON_MODEL}/infer", BODY)
    start = time.monotonic()
    rows: list[Row] = [(0, 0.0, memory())]
    print(rows[-1], flush=True)
    for cycle in range(1, cycles + 1):
        post(port, f"/v2/repository/models/{PYTHON_MODEL}/unload", b"{}")
        post(port, f"/v2/repository/models/{PYTHON_MODEL}/load", b"{}")
        post(port, f"/v2/models/{PYTHON_MODEL}/infer", BODY)
        if cycle % every == 0:
            rows.append((cycle, time.monotonic() - start, memory()))
            print(rows[-1], flush=True)
    return rows


def ray_series() -> Counter[str]:
    """How many series each metric has on Ray's metrics port (Prometheus text), once what the
    processes recorded so far has been exported; none where the port does not answer (Ray's
    metrics turned off)."""
    time.sleep(RAY_EXPORT_WAIT_S)  # Ray's processes export every 10 s, with no event to wait on
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{RAY_METRICS_PORT}/metrics", timeout=60) as response:
            lines = response.read().decode().splitlines()
    except OSError as exc:
        print(f"Ray's metrics port: {exc}", flush=True)
        return Counter()
    return Counter(_METRIC_NAME.match(line).group(0) for line in lines if line and not line.startswith("#"))


def run_rayinfer(work: Path, args: argparse.Namespace) -> tuple[list[Row], Counter[str], Counter[str]]:
    """The churn's rows, and Ray's metric series before and after it."""
    repo = python_model_repository(work / "rayinfer-repository", example=True)
    before = set(processes())
    proc = start_rayinfer(repo, PORT, work / "rayinfer.log", ("--model-control-mode", "explicit", "--load-model", "simple",
                                                              "--load-model", PYTHON_MODEL,
                                                              "--ray-metrics-port", str(RAY_METRICS_PORT)))
    try:
        wait_ready(PORT, proc, 600)
        post(PORT, f"/v2/models/{PYTHON_MODEL}/infer", BODY)
        series_before = ray_series()
        rows = churn(PORT, args.cycles, args.every, lambda: memory_by_kind(before, ("ray", "haproxy")))
        return rows, series_before, ray_series()
    finally:
        stop_server(proc)


def run_triton(work: Path, args: argparse.Namespace) -> list[Row]:
    """The anchor's tritonserver, in explicit mode, on ``identity_fp32`` alone."""
    ensure_anchor()
    repo = python_model_repository(work / "triton-repository", example=False)
    before = set(processes())
    proc = start_triton(repo, TRITON_PORT, work / "triton.log", ("--model-control-mode=explicit",
                                                                 f"--load-model={PYTHON_MODEL}"))
    try:
        wait_ready(TRITON_PORT, proc, 240)
        return churn(TRITON_PORT, args.cycles, args.every,
                     lambda: memory_by_kind(before, ("tritonserver", "triton_python_backend_stub")))
    finally:
        stop_triton(proc)


def per_reload(rows: list[Row]) -> str:
    """Growth of the total per cycle, after the first mark (the first loads warm caches up)."""
    (c0, _, m0), (c1, _, m1) = rows[1], rows[-1]
    return f"{(sum(m1.values()) - sum(m0.values())) / max(c1 - c0, 1):+.2f}"


def table(server: str, rows: list[Row]) -> list[str]:
    kinds = sorted({kind for _, _, memory in rows for kind in memory}, key=lambda k: -rows[-1][2].get(k, 0))
    lines = [f"{server}:", "", "| cycles | seconds | total | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 3) + "|"]
    for cycles, seconds, memory in rows:
        lines.append(f"| {cycles} | {seconds:.0f} | {sum(memory.values()):,.0f} | "
                     + " | ".join(f"{memory.get(kind, 0):,.0f}" for kind in kinds) + " |")
    return lines + [""]


def section(results: dict[str, list[Row]], series: Counter[str], after: Counter[str],
            args: argparse.Namespace) -> str:
    lines = [
        MARKS[0],
        f"Measured {time.strftime('%Y-%m-%d')} on 2 cores ({platform.machine()}), one run: {args.cycles} cycles of "
        f"unloading, loading and calling `{PYTHON_MODEL}` (the anchor's Python model) with no other traffic; PSS in "
        "MiB of each server's processes by kind.",
        "",
        "| server | total at start | at the end | MiB per reload after the first " + str(args.every) + " |",
        "|---|---|---|---|",
    ]
    for server, rows in results.items():
        lines.append(f"| {server} | {sum(rows[0][2].values()):,.0f} | {sum(rows[-1][2].values()):,.0f} | "
                     f"{per_reload(rows)} |")
    lines.append("")
    grown = {name: after[name] - series[name] for name in after if after[name] > series[name]}
    top = sorted(grown, key=lambda name: -grown[name])[:8]
    lines += [f"Ray's metrics port (`--ray-metrics-port`) listed {sum(series.values()):,} series before the cycles and "
              f"{sum(after.values()):,} after them; the metrics that gained most: "
              + (", ".join(f"`{name}` +{grown[name]:,}" for name in top) or "none") + ".", ""]
    for server, rows in results.items():
        lines += table(server, rows)
    flags = f"--cycles {args.cycles} --every {args.every}" + ("" if args.triton else " --no-triton")
    lines += [f"Reproduce: `.venv/bin/python benchmarks/reload_churn.py {flags}`", MARKS[1]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=90)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--no-triton", dest="triton", action="store_false", help="rayinfer only")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    if args.cycles < 2 * args.every:
        parser.error("--cycles must be at least twice --every (the growth is measured after the first --every)")
    if args.triton:
        ensure_anchor()  # before the network goes away
    if not in_private_netns():
        reexec_in_netns()
    work = Path(tempfile.mkdtemp(prefix="churn-"))
    results: dict[str, list[Row]] = {}
    if args.triton:
        results["Triton 2.51"] = run_triton(work, args)
    results["rayinfer"], series, after = run_rayinfer(work, args)
    text = section(results, series, after, args)
    print(text)
    write_doc(text, args.output, MARKS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
