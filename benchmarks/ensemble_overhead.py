#!/usr/bin/env python3
"""What an ensemble adds to its members' own work, in one process: no HTTP, no Ray.

    .venv/bin/python benchmarks/ensemble_overhead.py [--requests 8000] [--concurrency 8] [--repeats 2]
        [--profile tottime|cumtime]

Writes the repository of ``benchmarks/ensemble_cost.py`` (``mlp``: ONNX with dynamic batching,
500 us delay; ``scale``: a Python model, the same batching; ``mlp_pipeline``: ``scale`` then
``mlp``), loads ``mlp`` and ``scale`` into serving cores in this process, and runs
``mlp_pipeline``'s executor with its steps calling those cores directly: what an ensemble with
``steps_in_place`` does in its replica, without the listener in front. ``--concurrency``
coroutines send batch-1 requests back to back on one uvloop event loop; prints the CPU time of
this process per request (``time.process_time``; a batcher waiting out its delay by yielding to
the loop counts as busy) and the requests per second, for ``mlp`` alone and for the ensemble,
alternated ``--repeats`` times. ``--profile`` then runs the ensemble once more under cProfile
and prints its 40 costliest functions by that sort key.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import uvloop

from ensemble_cost import write_repository
from rayinfer.adapters.loader import load_runner
from rayinfer.protocol.types import InferInput, InferRequest, InferResponse
from rayinfer.repository.ensemble import parse_ensemble
from rayinfer.repository.model_config import CONFIG_FILENAME, spec_from_config
from rayinfer.repository.scanner import scan_model
from rayinfer.serving.ensemble import EnsembleExecutor
from rayinfer.serving.model_core import ModelCore

ENSEMBLE = "mlp_pipeline"


def cores(root: Path) -> dict[str, ModelCore]:
    """``mlp``, ``scale`` and the ensemble, its steps calling the other two in process."""
    members = {name: ModelCore(load_runner(root, name, 1)[0], [1]) for name in ("mlp", "scale")}

    async def call(request: InferRequest) -> InferResponse:
        core = members[request.model_name]
        return await core.infer(core.prepare(request))

    entry = scan_model(root / ENSEMBLE)
    assert entry.config is not None
    spec = spec_from_config(entry.config, root / ENSEMBLE / CONFIG_FILENAME)
    executor = EnsembleExecutor(spec, parse_ensemble(entry.config, root / ENSEMBLE), 1, call)
    return {**members, ENSEMBLE: ModelCore(executor, [1])}


async def drive(core: ModelCore, requests: int, concurrency: int) -> None:
    x = np.random.default_rng(0).random((1, 256), dtype=np.float32)

    async def client() -> None:
        for _ in range(requests // concurrency):
            request = InferRequest(core.name, "", inputs=[InferInput("INPUT0", "FP32", (1, 256), x)])
            await core.infer(core.prepare(request))

    await asyncio.gather(*(client() for _ in range(concurrency)))


async def measure(core: ModelCore, requests: int, concurrency: int) -> tuple[float, float]:
    """(CPU us per request, requests per second) after a warm-up of a tenth as many."""
    await drive(core, requests // 10, concurrency)
    cpu, wall = time.process_time(), time.perf_counter()
    await drive(core, requests, concurrency)
    return (time.process_time() - cpu) / requests * 1e6, requests / (time.perf_counter() - wall)


async def run(args: argparse.Namespace, served: dict[str, ModelCore]) -> None:
    rows = []
    for _ in range(args.repeats):
        for name in ("mlp", ENSEMBLE):
            cpu_us, rate = await measure(served[name], args.requests, args.concurrency)
            rows.append((name, cpu_us, rate))
            print(f"  {name}: {cpu_us:.0f} us CPU per request, {rate:,.0f} requests/s", flush=True)
    print("\n| what | CPU per request (us) | requests/s |\n|---|---|---|")
    for name in ("mlp", ENSEMBLE):
        mine = [r for r in rows if r[0] == name]
        print(f"| `{name}` | {' / '.join(f'{r[1]:.0f}' for r in mine)} | {' / '.join(f'{r[2]:,.0f}' for r in mine)} |")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        await drive(served[ENSEMBLE], args.requests, args.concurrency)
        profiler.disable()
        pstats.Stats(profiler).sort_stats(args.profile).print_stats(40)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile", choices=("tottime", "cumtime"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rayinfer-ensemble-overhead-") as tmp:
        write_repository(Path(tmp))
        served = cores(Path(tmp))
        uvloop.run(run(args, served))
        for core in served.values():
            core.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
