#!/usr/bin/env python3
"""Reload churn: does the server's memory level off when a model is unloaded and loaded again
and again? Memory of each of the server's processes (by kind) every few cycles.

    .venv/bin/python benchmarks/reload_churn.py [--cycles 90] [--every 10]

Serves the example repository (explicit mode: simple and the Python model simple_identity
loaded at start) inside a private network namespace; each cycle unloads simple_identity,
loads it again and calls it once, with no other traffic. Prints the PSS of each kind of process
(Serve's controller, its proxy, the /v2 replica, model replicas, the raylet, GCS, Ray's
dashboard and agents, HAProxy) every ``--every`` cycles, and writes the table to
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

from compare_triton import ROOT, in_private_netns, processes, reexec_in_netns, start_rayinfer, stop_server, wait_ready, write_doc
from scaling import memory_kib

from rayinfer.cluster.example_repository import write_example_repository

PORT = 18950
MARKS = ("<!-- reload_churn:begin -->", "<!-- reload_churn:end -->")
IDENTITY = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "BYTES", "data": ["churn"]}]}).encode()
# Process kinds, by the first match in the command line (else the command's first word).
KINDS = (("ServeController", "Serve controller"), ("ProxyActor", "Serve proxy"),
         ("ServeReplica:rayinfer:", "/v2 replica"), ("ServeReplica:simple_identity:", "simple_identity replica"),
         ("ServeReplica:simple:", "simple replica"), ("haproxy", "HAProxy"), ("raylet", "raylet"),
         ("gcs_server", "GCS"), ("dashboard_agent", "dashboard agent"), ("runtime_env", "runtime env agent"),
         ("dashboard.py", "dashboard"), ("log_monitor", "log monitor"), ("rayinfer", "rayinfer CLI"))


def post(path: str, body: bytes) -> None:
    request = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=300) as response:
        response.read()


def memory_by_kind(before: set[int]) -> dict[str, float]:
    """PSS in MiB of the server's processes (those started since ``before``), by kind."""
    kinds: dict[str, float] = defaultdict(float)
    for pid, cmd in processes().items():
        if pid in before or not ("ray" in cmd or "haproxy" in cmd):
            continue
        figures = memory_kib(pid)
        if figures is None:
            continue
        kind = next((name for mark, name in KINDS if mark in cmd), cmd.split(" ", 1)[0].rsplit("/", 1)[-1])
        kinds[kind] += figures[0] / 1024
    return dict(kinds)


def section(rows: list[tuple[int, float, dict[str, float]]], args: argparse.Namespace) -> str:
    kinds = sorted({kind for _, _, memory in rows for kind in memory}, key=lambda k: -rows[-1][2].get(k, 0))
    lines = [
        MARKS[0],
        f"Measured {time.strftime('%Y-%m-%d')} on 2 cores ({platform.machine()}): {args.cycles} cycles of unloading, "
        "loading and calling `simple_identity` (a Python model) with no other traffic; PSS in MiB of the "
        "server's processes by kind.",
        "",
        "| cycles | seconds | total | " + " | ".join(kinds) + " |",
        "|---" * (len(kinds) + 3) + "|",
    ]
    for cycles, seconds, memory in rows:
        lines.append(f"| {cycles} | {seconds:.0f} | {sum(memory.values()):,.0f} | "
                     + " | ".join(f"{memory.get(kind, 0):,.0f}" for kind in kinds) + " |")
    lines += ["", f"Reproduce: `.venv/bin/python benchmarks/reload_churn.py --cycles {args.cycles} --every {args.every}`",
              MARKS[1]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=90)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    if not in_private_netns():
        reexec_in_netns()
    repo = Path(tempfile.mkdtemp(prefix="churn-"))
    write_example_repository(repo)
    before = set(processes())
    proc = start_rayinfer(repo, PORT, repo / "rayinfer.log", ("--model-control-mode", "explicit", "--load-model", "simple",
                                                              "--load-model", "simple_identity"))
    rows: list[tuple[int, float, dict[str, float]]] = []
    try:
        wait_ready(PORT, proc, 600)
        post("/v2/models/simple_identity/infer", IDENTITY)
        start = time.monotonic()
        rows.append((0, 0.0, memory_by_kind(before)))
        print(rows[-1], flush=True)
        for cycle in range(1, args.cycles + 1):
            post("/v2/repository/models/simple_identity/unload", b"{}")
            post("/v2/repository/models/simple_identity/load", b"{}")
            post("/v2/models/simple_identity/infer", IDENTITY)
            if cycle % args.every == 0:
                rows.append((cycle, time.monotonic() - start, memory_by_kind(before)))
                print(rows[-1], flush=True)
    finally:
        stop_server(proc)
    text = section(rows, args)
    print(text)
    write_doc(text, args.output, MARKS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
