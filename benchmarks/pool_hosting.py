#!/usr/bin/env python3
"""The model pool's costs: a request for a model the pool had unloaded (cold load), and one busy
model's throughput in the pool against the same model with a replica of its own.

    .venv/bin/python benchmarks/pool_hosting.py [--models 20] [--max-models 5] [--requests 100]
        [--concurrency 8] [--interval-ms 3000] [--repeats 2]

Both servers serve the same repository: ``--models`` copies of the example's ``simple`` (an ONNX
add/sub of two 16-element INT32 vectors), every one loaded at start, ``--replica-num-cpus 0.01``.

- **dedicated**: each model a replica of its own (the default hosting).
- **pool**: ``--model-hosting pool --pool-max-models M``: one pool replica holding at most M
  models loaded.

Cold load: requests one at a time over the models in turn, so that each asks for the model the
pool unloaded longest ago (with M below the count, every request finds its model unloaded): the
client's latency of each, beside a loaded model's (the same model again). Throughput:
perf_analyzer on the first model at ``--concurrency`` over HTTP and gRPC, each point
``--repeats`` times, on each server; the pooled model stays loaded (a model with requests in
flight is never unloaded). Runs in a private network namespace; run it alone. Writes the tables
to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from compare_triton import (ROOT, ensure_anchor, in_private_netns, perf_analyzer, reexec_in_netns, start_rayinfer, stop_server,
                            wait_ready, write_doc)
from model_memory import write_repository

PORT = 18600
MARKS = ("<!-- pool_hosting:begin -->", "<!-- pool_hosting:end -->")
READY_TIMEOUT_S = 900.0


def add_sub_inputs(module, seed: int) -> list:
    inputs = []
    for name, value in (("INPUT0", np.full((1, 16), seed, np.int32)), ("INPUT1", np.ones((1, 16), np.int32))):
        tensor = module.InferInput(name, [1, 16], "INT32")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def latencies_ms(models: list[str], requests: int, protocol: str) -> list[float]:
    """Each request's latency (ms), one at a time, ``models`` asked in turn; every answer checked."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(f"127.0.0.1:{PORT + (protocol == 'grpc')}",
                                          **({"network_timeout": 120.0} if protocol == "http" else {}))
    out = []
    try:
        for i in range(requests):
            started = time.perf_counter()
            result = client.infer(models[i % len(models)], add_sub_inputs(module, i))
            out.append((time.perf_counter() - started) * 1000)
            if not (result.as_numpy("OUTPUT0") == i + 1).all():
                raise RuntimeError(f"{models[i % len(models)]}: a wrong answer")
    finally:
        client.close()
    return out


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def run_server(repo: Path, work: Path, flags: tuple[str, ...], steps) -> dict:
    proc = start_rayinfer(repo, PORT, work / "rayinfer.log",
                          ("--replica-num-cpus", "0.01", "--startup-timeout-s", str(READY_TIMEOUT_S), *flags))
    try:
        wait_ready(PORT, proc, READY_TIMEOUT_S)
        return steps()
    finally:
        stop_server(proc)


def throughput(model: str, args: argparse.Namespace, work: Path) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for protocol in ("http", "grpc"):
        out[protocol] = [perf_analyzer(PORT, model, protocol, args.concurrency, args.interval_ms,
                                       work / f"pa-{protocol}-{i}.csv")["infer_s"] for i in range(args.repeats)]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=int, default=20)
    parser.add_argument("--max-models", type=int, default=5)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--interval-ms", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    if not in_private_netns():
        ensure_anchor()  # perf_analyzer, installed while the package registries can be reached
        reexec_in_netns()
    if args.max_models >= args.models:
        parser.error("--max-models must be below --models for the cold loads")
    work = Path(tempfile.mkdtemp(prefix="pool-hosting-"))
    repo = write_repository(work / "repo", "onnx", args.models)
    models = sorted(p.name for p in repo.iterdir())
    hot = models[0]

    def pooled() -> dict:
        latencies_ms(models, len(models), "http")  # every model asked once: the pool's order is now the turn's
        figures = {"cold_http": latencies_ms(models, args.requests, "http"),
                   "cold_grpc": latencies_ms(models, args.requests, "grpc"),
                   "warm_http": latencies_ms([hot], args.requests, "http"),
                   "warm_grpc": latencies_ms([hot], args.requests, "grpc")}
        figures["throughput"] = throughput(hot, args, work)
        return figures

    def dedicated() -> dict:
        return {"throughput": throughput(hot, args, work)}

    pool = run_server(repo, work, ("--model-hosting", "pool", "--pool-max-models", str(args.max_models)), pooled)
    own = run_server(repo, work, (), dedicated)
    section = render(pool, own, args)
    print(section)
    write_doc(section, args.doc, MARKS)
    return 0


def render(pool: dict, own: dict, args: argparse.Namespace) -> str:
    lines = [
        MARKS[0],
        f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} cores ({platform.machine()}): {args.models} "
        f"copies of `simple`, the pool holding at most {args.max_models} loaded.",
        "",
        "| request (one at a time) | p50 (ms) | p99 (ms) |",
        "|---|---|---|",
    ]
    for protocol, label in (("http", "HTTP"), ("grpc", "gRPC")):
        for kind, what in (("cold", "a model the pool had unloaded (loads it again)"), ("warm", "a loaded model")):
            values = pool[f"{kind}_{protocol}"]
            lines.append(f"| {label}: {what} | {percentile(values, 50):.1f} | {percentile(values, 99):.1f} |")
    lines += [
        "",
        f"| one busy model, concurrency {args.concurrency} | dedicated (infer/s) | pooled (infer/s) | pooled / dedicated |",
        "|---|---|---|---|",
    ]
    for protocol, label in (("http", "HTTP"), ("grpc", "gRPC")):
        ours, theirs = pool["throughput"][protocol], own["throughput"][protocol]
        lines.append(f"| {label} | {' / '.join(f'{v:,.0f}' for v in theirs)} | {' / '.join(f'{v:,.0f}' for v in ours)} "
                     f"| {statistics.median(ours) / statistics.median(theirs):.2f} |")
    lines += [
        "",
        "Reproduce: `.venv/bin/python benchmarks/pool_hosting.py "
        f"--models {args.models} --max-models {args.max_models} --requests {args.requests} "
        f"--concurrency {args.concurrency} --interval-ms {args.interval_ms} --repeats {args.repeats}`",
        MARKS[1],
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
