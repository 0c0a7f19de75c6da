#!/usr/bin/env python3
"""CPU per request of every process while perf_analyzer drives rayinfer, per protocol.

    .venv/bin/python benchmarks/cpu_per_request.py [--protocols http,grpc] [--concurrency 8]

Writes the example repository to a temporary folder, starts ``rayinfer serve`` on it inside a
private network namespace, warms up, then runs NVIDIA's perf_analyzer (from the Triton anchor,
``../shared/anchors/triton``) against the ``mlp`` model for each protocol and prints, from
/proc, the CPU each process used per successful request in the measured window.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from compare_triton import ANCHORS, in_private_netns, reexec_in_netns

PORT = 18300
MODEL = "mlp"


def cpu_ticks() -> dict[int, tuple[int, str]]:
    """{pid: (user + system clock ticks, command line)} for every process."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(pid)] = (int(fields[11]) + int(fields[12]), cmd.strip()[:80])
    return out


def success_count() -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v2/models/{MODEL}/stats") as r:
        return json.load(r)["model_stats"][0]["inference_stats"]["success"]["count"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocols", default="http,grpc")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seconds", type=int, default=4)
    args = parser.parse_args()
    if not in_private_netns():
        reexec_in_netns()
    bin_dir = Path(sys.executable).parent
    tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
    with tempfile.TemporaryDirectory(prefix="rayinfer-cpu-") as tmp:
        repo = Path(tmp) / "repo"
        subprocess.run([str(bin_dir / "rayinfer"), "example-repository", str(repo)], check=True, capture_output=True)
        log_path = Path(tmp) / "rayinfer.log"
        with log_path.open("w") as log:
            server = subprocess.Popen(
                [str(bin_dir / "rayinfer"), "serve", "--model-repository", str(repo), "--http-port", str(PORT),
                 "--grpc-port", str(PORT + 1), "--metrics-port", str(PORT + 2), "--serve-grpc-port", str(PORT + 11),
                  "--serve-http-port", str(PORT + 10)],
                stdout=log, stderr=subprocess.STDOUT,
            )
        try:
            while "Started HTTPService" not in log_path.read_text():
                if server.poll() is not None:
                    raise RuntimeError(log_path.read_text()[-3000:])
                time.sleep(0.5)
            for protocol in args.protocols.split(","):
                port = PORT if protocol == "http" else PORT + 1
                command = [str(ANCHORS / "triton" / "perf_analyzer"), "-m", MODEL, "-u", f"127.0.0.1:{port}",
                           "-i", protocol, "--concurrency-range", f"{args.concurrency}:{args.concurrency}",
                           "--stability-percentage", "80", "--max-trials", "3"]
                subprocess.run([*command, "--measurement-interval", "2000"], capture_output=True)  # warm-up
                time.sleep(1)
                before_n, before = success_count(), cpu_ticks()
                result = subprocess.run([*command, "--measurement-interval", str(args.seconds * 1000)],
                                        capture_output=True, text=True)
                time.sleep(1.5)  # replicas report statistics every half second
                requests, after = success_count() - before_n, cpu_ticks()
                line = next((x for x in result.stdout.splitlines() if f"Concurrency: {args.concurrency}," in x), "?")
                print(f"== {protocol}: {requests} requests in the window; perf_analyzer: {line.strip()}")
                rows = sorted(((ticks - before.get(pid, (0, ""))[0]) * tick_us / requests, cmd)
                              for pid, (ticks, cmd) in after.items() if ticks > before.get(pid, (0, ""))[0])
                for us, cmd in reversed(rows[-10:]):
                    print(f"  {us:7.0f} us/request  {cmd}")
                print(f"  {sum(us for us, _ in rows):7.0f} us/request in all")
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(90)
    return 0


if __name__ == "__main__":
    sys.exit(main())
