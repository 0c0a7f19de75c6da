#!/usr/bin/env python3
"""Idle CPU: what a server with many loaded models costs while no request arrives, and how long
it takes to start them.

    .venv/bin/python benchmarks/idle_cpu.py [--models 30] [--seconds 40]

Serves ``--models`` copies of the example repository's ``simple`` (ONNX, one replica each,
``--replica-num-cpus 0.01``) inside a private network namespace, waits 15 s after the start,
then reads every process's CPU time over ``--seconds`` with no traffic. Runs the server twice
in the same run: with rayinfer's Ray settings, and with the two Serve timers rayinfer used to
leave at their faster values (Serve's metrics export every 100 ms, its HAProxy's health checks
every second). Ends with the floor Ray itself sets: the same number of idle Ray actors that do
nothing. Writes the table to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from compare_triton import ROOT, in_private_netns, processes, reexec_in_netns, start_rayinfer, stop_server, wait_ready, write_doc
from onnx import TensorProto

from rayinfer.cluster.example_repository import SIMPLE_CONFIG, add_sub_model, write_model

PORT = 18960
MARKS = ("<!-- idle_cpu:begin -->", "<!-- idle_cpu:end -->")
SETTLE_S = 15.0
# The server's processes by kind: the first match in the command line.
KINDS = (("ServeReplica:rayinfer:", "/v2 replica"), ("ServeReplica:", "model replicas"),
         ("ServeController", "Serve controller"), ("ProxyActor", "Serve proxy"), ("haproxy", "HAProxy"),
         ("raylet", "raylet"), ("gcs_server", "GCS"), ("DashboardAgent", "dashboard agent"),
         ("dashboard", "dashboard"))
# The settings rayinfer had before it slowed these two Serve timers (cluster/settings.py).
EARLIER = {"RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "100", "RAY_SERVE_HAPROXY_HEALTH_CHECK_INTER": "1s"}


def cpu_ticks(pids: list[int]) -> dict[int, int]:
    """User + system CPU time of each live process in ``pids``, in clock ticks."""
    out = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = int(fields[11]) + int(fields[12])
    return out


def cpu_by_kind(before: set[int], seconds: float) -> dict[str, float]:
    """Per cent of one core used by the processes started since ``before``, by kind, over ``seconds``."""
    commands = {pid: cmd for pid, cmd in processes().items() if pid not in before}
    start = cpu_ticks(list(commands))
    time.sleep(seconds)
    end = cpu_ticks(list(commands))
    hertz = os.sysconf("SC_CLK_TCK")
    kinds: dict[str, float] = defaultdict(float)
    for pid, ticks in end.items():
        if pid in start:
            kind = next((name for mark, name in KINDS if mark in commands[pid]), "other")
            kinds[kind] += 100.0 * (ticks - start[pid]) / hertz / seconds
    return dict(kinds)


def measure_server(repo: Path, env: dict[str, str], seconds: float) -> tuple[float, dict[str, float]]:
    """(seconds to start, CPU by kind while idle) of ``rayinfer serve`` on ``repo``."""
    before = set(processes())
    started = time.monotonic()
    # Small CPU reservations, as in the test suite: 2 cores hold every replica.
    proc = start_rayinfer(repo, PORT, repo / "rayinfer.log", ("--replica-num-cpus", "0.01", "--num-cpus", "2"),
                          env={**os.environ, **env})
    try:
        wait_ready(PORT, proc, 900)
        start_s = time.monotonic() - started
        time.sleep(SETTLE_S)
        return start_s, cpu_by_kind(before, seconds)
    finally:
        stop_server(proc)


def ray_floor(count: int, seconds: float) -> float:
    """Per cent of one core each of ``count`` idle Ray actors uses (Ray started with rayinfer's settings)."""
    script = f"""
import os, sys, time, ray
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
@ray.remote(num_cpus=0.01)
class Idle:
    def pid(self):
        return os.getpid()
actors = [Idle.remote() for _ in range({count})]
print("PIDS", *ray.get([a.pid.remote() for a in actors]), flush=True)
sys.stdin.read()
ray.shutdown()
"""
    from rayinfer.cluster.settings import RAY_ENVIRONMENT

    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**RAY_ENVIRONMENT, **os.environ})
    try:
        line = ""
        while not line.startswith("PIDS "):
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("the Ray actors did not start")
        pids = [int(p) for p in line.split()[1:]]
        time.sleep(SETTLE_S)
        start = cpu_ticks(pids)
        time.sleep(seconds)
        end = cpu_ticks(pids)
    finally:
        proc.communicate("", timeout=120)
    used = sum(end[p] - start[p] for p in end if p in start)
    return 100.0 * used / os.sysconf("SC_CLK_TCK") / seconds / max(1, len(pids))


def section(rows: list[tuple[str, float, dict[str, float]]], floor: float, args: argparse.Namespace) -> str:
    kinds = [name for name in [*(name for _, name in KINDS), "other"] if any(name in cpu for _, _, cpu in rows)]
    lines = [
        MARKS[0],
        f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} cores ({platform.machine()}): {args.models} copies of "
        f"`simple` loaded at start (one replica each), no traffic; CPU over {args.seconds:.0f} s from {SETTLE_S:.0f} s "
        "after the server was ready, in per cent of one core.",
        "",
        "| Ray settings | start (s) | all | per model replica | " + " | ".join(kinds) + " |",
        "|---" * (len(kinds) + 4) + "|",
    ]
    for label, start_s, cpu in rows:
        per_replica = cpu.get("model replicas", 0.0) / args.models
        lines.append(f"| {label} | {start_s:.0f} | {sum(cpu.values()):.0f} | {per_replica:.2f} | "
                     + " | ".join(f"{cpu.get(kind, 0.0):.1f}" for kind in kinds) + " |")
    lines += ["", f"An idle Ray actor that does nothing uses {floor:.2f}% of a core here (the same number of them, "
              "measured in the same run): Ray's own floor under each model replica.",
              "", f"Reproduce: `.venv/bin/python benchmarks/idle_cpu.py --models {args.models} --seconds {args.seconds:.0f}`",
              MARKS[1]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=30)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    if not in_private_netns():
        reexec_in_netns()
    repo = Path(tempfile.mkdtemp(prefix="idle-"))
    model = add_sub_model(TensorProto.INT32)
    for i in range(args.models):
        write_model(repo, f"simple_{i}", SIMPLE_CONFIG.replace('name: "simple"', f'name: "simple_{i}"'), model)
    rows = []
    for label, env in (("rayinfer's", {}), ("metrics export 100 ms, HAProxy checks 1 s", EARLIER)):
        start_s, cpu = measure_server(repo, env, args.seconds)
        rows.append((label, start_s, cpu))
        print(label, f"started in {start_s:.0f} s", {k: round(v, 1) for k, v in cpu.items()}, flush=True)
    floor = ray_floor(args.models, args.seconds)
    text = section(rows, floor, args)
    print(text)
    write_doc(text, args.output, MARKS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
