#!/usr/bin/env python3
"""Overload: far more clients than the server admits at once, with and without
``--max-inflight-requests``.

    .venv/bin/python benchmarks/overload.py [--clients 8,512] [--limit 64] [--seconds 20]

Serves the example repository's ``simple`` (explicit mode, one replica) inside a private network
namespace, twice: with ``--max-inflight-requests LIMIT`` and with no effective limit (2^31 - 1).
Each run drives every ``--clients`` level for ``--seconds``: that many HTTP/1.1 keep-alive
connections, each sending one infer request after another; a client answered 503 waits
``--backoff-ms`` before its next request (as a retrying client would). For each level: admitted
calls per second, their p50 / p99 latency, refusals per second and how fast they came back, other
failures, and the server's memory (PSS of its processes) at the end of the level. Writes the
table to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from compare_triton import ROOT, in_private_netns, processes, reexec_in_netns, start_rayinfer, stop_server, wait_ready, write_doc
from scaling import server_memory

from rayinfer.cluster.example_repository import write_example_repository

PORT = 18800
MARKS = ("<!-- overload:begin -->", "<!-- overload:end -->")
BODY = json.dumps({"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}
                              for n in ("INPUT0", "INPUT1")]}).encode()
REQUEST = (b"POST /v2/models/simple/infer HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
           b"content-length: %d\r\n\r\n%b" % (len(BODY), BODY))
NO_LIMIT = 2**31 - 1


async def client(deadline: float, backoff_s: float, record: list[tuple[int | str, float]]) -> None:
    """One keep-alive connection calling ``simple`` until ``deadline``; (status, seconds) per call
    (the exception's name when the connection failed)."""
    reader = writer = None
    while time.monotonic() < deadline:
        start = time.monotonic()
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", PORT)
            writer.write(REQUEST)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            status = int(head.split(b" ", 2)[1])
            length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                          if line.startswith(b"content-length:"))
            await reader.readexactly(length)
            if b"connection: close" in head.lower():
                writer.close()
                writer = None
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, StopIteration, ValueError) as exc:
            status = type(exc).__name__
            if writer is not None:
                writer.close()
            writer = None
        record.append((status, time.monotonic() - start))
        if status == 503:
            await asyncio.sleep(backoff_s)  # a retrying client backs off after a refusal
    if writer is not None:
        writer.close()


def percentile(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] * 1000 if values else float("nan")


def drive(clients: int, seconds: float, backoff_s: float) -> list[tuple[int | str, float]]:
    record: list[tuple[int | str, float]] = []

    async def run() -> None:
        deadline = time.monotonic() + seconds
        await asyncio.gather(*(client(deadline, backoff_s, record) for _ in range(clients)))

    asyncio.run(run())
    return record


def run_server(limit: int, levels: list[int], seconds: float, backoff_s: float) -> list[dict]:
    repo = Path(tempfile.mkdtemp(prefix="overload-"))
    write_example_repository(repo)
    before = set(processes())
    proc = start_rayinfer(repo, PORT, repo / "rayinfer.log", (
        "--model-control-mode", "explicit", "--load-model", "simple", "--replica-num-cpus", "0.1",
        "--max-inflight-requests", str(limit)))
    rows = []
    try:
        wait_ready(PORT, proc, 300)
        drive(8, 3, backoff_s)  # warm up
        idle = server_memory(before)["pss_mib"]
        for clients in levels:
            record = drive(clients, seconds, backoff_s)
            ok = [s for status, s in record if status == 200]
            busy = [s for status, s in record if status == 503]
            rows.append({
                "limit": limit, "clients": clients, "ok_per_s": len(ok) / seconds,
                "ok_p50_ms": percentile(ok, 0.5), "ok_p99_ms": percentile(ok, 0.99),
                "refused_per_s": len(busy) / seconds, "refused_p50_ms": percentile(busy, 0.5),
                "refused_p99_ms": percentile(busy, 0.99),
                "other": Counter(status for status, _ in record if status not in (200, 503)),
                "idle_pss_mib": idle, "pss_mib": server_memory(before)["pss_mib"],
            })
            print(rows[-1], flush=True)
    finally:
        stop_server(proc)
    return rows


def table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        MARKS[0],
        f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} cores ({platform.machine()}): `simple`, one "
        f"replica, HTTP/1.1 keep-alive clients for {args.seconds:.0f} s per level; a client answered 503 waits "
        f"{args.backoff_ms:.0f} ms before its next call.",
        "",
        "| --max-inflight-requests | clients | admitted/s | admitted p50 / p99 (ms) | refused (503)/s | "
        "refusal p50 / p99 (ms) | other failures | server PSS idle → end (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        limit = "none (2^31-1)" if r["limit"] == NO_LIMIT else str(r["limit"])
        other = ", ".join(f"{n} x {s}" for s, n in r["other"].items()) or "0"
        refusal = f"{r['refused_p50_ms']:.1f} / {r['refused_p99_ms']:.1f}" if r["refused_per_s"] else "-"
        lines.append(f"| {limit} | {r['clients']} | {r['ok_per_s']:,.0f} | {r['ok_p50_ms']:.1f} / {r['ok_p99_ms']:.1f} "
                     f"| {r['refused_per_s']:,.0f} | {refusal} | {other} | {r['idle_pss_mib']:,.0f} → "
                     f"{r['pss_mib']:,.0f} |")
    lines += ["", "Reproduce: `.venv/bin/python benchmarks/overload.py`", MARKS[1]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="8,512", help="client counts, comma-separated")
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--backoff-ms", type=float, default=50.0)
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    if not in_private_netns():
        reexec_in_netns()
    levels = [int(c) for c in args.clients.split(",")]
    rows = []
    for limit in (args.limit, NO_LIMIT):
        rows += run_server(limit, levels, args.seconds, args.backoff_ms / 1000)
    section = table(rows, args)
    print(section)
    write_doc(section, args.output, MARKS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
