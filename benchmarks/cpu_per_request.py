#!/usr/bin/env python3
"""CPU per request of every process while perf_analyzer drives rayinfer, per protocol.

    .venv/bin/python benchmarks/cpu_per_request.py [--protocols http,grpc] [--concurrency 8] [--profile [--native]]
        [--model mlp|identity_fp32] [--profile-app rayinfer] [--env NAME=VALUE ...] [--server rayinfer|triton]

Writes the example repository to a temporary folder, starts ``rayinfer serve`` on it inside a
private network namespace, warms up, then runs NVIDIA's perf_analyzer (from the Triton anchor,
``../shared/anchors/triton``) against the ``mlp`` model (or the anchor's Python model
``identity_fp32``, copied into the repository) for each protocol and prints, from
/proc, the CPU each process used per successful request in the measured window, with
perf_analyzer's throughput, p50 and p99. ``--env`` sets environment variables for the server
(and so for Ray's processes), to compare settings such as ``RAY_SERVE_CONTROL_LOOP_INTERVAL_S``
run against run. With ``--profile``, a second window under the same load samples the model replica with py-spy and
prints its busy time by component and its hottest functions (``--native`` adds C frames, but
stops the process for each sample, which favours samples at system calls).

``--server triton`` measures the Triton anchor the same way instead, on a repository holding only
``--model`` (``identity_fp32``; the anchor's ``mlp_onnx`` for ``mlp``): tritonserver and its Python
stub processes are listed like rayinfer's.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from compare_triton import (
    ANCHOR_HOME,
    ANCHORS,
    ensure_anchor,
    in_private_netns,
    perf_analyzer_command,
    processes,
    reexec_in_netns,
    start_rayinfer,
    stop_server,
    wait_ready,
)

PORT = 18300
MODELS = ("mlp", "identity_fp32")


def cpu_ticks() -> dict[int, tuple[int, str]]:
    """{pid: (user + system clock ticks, command line)} for every process."""
    out = {}
    for pid, cmd in processes().items():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:  # exited since
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[pid] = (int(fields[11]) + int(fields[12]), cmd.strip()[:80])
    return out


def success_count(model: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v2/models/{model}/stats") as r:
        return json.load(r)["model_stats"][0]["inference_stats"]["success"]["count"]


# Where a sampled frame's file lies -> what it belongs to (first match wins; checked innermost first).
COMPONENTS = [
    ("onnxruntime", "onnxruntime (the model itself)"),
    ("(model.py", "the Python model itself (model.py)"),
    ("(adapters/python_backend/", "rayinfer: the Python backend (pb_utils, requests, responses)"),
    ("(protocol/", "rayinfer: v2 / gRPC decoding and encoding"),
    ("(deployments/replica_listener", "rayinfer: the replica's listener (httptools)"),
    ("(serving/batcher", "rayinfer: batcher (merge, split, queue)"),
    ("(serving/", "rayinfer: serving core (routing, dispatch, statistics)"),
    ("(deployments/", "rayinfer: model deployment (entry points, reporting)"),
    ("(adapters/", "rayinfer: model runner and ONNX Runtime adapter (validation, merge, split)"),
    ("httptools", "httptools (HTTP parsing)"),
    ("(numpy/", "numpy"),
    ("(google/protobuf/", "protobuf"),
    ("(ray/", "Ray (Serve, core worker, metrics)"),
    ("uvloop", "uvloop / asyncio"),
    ("(asyncio/", "uvloop / asyncio"),
    ("(json/", "json (standard library)"),
    ("(threading.py", "native code under a thread's run() (uvloop, socket calls, asyncio's C tasks)"),
]


def profile(pid: int, seconds: int, out: Path, native: bool = False) -> None:
    """Samples ``pid`` with py-spy (busy threads only) and prints its CPU by component and by function."""
    py_spy = Path(sys.executable).parent / "py-spy"
    subprocess.run([str(py_spy), "record", "-p", str(pid), "-d", str(seconds), "-r", "250", "-f", "raw",
                    "-o", str(out), *(["--native"] if native else ["--nonblocking"])],
                   capture_output=True, check=True)
    by_component: dict[str, int] = {}
    by_function: dict[str, int] = {}
    total = 0
    for line in out.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        count = int(count_text)
        frames = stack.split(";")
        total += count
        innermost = frames[-1]
        by_function[innermost] = by_function.get(innermost, 0) + count
        owner = next((name for frame in reversed(frames) for marker, name in COMPONENTS if marker in frame),
                     "other (Python itself, the standard library)")
        by_component[owner] = by_component.get(owner, 0) + count
    print(f"  raw stacks: {out}")
    print(f"  py-spy, pid {pid}: {total} busy samples in {seconds} s at 250 Hz "
          f"({total / (250 * seconds):.0%} of one core); by component (innermost known frame):")
    for name, count in sorted(by_component.items(), key=lambda kv: -kv[1]):
        print(f"    {count / total:5.1%}  {name}")
    print("  hottest functions (own time):")
    for name, count in sorted(by_function.items(), key=lambda kv: -kv[1])[:15]:
        print(f"    {count / total:5.1%}  {name}")


def replica_pid(model: str) -> int:
    for pid, cmd in processes().items():
        if cmd.startswith(f"ray::ServeReplica:{model}:"):
            return pid
    raise RuntimeError(f"no replica process of {model}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocols", default="http,grpc")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=int, default=4)
    parser.add_argument("--model", choices=MODELS, default="mlp")
    parser.add_argument("--profile", action="store_true",
                        help="also sample the model replica with py-spy during a second window")
    parser.add_argument("--native", action="store_true", help="with --profile: include native (C) frames")
    parser.add_argument("--profile-app", default=None, metavar="APP",
                        help="with --profile: sample this application's replica instead of the model's "
                             "(rayinfer: the /v2 replica)")
    parser.add_argument("--server", choices=("rayinfer", "triton"), default="rayinfer")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for the server and Ray's processes (repeatable)")
    args = parser.parse_args()
    server_env = dict(os.environ)
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            parser.error(f"--env takes NAME=VALUE, got {item!r}")
        server_env[name] = value
    if not in_private_netns():
        ensure_anchor()
        reexec_in_netns()
    bin_dir = Path(sys.executable).parent
    tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
    with tempfile.TemporaryDirectory(prefix="rayinfer-cpu-") as tmp:
        repo = Path(tmp) / "repo"
        server = None
        if args.server == "triton":
            model = args.model if args.model == "identity_fp32" else "mlp_onnx"
            shutil.copytree(ANCHORS / "models" / model, repo / model)
            if model == "mlp_onnx":
                subprocess.run([str(ANCHOR_HOME / "venv" / "bin" / "python"), str(ANCHORS / "models" / "make_mlp_onnx.py"),
                                str(repo / model / "1" / "model.onnx")], check=True, capture_output=True)
            for path in [repo, *repo.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
            subprocess.run([str(ANCHORS / "triton" / "start"), str(repo), str(PORT)], check=True, capture_output=True)
        else:
            model = args.model
            subprocess.run([str(bin_dir / "rayinfer"), "example-repository", str(repo)], check=True, capture_output=True)
            if args.model == "identity_fp32":
                shutil.copytree(ANCHORS / "models" / "identity_fp32", repo / "identity_fp32")
            server = start_rayinfer(repo, PORT, Path(tmp) / "rayinfer.log", env=server_env)
        try:
            if server is not None:
                wait_ready(PORT, server, 300)
            for protocol in args.protocols.split(","):
                def command(interval_ms: int, protocol: str = protocol) -> list[str]:
                    return perf_analyzer_command(PORT, model, protocol, args.concurrency, interval_ms, 80, 3)

                subprocess.run(command(2000), capture_output=True)  # warm-up
                time.sleep(1)
                before_n, before = success_count(model), cpu_ticks()
                out_csv = Path(tmp) / "perf.csv"
                result = subprocess.run([*command(args.seconds * 1000), "-f", str(out_csv)],
                                        capture_output=True, text=True)
                time.sleep(1.5)  # replicas report statistics every half second
                requests, after = success_count(model) - before_n, cpu_ticks()
                line = next((x for x in result.stdout.splitlines() if f"Concurrency: {args.concurrency}," in x), "?")
                print(f"== {protocol}: {requests} requests in the window; perf_analyzer: {line.strip()}")
                if result.returncode == 0:
                    with out_csv.open() as f:
                        row = next(csv.DictReader(f))
                    print(f"  {float(row['Inferences/Second']):,.0f} infer/s, p50 {int(row['p50 latency']):,} us, "
                          f"p99 {int(row['p99 latency']):,} us")
                rows = sorted(((ticks - before.get(pid, (0, ""))[0]) * tick_us / requests, cmd)
                              for pid, (ticks, cmd) in after.items() if ticks > before.get(pid, (0, ""))[0])
                for us, cmd in reversed(rows[-10:]):
                    print(f"  {us:7.0f} us/request  {cmd}")
                print(f"  {sum(us for us, _ in rows):7.0f} us/request in all")
                if args.profile:
                    load = subprocess.Popen(command(args.seconds * 1000), stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)
                    try:
                        time.sleep(1)
                        raw = Path(tempfile.gettempdir()) / f"rayinfer-profile-{protocol}.txt"
                        profile(replica_pid(args.profile_app or model), args.seconds, raw, args.native)
                    finally:
                        load.kill()
                        load.wait()
        finally:
            if server is not None:
                stop_server(server)
            else:
                subprocess.run([str(ANCHORS / "triton" / "stop")], check=False, capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
