#!/usr/bin/env python3
"""Soak: 30 minutes of mixed traffic against one server; errors, latency drift, memory growth.

    .venv/bin/python benchmarks/soak.py [--minutes 30]

Serves the example repository (explicit mode: simple, simple_string, mlp and simple_identity
loaded at start) inside a private network namespace and runs, until the time is up:

- 2 HTTP JSON clients calling ``simple`` (one connection per call);
- 1 tritonclient.http client calling ``mlp`` with binary tensors;
- 1 tritonclient.grpc client calling ``simple_string`` (BYTES);
- 1 client reading metadata, readiness, statistics and the metrics port in turn;
- every 30 s: ``simple_identity`` (a Python model) unloaded, loaded again and called once;
- every 5 minutes: 64 clients for 10 s at once (a burst over ``--max-inflight-requests 32``;
  refusals, of the burst's calls or of the others' meanwhile, count as refused, not as errors).

Per minute: calls, errors (by kind), p50 / p99 of the infer calls, the server's memory (PSS of
its processes), the CPU time the server's processes and the soak's own client used (so the CPU
each call cost), and the machine's speed: a separate process runs the same fixed piece of pure
Python work every second and reports the CPU time it took (it rises when the machine's cores
give less work per CPU second: a busier host, a lower clock), with the steal time the kernel
counts. Prints the per-minute rows and writes a summary (first vs last five minutes) to
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
from compare_triton import ROOT, in_private_netns, processes, reexec_in_netns, start_rayinfer, stop_server, wait_ready, write_doc
from overload import percentile
from idle_cpu import cpu_ticks
from scaling import server_memory, server_processes

from rayinfer.cluster.example_repository import write_example_repository

PORT = 18900
MARKS = ("<!-- soak:begin -->", "<!-- soak:end -->")
SIMPLE = json.dumps({"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}
                                for n in ("INPUT0", "INPUT1")]}).encode()
BURST_LIMIT = 32


class Recorder:
    """(time, kind, seconds, outcome) of every call, from every thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[float, str, float, str]] = []

    def timed(self, kind: str, call) -> None:
        start = time.monotonic()
        try:
            call()
            outcome = "ok"
        except urllib.error.HTTPError as exc:
            outcome = "refused" if exc.code == 503 else f"{exc.code} {exc.read()[:80]!r}"
        except Exception as exc:  # every failure is a finding
            # tritonclient's clients raise on a refusal during a burst (503 / UNAVAILABLE).
            outcome = "refused" if "Server is busy" in str(exc) else f"{type(exc).__name__}: {str(exc)[:80]}"
        with self.lock:
            self.calls.append((start, kind, time.monotonic() - start, outcome))


# The machine's speed: the CPU milliseconds of a fixed piece of pure Python work, once a second.
PROBE = """
import time
while True:
    start = time.process_time()
    total = 0
    for i in range(300_000):
        total += i * i % 7
    print(time.monotonic(), (time.process_time() - start) * 1000, flush=True)
    time.sleep(1)  # the probe's pace: a sample a second, about 4% of one core
"""


class MachineProbe:
    """The fixed work's CPU milliseconds, by time, read from its process's output."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._proc = subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            at, ms = line.split()
            self.samples.append((float(at), float(ms)))

    def stop(self) -> None:
        self._proc.kill()
        self._proc.wait()


def steal_seconds() -> float:
    """CPU time the hypervisor gave to others while this machine's cores wanted it (all cores)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class CpuClock:
    """CPU seconds at each minute's end: the server's processes (summed per process, so that a
    replica that stopped takes its time with it rather than counting negative), the soak's own
    client, and the machine's steal time."""

    def __init__(self, before: set[int]) -> None:
        self._before = before
        self._pids: set[int] = set()
        self._last: dict[int, float] = {}
        self.server = 0.0
        self.at: dict[int, tuple[float, float, float]] = {}

    def take(self, minute: int) -> None:
        self._pids |= set(server_processes(self._before))  # a reloaded model's replica is a new process
        tick = os.sysconf("SC_CLK_TCK")
        now = {pid: ticks / tick for pid, ticks in cpu_ticks(list(self._pids)).items()}
        self.server += sum(seconds - self._last.get(pid, 0.0) for pid, seconds in now.items())
        self._last = now
        self.at[minute] = (self.server, own_cpu_seconds(), steal_seconds())


def url(path: str, port: int = PORT) -> str:
    return f"http://127.0.0.1:{port}{path}"


def fetch(path: str, body: bytes | None = None, port: int = PORT) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url(path, port), data=body), timeout=60) as response:
        return response.read()


def loop(stop: threading.Event, work) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
            work()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def start_traffic(stop: threading.Event, rec: Recorder) -> list[threading.Thread]:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    threads = [loop(stop, lambda: rec.timed("infer", lambda: fetch("/v2/models/simple/infer", SIMPLE))) for _ in range(2)]
    mlp = httpclient.InferenceServerClient(f"127.0.0.1:{PORT}", network_timeout=60)
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)

    def call_mlp() -> None:
        tensor = httpclient.InferInput("INPUT0", [4, 256], "FP32")
        tensor.set_data_from_numpy(x, binary_data=True)
        assert mlp.infer("mlp", [tensor]).as_numpy("OUTPUT0").shape == (4, 10)

    threads.append(loop(stop, lambda: rec.timed("infer", call_mlp)))
    strings = grpcclient.InferenceServerClient(f"127.0.0.1:{PORT + 1}")
    words = np.array([[str(i).encode() for i in range(16)]], dtype=object)

    def call_strings() -> None:
        inputs = [grpcclient.InferInput(n, [1, 16], "BYTES") for n in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(words)
        assert strings.infer("simple_string", inputs).as_numpy("OUTPUT0")[0, 3] == b"6"

    threads.append(loop(stop, lambda: rec.timed("infer", call_strings)))
    # Liveness, not readiness: strict readiness is false while simple_identity reloads (as in Triton).
    reads = ["/v2/models/simple", "/v2/health/live", "/v2/models/mlp/stats", "/v2/models/simple_string/config"]
    turn = iter(range(1 << 62))

    def read_one() -> None:
        i = next(turn)
        if i % 5 == 4:
            rec.timed("read", lambda: fetch("/metrics", port=PORT + 2))
        else:
            rec.timed("read", lambda: fetch(reads[i % 5]))
        time.sleep(0.05)  # a reader's pace (about 15 reads a second), not a flood

    threads.append(loop(stop, read_one))
    return threads


def reload_identity(rec: Recorder) -> None:
    body = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "BYTES", "data": ["soak"]}]}).encode()
    rec.timed("control", lambda: fetch("/v2/repository/models/simple_identity/unload", b"{}"))
    rec.timed("control", lambda: fetch("/v2/repository/models/simple_identity/load", b"{}"))
    rec.timed("control", lambda: fetch("/v2/models/simple_identity/infer", body))


def burst(rec: Recorder, seconds: float = 10.0, clients: int = 64) -> None:
    stop = threading.Event()
    threads = [loop(stop, lambda: rec.timed("burst", lambda: fetch("/v2/models/simple/infer", SIMPLE)))
               for _ in range(clients)]
    time.sleep(seconds)  # the burst's length
    stop.set()
    for thread in threads:
        thread.join(60)


def minute_rows(rec: Recorder, start: float, memory: dict[int, float], cpu: dict[int, tuple[float, float, float]],
                probe: list[tuple[float, float]]) -> list[dict]:
    """Per minute: the calls' figures, memory, and (``cpu``: server, client and steal CPU
    seconds at each minute's end) the CPU each call cost and the machine probe's median."""
    by_minute: dict[int, list] = defaultdict(list)
    for t, kind, seconds, outcome in rec.calls:
        by_minute[int((t - start) // 60)].append((kind, seconds, outcome))
    probe_by_minute: dict[int, list[float]] = defaultdict(list)
    for at, ms in probe:
        probe_by_minute[int((at - start) // 60)].append(ms)
    rows = []
    for minute in sorted(by_minute):
        calls = by_minute[minute]
        infer = [s for kind, s, outcome in calls if kind == "infer" and outcome == "ok"]
        errors = Counter(outcome for _, _, outcome in calls if outcome not in ("ok", "refused"))
        used = [b - a for a, b in zip(cpu[minute], cpu[minute + 1])] if minute in cpu and minute + 1 in cpu \
            else [float("nan")] * 3
        rows.append({
            "minute": minute + 1, "calls": len(calls), "refused": sum(o == "refused" for _, _, o in calls),
            "errors": sum(errors.values()), "error_kinds": errors.most_common(3),
            "p50_ms": percentile(infer, 0.5), "p99_ms": percentile(infer, 0.99),
            "pss_mib": memory.get(minute + 1, float("nan")),
            "server_cpu_s": used[0], "client_cpu_s": used[1], "steal_s": used[2],
            "server_cpu_ms_per_call": used[0] * 1000 / len(calls),
            "probe_ms": float(np.median(probe_by_minute[minute])) if probe_by_minute[minute] else float("nan"),
        })
    return rows


def summary(rows: list[dict], args: argparse.Namespace) -> str:
    def window(part: list[dict]) -> str:
        calls, errors = sum(r["calls"] for r in part), sum(r["errors"] for r in part)
        p50 = np.median([r["p50_ms"] for r in part])
        p99 = np.median([r["p99_ms"] for r in part])
        per_call = np.nanmedian([r["server_cpu_ms_per_call"] for r in part])
        probe = np.nanmedian([r["probe_ms"] for r in part])
        return (f"{calls:,} | {errors} | {sum(r['refused'] for r in part):,} | {p50:.1f} | {p99:.1f} | "
                f"{part[-1]['pss_mib']:,.0f} | {per_call:.3f} | {probe:.1f}")

    kinds = Counter()
    for r in rows:
        kinds.update(dict(r["error_kinds"]))
    growth = (rows[-1]["pss_mib"] - rows[0]["pss_mib"]) / max(len(rows) - 1, 1) * 60
    lines = [
        MARKS[0],
        f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} cores ({platform.machine()}): {len(rows)} minutes "
        "of mixed traffic (HTTP JSON, HTTP binary, gRPC BYTES, metadata and metrics reads, a Python model unloaded "
        f"and loaded every {args.reload_every_s:.0f} s, a 64-client burst of 10 s every {args.burst_every_s / 60:.0f} "
        "minutes over `--max-inflight-requests 32`).",
        "",
        "| minutes | calls | errors | refused (503, bursts) | infer p50 (ms, median of minutes) | infer p99 (ms) | "
        "server PSS at the end (MiB) | server CPU per call (ms) | machine probe (CPU ms of fixed work) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| first 5 | {window(rows[:5])} |",
        f"| last 5 | {window(rows[-5:])} |",
        f"| all {len(rows)} | {window(rows)} |",
        "",
        f"Memory growth from minute 1 to minute {len(rows)}: {growth:+.0f} MiB per hour. "
        f"Errors by kind: {', '.join(f'{n} x {k}' for k, n in kinds.most_common(5)) or 'none'}.",
        "",
        "Reproduce: `.venv/bin/python benchmarks/soak.py` (per-minute rows are printed).",
        MARKS[1],
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--reload-every-s", type=float, default=30.0)
    parser.add_argument("--burst-every-s", type=float, default=300.0)
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    if not in_private_netns():
        reexec_in_netns()
    repo = Path(tempfile.mkdtemp(prefix="soak-"))
    write_example_repository(repo)
    before = set(processes())
    load = [a for m in ("simple", "simple_string", "mlp", "simple_identity") for a in ("--load-model", m)]
    proc = start_rayinfer(repo, PORT, repo / "rayinfer.log", ("--model-control-mode", "explicit", *load,
                                                               "--max-inflight-requests", str(BURST_LIMIT)))
    rec, memory, cpu, stop = Recorder(), {}, CpuClock(before), threading.Event()
    probe = MachineProbe()
    try:
        wait_ready(PORT, proc, 600)
        start = time.monotonic()
        cpu.take(0)
        threads = start_traffic(stop, rec)
        end, next_minute = start + args.minutes * 60, start + 60
        next_reload, next_burst = start + args.reload_every_s, start + args.burst_every_s
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_minute:
                minute = int(round((now - start) / 60))
                cpu.take(minute)
                memory[minute] = server_memory(before)["pss_mib"]
                next_minute += 60
            if now >= next_reload:
                reload_identity(rec)
                next_reload += args.reload_every_s
            if now >= next_burst:
                burst(rec)
                next_burst += args.burst_every_s
            time.sleep(0.2)  # the schedule's tick: minutes, reloads and bursts are due by the clock
        minute = int(round((time.monotonic() - start) / 60))
        cpu.take(minute)
        memory[minute] = server_memory(before)["pss_mib"]
        stop.set()
        for thread in threads:
            thread.join(60)
        hung = sum(thread.is_alive() for thread in threads)
    finally:
        probe.stop()
        stop_server(proc)
    # The calls still answered after the end fall in one more, partial minute: left out.
    rows = [row for row in minute_rows(rec, start, memory, cpu.at, probe.samples) if row["minute"] <= round(args.minutes)]
    for row in rows:
        print(row, flush=True)
    section = summary(rows, args)
    if hung:
        section = section.replace("Reproduce:", f"{hung} client thread(s) still in a call at the end. Reproduce:")
    print(section)
    write_doc(section, args.output, MARKS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
