#!/usr/bin/env python3
"""A model with autoscaling parameters under a load step through the front: replicas answering,
throughput and latency over time.

    .venv/bin/python benchmarks/autoscaling.py [--low 1] [--high 8] [--phase-seconds 10,40,40]
        [--plot docs/images/autoscaling.png]

Writes a repository holding one Python model (``slow``: 50 ms per request, no batching, one
instance to start with; autoscaling from 1 to 4 replicas, target 2 requests in flight per
replica, no upscale delay, 10 s downscale delay, 2 s look-back), starts ``rayinfer serve`` on
it inside a private network namespace, and runs three phases of HTTP clients calling back to
back (tritonclient, one thread each): ``--low`` clients, ``--high`` clients, ``--low`` again.
Every response names the PID of the replica that ran it; prints, per second, the replicas that
answered in the last two seconds, the calls per second and their p50, then when the second
replica first answered and when only one answered again. ``--plot``: the same over time as a
PNG (matplotlib, the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from compare_triton import in_private_netns, reexec_in_netns, start_rayinfer, stop_server, wait_ready
from rayinfer.cluster.example_repository import write_python_model

PORT = 18700
CONFIG = """name: "slow"
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "autoscaling_max_replicas" value: { string_value: "4" } }
parameters { key: "autoscaling_target_ongoing_requests" value: { string_value: "2" } }
parameters { key: "autoscaling_upscale_delay_s" value: { string_value: "0" } }
parameters { key: "autoscaling_downscale_delay_s" value: { string_value: "10" } }
parameters { key: "autoscaling_look_back_period_s" value: { string_value: "2" } }
"""
MODEL = '''import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.05 * len(requests))  # the model's work: 50 ms a request
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PID", np.array([os.getpid()], np.int64))])
                for _ in requests]
'''


class Load:
    """Client threads calling ``slow`` back to back; every answer as (end time, PID, latency)."""

    def __init__(self) -> None:
        self.answers: list[tuple[float, int, float]] = []
        self._lock = threading.Lock()
        self._threads: list[tuple[threading.Thread, threading.Event]] = []

    def resize(self, clients: int) -> None:
        while len(self._threads) < clients:
            stop = threading.Event()
            thread = threading.Thread(target=self._client, args=(stop,), daemon=True)
            thread.start()
            self._threads.append((thread, stop))
        while len(self._threads) > clients:
            thread, stop = self._threads.pop()
            stop.set()
            thread.join()

    def _client(self, stop: threading.Event) -> None:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{PORT}", network_timeout=60.0)
        data = httpclient.InferInput("INPUT0", [1], "INT32")
        data.set_data_from_numpy(np.array([1], np.int32))
        while not stop.is_set():
            start = time.monotonic()
            pid = int(client.infer("slow", [data]).as_numpy("PID")[0])
            end = time.monotonic()
            with self._lock:
                self.answers.append((end, pid, end - start))
        client.close()

    def window(self, start: float, end: float) -> list[tuple[float, int, float]]:
        with self._lock:
            return [a for a in self.answers if start <= a[0] < end]


def plot(rows: list[tuple[int, int, int, int, float]], path: Path) -> None:
    """Clients and replicas answering (left axis) and calls per second (right axis) over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r[0] for r in rows]
    fig, left = plt.subplots(figsize=(9, 4.2))
    left.step(t, [r[1] for r in rows], where="post", color="tab:gray", label="clients")
    left.step(t, [r[2] for r in rows], where="post", color="tab:blue", label="replicas answering (last 2 s)")
    left.set_xlabel("time (s)")
    left.set_ylabel("clients / replicas")
    right = left.twinx()
    right.plot(t, [r[3] for r in rows], color="tab:orange", label="calls/s")
    right.set_ylabel("calls/s")
    lines = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    labels = left.get_legend_handles_labels()[1] + right.get_legend_handles_labels()[1]
    left.legend(lines, labels, loc="upper right")
    left.set_title("Autoscaling under a load step: a 50 ms Python model, 1 to 4 replicas")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--low", type=int, default=1)
    parser.add_argument("--high", type=int, default=8)
    parser.add_argument("--phase-seconds", default="10,40,40")
    parser.add_argument("--plot", type=Path, help="write the run as a PNG here")
    args = parser.parse_args()
    if not in_private_netns():
        reexec_in_netns()
    phases = list(zip((args.low, args.high, args.low), (float(s) for s in args.phase_seconds.split(","))))
    with tempfile.TemporaryDirectory(prefix="rayinfer-autoscaling-") as tmp:
        write_python_model(Path(tmp) / "repo", "slow", CONFIG, MODEL)
        server = start_rayinfer(Path(tmp) / "repo", PORT, Path(tmp) / "rayinfer.log")
        load = Load()
        rows = []
        try:
            wait_ready(PORT, server, 300)
            begin = time.monotonic()
            for clients, seconds in phases:
                load.resize(clients)
                phase_end = time.monotonic() + seconds
                while (now := time.monotonic()) < phase_end:
                    time.sleep(1.0 - (now - begin) % 1.0)  # the next whole second of the run
                    t = time.monotonic()
                    last = load.window(t - 1.0, t)
                    replicas = len({pid for _, pid, _ in load.window(t - 2.0, t)})
                    p50 = statistics.median(a[2] for a in last) * 1000 if last else float("nan")
                    rows.append((round(t - begin), clients, replicas, len(last), p50))
                    print(f"  t={rows[-1][0]:3d} s  clients {clients}  replicas answering {replicas}  "
                          f"{len(last)} calls/s  p50 {p50:.0f} ms", flush=True)
            load.resize(0)
        finally:
            stop_server(server)
    print("\n| t (s) | clients | replicas answering (last 2 s) | calls/s | p50 (ms) |\n|---|---|---|---|---|")
    for t, clients, replicas, calls, p50 in rows:
        print(f"| {t} | {clients} | {replicas} | {calls} | {p50:.0f} |")
    high_start = phases[0][1]
    up = next((t for t, _, r, _, _ in rows if t >= high_start and r >= 2), None)
    down_from = high_start + phases[1][1]
    down = next((t for t, _, r, _, _ in rows if t >= down_from and r == 1), None)
    if args.plot is not None:
        plot(rows, args.plot)
    print(f"\nsecond replica answering {up - high_start if up is not None else 'never'} s after the step up; "
          f"one replica again {down - down_from if down is not None else 'never'} s after the step down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
