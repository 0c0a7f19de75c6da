#!/usr/bin/env python3
"""The model replica's request path alone: its listener, serving core and model in one process,
without Ray, Serve or the front, driven over HTTP by NVIDIA's perf_analyzer.

    .venv/bin/python benchmarks/replica_alone.py [--model identity_fp32] [--concurrency 8] [--seconds 8]

Loads one model of the Triton anchor's repository (``../shared/anchors/models``) with the same
loader and core as a model replica, puts :class:`ReplicaListener` on a loopback port (it answers
the model's infer and GET routes; ``GET /v2`` is answered here for perf_analyzer), runs
perf_analyzer against it and prints perf_analyzer's throughput and the listener process's CPU
per request over ``--seconds`` of that load, from /proc, and how many times Python's garbage
collector ran in that window (per generation; requests that leave no reference cycles make it
run not at all). The upper bound of one replica's throughput on one core, and what a change to
the request path saves, without the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ANCHORS = ROOT.parent / "shared" / "anchors"


def serve(model: str, port_file: Path) -> None:
    """Runs in the child process: the listener on an ephemeral port, written to ``port_file``."""
    import uvloop

    from rayinfer.adapters.loader import load_runner
    from rayinfer.transport.replica_listener import ReplicaListener
    from rayinfer.serving import model_grpc, model_http
    from rayinfer.serving.model_core import ModelCore
    from rayinfer.serving.routes import parse_model_route

    repository = Path(tempfile.mkdtemp(prefix="replica-alone-"))
    shutil.copytree(ANCHORS / "models" / model, repository / model)
    server_metadata = json.dumps({"name": "triton", "version": "2.51.0", "extensions": []}).encode()

    async def main() -> None:
        runner, entry = load_runner(repository, model, 1)
        core = ModelCore(runner, entry.versions)

        async def http(method: str, path: str, headers: dict[bytes, bytes], body: bytes):
            route = parse_model_route(path, encoded=True)
            if route is None:  # perf_analyzer asks the server's metadata first
                return 200, [(b"content-type", b"application/json")], server_metadata
            return await model_http.respond(core, method, route, headers, body)

        async def grpc(method: str, payload: bytes) -> bytes:
            return await model_grpc.call_serialized(core, method, payload)

        listener = ReplicaListener(grpc, http)
        gc_file = port_file.with_suffix(".gc")  # SIGUSR1: the collector's runs so far, per generation

        def report_gc() -> None:  # written whole, then renamed: the parent never reads half a file
            partial = gc_file.with_suffix(".partial")
            partial.write_text(json.dumps([generation["collections"] for generation in gc.get_stats()]))
            partial.replace(gc_file)

        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, report_gc)
        port_file.write_text(str(await listener.start("127.0.0.1")))
        await asyncio.Event().wait()

    uvloop.run(main())


def cpu_ticks(pid: int) -> tuple[int, int]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])  # utime, stime


def gc_collections(pid: int, port_file: Path) -> list[int]:
    """The listener process's garbage collector runs so far, per generation."""
    gc_file = port_file.with_suffix(".gc")
    gc_file.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while not gc_file.exists():  # polled until the deadline: the child answers within milliseconds
        if time.monotonic() > deadline:
            raise SystemExit("the listener did not report its garbage collector's runs")
        time.sleep(0.01)
    return json.loads(gc_file.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="identity_fp32", help="a model folder of the anchor's repository")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=8.0, help="the window CPU is measured over")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the child process: a file for the port
    args = parser.parse_args()
    if args.serve:
        serve(args.model, Path(args.serve))
        return 0
    port_file = Path(tempfile.mkdtemp()) / "port"
    child = subprocess.Popen([sys.executable, __file__, "--model", args.model, "--serve", str(port_file)])
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            if child.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the listener did not start")
            time.sleep(0.2)
        port = port_file.read_text()
        interval_ms = int(args.seconds * 1000 / 2)
        load = subprocess.Popen(
            [str(ANCHORS / "triton" / "perf_analyzer"), "-m", args.model, "-u", f"127.0.0.1:{port}", "-i", "http",
             "--concurrency-range", f"{args.concurrency}:{args.concurrency}", "--measurement-interval",
             str(interval_ms), "--stability-percentage", "50", "--max-trials", "6"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        time.sleep(2.0)  # past perf_analyzer's warm-up
        user0, system0 = cpu_ticks(child.pid)
        gc0 = gc_collections(child.pid, port_file)
        time.sleep(args.seconds)
        user1, system1 = cpu_ticks(child.pid)
        gc1 = gc_collections(child.pid, port_file)
        output = load.communicate(timeout=600)[0]
        found = re.findall(r"Throughput: ([\d.]+) infer/sec", output)
        if not found:
            print(output[-2000:])
            return 1
        throughput = float(found[-1])
        per_tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
        requests = throughput * args.seconds
        user_us, system_us = (user1 - user0) * per_tick_us / requests, (system1 - system0) * per_tick_us / requests
        print(f"{args.model}, HTTP, concurrency {args.concurrency}: {throughput:,.0f} infer/s; the listener's "
              f"process used {user_us + system_us:.0f} us of CPU per request ({user_us:.0f} user, "
              f"{system_us:.0f} system) over {args.seconds:g} s; the garbage collector ran "
              f"{'/'.join(str(b - a) for a, b in zip(gc0, gc1))} times (generations 0/1/2)")
        return 0
    finally:
        child.terminate()
        child.wait(10)


if __name__ == "__main__":
    sys.exit(main())
