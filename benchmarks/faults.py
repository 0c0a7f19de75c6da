#!/usr/bin/env python3
"""Faults under a steady load: what clients see when a process of the server is killed.

    .venv/bin/python benchmarks/faults.py [--seconds 40] [--kill-at 10] [--clients 4]

Serves the example repository's ``simple`` (explicit mode, only ``simple`` loaded) inside a
private network namespace and keeps ``--clients`` HTTP clients calling it in a loop (each call
with a 15 s timeout, so a hung call shows as one). At ``--kill-at`` seconds one process gets
SIGKILL, a fresh server for each case:

- ``model replica (1 of 2)``: ``simple`` with ``instance_group count: 2``, one replica killed;
- ``model replica (the only one)``: ``count: 1``, its replica killed;
- ``/v2 replica``: the ``/v2`` application's replica (the front stays up, see docs/architecture.md);
- ``a worker node``: a Ray cluster of two nodes on this machine (``ray start``, one CPU each),
  ``simple`` with ``count: 2`` and replicas of 0.5 CPU, so one runs on each node and the ``/v2``
  replica (and the front) on the head; the second node's raylet and every process under it
  get SIGKILL, and a fresh second node is started ``--replace-after`` seconds later (what a
  cluster autoscaler would do). On one machine the lost node's listener refuses connections at
  once; across machines the front's connection attempts would time out (1 s each, one retry).

For each: the calls answered and failed (by status), the longest call, when the last failure
came after the kill, and when Serve had a new replica running (from the processes' titles).
Writes the table to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

from compare_triton import ROOT, in_private_netns, reexec_in_netns, start_rayinfer, stop_server, wait_ready, write_doc
from scaling import BIN, RAY_PORT, WORKER_NODE_PORTS, parent, ray_environment, start_ray_node

from rayinfer.cluster.example_repository import write_example_repository

PORT = 18700
MARKS = ("<!-- faults:begin -->", "<!-- faults:end -->")
CASES = {
    "model replica (1 of 2)": (2, b"ServeReplica:simple:"),
    "model replica (the only one)": (1, b"ServeReplica:simple:"),
    "/v2 replica": (1, b"ServeReplica:rayinfer:ServerDeployment"),
    "a worker node": (2, b"ServeReplica:simple:"),
}
NODE_CASE = "a worker node"
BODY = json.dumps({"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}
                              for n in ("INPUT0", "INPUT1")]}).encode()


def pids_titled(title: bytes) -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if title in (entry / "cmdline").read_bytes():
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


class Client(threading.Thread):
    """Calls simple over HTTP until stopped; records (start, seconds, outcome) of each call."""

    def __init__(self, stopping: threading.Event) -> None:
        super().__init__(daemon=True)
        self.stopping = stopping
        self.calls: list[tuple[float, float, str]] = []

    def run(self) -> None:
        url = f"http://127.0.0.1:{PORT}/v2/models/simple/infer"
        while not self.stopping.is_set():
            start = time.monotonic()
            try:
                with urllib.request.urlopen(urllib.request.Request(url, data=BODY), timeout=15) as response:
                    outcome = str(response.status)
                    response.read()
            except urllib.error.HTTPError as exc:
                outcome = f"{exc.code} {json.loads(exc.read() or b'{}').get('error', '')[:80]}"
            except OSError as exc:
                outcome = f"{type(exc).__name__}: {str(exc)[:80]}"
            self.calls.append((start, time.monotonic() - start, outcome))


def worker_node() -> set[int]:
    """The second node's raylet and every process under it."""
    children: dict[int, set[int]] = {}
    raylets = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
            children.setdefault(parent(int(entry.name)), set()).add(int(entry.name))
        except OSError:
            continue
        if b"raylet" in cmd.split(b"\0")[0] and f"--min_worker_port={WORKER_NODE_PORTS[0]}".encode() in cmd:
            raylets.add(int(entry.name))
    found, todo = set(), list(raylets)
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, ()))
    return found


def start_server(repo: Path, name: str, env: dict[str, str]):
    """The server for a case; on two nodes, the second starts once the first replica runs on
    the head (so that the ``/v2`` replica is there, and the second replica on the new node)."""
    args = ("--model-control-mode", "explicit", "--load-model", "simple")
    if name != NODE_CASE:
        return start_rayinfer(repo, PORT, repo / "rayinfer.log", (*args, "--replica-num-cpus", "0.1"))
    start_ray_node("head", env)
    # 0.5 CPU each: one replica fits beside the /v2 replica on the one-CPU head, the second does not.
    proc = start_rayinfer(repo, PORT, repo / "rayinfer.log",
                          (*args, "--replica-num-cpus", "0.5", "--ray-address", f"127.0.0.1:{RAY_PORT}"), env)
    deadline = time.monotonic() + 120
    while not pids_titled(b"ServeReplica:simple:") and time.monotonic() < deadline:
        time.sleep(0.2)  # Serve starts the first replica on its own schedule
    start_ray_node("worker", env)
    return proc


def run_case(name: str, count: int, title: bytes, seconds: float, kill_at: float, clients: int,
             replace_after: float) -> dict:
    repo = Path(tempfile.mkdtemp(prefix="faults-"))
    write_example_repository(repo)
    config = repo / "simple" / "config.pbtxt"
    config.write_text(config.read_text() + f"instance_group [ {{ count: {count} kind: KIND_CPU }} ]\n")
    env = ray_environment()
    if name == NODE_CASE:  # Ray notices the lost node, then the new one has to start
        seconds = max(seconds, kill_at + replace_after + 50)
    proc = start_server(repo, name, env)
    try:
        wait_ready(PORT, proc, 300)
        stopping = threading.Event()
        threads = [Client(stopping) for _ in range(clients)]
        start = time.monotonic()
        for thread in threads:
            thread.start()
        time.sleep(kill_at)  # the steady load before the kill
        before = pids_titled(title)
        victims = worker_node() if name == NODE_CASE else {min(before)}
        if name == NODE_CASE and (not victims & before or pids_titled(b"ServerDeployment") & victims):
            raise RuntimeError("the second node does not hold exactly a model replica (and not the /v2 one)")
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        replaced = None
        node_started = name != NODE_CASE
        while time.monotonic() - start < seconds:
            if not node_started and time.monotonic() - killed >= replace_after:
                start_ray_node("worker", env)
                node_started = True
            if replaced is None and len(pids_titled(title) - victims) >= len(before):
                replaced = time.monotonic() - killed
            time.sleep(0.1)  # polled: a replacement shows only as a new process title
        stopping.set()
        for thread in threads:
            thread.join(30)
    finally:
        stop_server(proc)
        if name == NODE_CASE:  # the cluster this case started
            subprocess.run([str(BIN / "ray"), "stop"], env=env, capture_output=True)
    calls = [call for thread in threads for call in thread.calls]
    failures = [(t, outcome) for t, _, outcome in calls if outcome != "200"]
    return {
        "case": name,
        "calls": len(calls),
        "failed": len(failures),
        "failed_before_kill": sum(t < killed for t, _ in failures),
        "first_failures": [(round(t - start, 2), outcome) for t, outcome in sorted(failures)[:6]],
        "kinds": Counter(outcome for _, outcome in failures).most_common(3),
        "longest_s": max(seconds_ for _, seconds_, _ in calls),
        "last_failure_s": max((t - killed for t, _ in failures), default=None),
        "replaced_s": replaced,
    }


def table(results: list[dict], args: argparse.Namespace) -> str:
    lines = [
        MARKS[0],
        f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} cores ({platform.machine()}), "
        f"{args.clients} HTTP clients calling `simple` in a loop for {args.seconds:.0f} s (a worker node: "
        f"{args.kill_at + args.replace_after + 50:.0f} s, a fresh node started {args.replace_after:.0f} s after the "
        f"loss), SIGKILL at {args.kill_at:.0f} s.",
        "",
        "| killed | calls | failed | failures (first kinds) | longest call (s) | last failure after the kill (s) | "
        "new replica running after (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        kinds = "; ".join(f"{n} x {k}" for k, n in r["kinds"]) or "none"
        last = f"{r['last_failure_s']:.1f}" if r["last_failure_s"] is not None else "-"
        replaced = f"{r['replaced_s']:.1f}" if r["replaced_s"] is not None else "not within the run"
        lines.append(f"| {r['case']} | {r['calls']:,} | {r['failed']:,} | {kinds.replace('|', '/')} | "
                     f"{r['longest_s']:.2f} | {last} | {replaced} |")
    lines += ["", "Reproduce: `.venv/bin/python benchmarks/faults.py`", MARKS[1]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--kill-at", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--replace-after", type=float, default=10.0,
                        help="a worker node: seconds from its loss to the start of a fresh one")
    parser.add_argument("--cases", default=",".join(CASES), help="which of the cases, comma-separated")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    if not in_private_netns():
        reexec_in_netns()
    results = []
    for name in args.cases.split(","):
        count, title = CASES[name]
        results.append(run_case(name, count, title, args.seconds, args.kill_at, args.clients, args.replace_after))
        print(results[-1], flush=True)
    section = table(results, args)
    print(section)
    write_doc(section, args.output, MARKS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
