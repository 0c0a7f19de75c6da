#!/usr/bin/env python3
"""Memory against the number of small models: the whole server's PSS with 1, 10, 25 ... models,
rayinfer beside the Triton anchor on the same repository, and what each model adds.

    .venv/bin/python benchmarks/model_memory.py [--counts 1,10,25] [--kinds onnx,onnx-pool,python,python-pool] [--no-triton]

Each point is a fresh server on a repository of ``count`` copies of one small model under their
own names, every one loaded at start (Triton's and rayinfer's default, model control none):

- ``onnx``: the example repository's ``simple`` (an ONNX add/sub of two 16-element INT32
  vectors). rayinfer only: the Triton anchor has the Python backend alone.
- ``python``: the anchor's ``identity_fp32`` (``model.py`` unmodified), for both servers.
- ``onnx-pool`` and ``python-pool``: the same repositories served with ``--model-hosting pool``:
  every model in the model pool's one replica instead of a replica each.

Memory is the PSS of every process the server started (for rayinfer: Ray's GCS, raylet and
agents, Serve's controller and proxy, the ``/v2`` replica, the front, every model replica; for
Triton: tritonserver and its Python-backend stubs), taken 10 s after the server is ready. PSS
splits shared pages between the processes that share them, so the sum is the server's footprint.
"Per model" is the growth from the first point to each later one divided by the models added.
rayinfer runs with ``--replica-num-cpus 0.01`` so that every replica fits the 2 CPUs of this
machine (each replica reserves that share; with the default 0.1 about 18 fit beside the server's
own). Both run in a private network namespace; run it alone (every Ray process started meanwhile
counts). Writes the table to docs/benchmarks.md and its plot to docs/images/model_memory.png.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from compare_triton import (ANCHORS, PYTHON_MODEL, ROOT, ensure_anchor, ensure_installed, in_private_netns, processes, reexec_in_netns,
                            start_rayinfer, start_triton, stop_server, stop_triton, wait_ready, write_doc)
from scaling import memory_kib

RAYINFER_PORT = 18600
TRITON_PORT = 18700
MARKS = ("<!-- model_memory:begin -->", "<!-- model_memory:end -->")
SETTLE_S = 10.0
READY_TIMEOUT_S = 1800.0


def write_repository(root: Path, kind: str, count: int) -> Path:
    """``count`` copies of the kind's model, named ``<kind>_000`` and on."""
    from rayinfer.cluster.example_repository import SIMPLE_CONFIG, add_sub_model, write_model
    from onnx import TensorProto

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for i in range(count):
        name = f"{kind.replace('-', '_')}_{i:03d}"
        if kind.startswith("onnx"):
            write_model(root, name, SIMPLE_CONFIG.replace('name: "simple"', f'name: "{name}"'),
                        add_sub_model(TensorProto.INT32))
        else:
            shutil.copytree(ANCHORS / "models" / PYTHON_MODEL, root / name)
            config = root / name / "config.pbtxt"
            config.write_text(config.read_text().replace(f'name: "{PYTHON_MODEL}"', f'name: "{name}"'))
    return root


def server_pss_mib(before: set[int], marks: tuple[str, ...]) -> tuple[float, int]:
    """(PSS in MiB, processes) of the processes started since ``before`` whose command line holds one of ``marks``."""
    total = count = 0
    for pid, cmd in processes().items():
        if pid in before or not any(mark in cmd for mark in marks):
            continue
        figures = memory_kib(pid)
        if figures is not None:
            total += figures[0]
            count += 1
    return total / 1024, count


def measure(start: Callable[[], subprocess.Popen], stop: Callable[[subprocess.Popen], None], port: int,
            marks: tuple[str, ...]) -> tuple[float, int, float]:
    """(PSS MiB, processes, seconds to ready) of the server ``start`` starts on ``port``: its
    processes are those new since the start whose command line holds one of ``marks``."""
    before = set(processes())
    started = time.monotonic()
    proc = start()
    try:
        wait_ready(port, proc, READY_TIMEOUT_S)
        ready_s = time.monotonic() - started
        time.sleep(SETTLE_S)
        pss, count = server_pss_mib(before, marks)
        return pss, count, ready_s
    finally:
        stop(proc)


def measure_rayinfer(repo: Path, work: Path, pooled: bool = False) -> tuple[float, int, float]:
    """rayinfer serving ``repo`` (:func:`measure`), its models in the pool when ``pooled``."""
    flags = ("--replica-num-cpus", "0.01", "--startup-timeout-s", str(READY_TIMEOUT_S),
             *(("--model-hosting", "pool") if pooled else ()))
    return measure(lambda: start_rayinfer(repo, RAYINFER_PORT, work / "rayinfer.log", flags), stop_server,
                   RAYINFER_PORT, ("ray", "haproxy"))


def measure_triton(repo: Path, work: Path) -> tuple[float, int, float]:
    """The anchor's tritonserver serving ``repo`` (:func:`measure`)."""
    ensure_anchor()
    return measure(lambda: start_triton(repo, TRITON_PORT, work / "triton.log"), stop_triton, TRITON_PORT,
                   ("tritonserver", "triton_python_backend_stub"))


def per_model(points: dict[int, tuple[float, int, float]], count: int) -> str:
    first = min(points)
    if count == first:
        return "-"
    return f"{(points[count][0] - points[first][0]) / (count - first):,.1f}"


def render(results: dict[tuple[str, str], dict[int, tuple[float, int, float]]], args: argparse.Namespace) -> str:
    lines = [
        MARKS[0],
        f"Measured {time.strftime('%Y-%m-%d')} on {args.cores} cores ({platform.machine()}), one run per point: "
        "each a fresh server with every model loaded at start.",
        "",
        "| model | models | rayinfer PSS (MiB) | rayinfer per model (MiB) | rayinfer processes | rayinfer ready (s) "
        "| Triton PSS (MiB) | Triton per model (MiB) | Triton processes | Triton ready (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in args.kinds:
        ours, theirs = results.get(("rayinfer", kind), {}), results.get(("triton", kind.removesuffix("-pool")), {})
        for count in counts_of(args, kind):
            row = [f"`{kind}`", str(count)]
            for points in (ours, theirs):
                if count in points:
                    pss, procs, ready_s = points[count]
                    row += [f"{pss:,.0f}", per_model(points, count), str(procs), f"{ready_s:.0f}"]
                else:
                    row += ["-"] * 4
            lines.append("| " + " | ".join(row) + " |")
    pool_counts = f" --pool-counts {','.join(map(str, args.pool_counts))}" if args.pool_counts != args.counts else ""
    lines += ["", f"Reproduce: `.venv/bin/python benchmarks/model_memory.py --counts "
                  f"{','.join(map(str, args.counts))}{pool_counts} --kinds {','.join(args.kinds)}`", MARKS[1]]
    return "\n".join(lines)


def plot(results: dict[tuple[str, str], dict[int, tuple[float, int, float]]], path: Path) -> None:
    """Memory (PSS, MiB) against the number of models, one line per server and kind, on log axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {("rayinfer", "onnx"): ("tab:blue", "-", "rayinfer, ONNX, a replica each"),
              ("rayinfer", "onnx-pool"): ("tab:blue", "--", "rayinfer, ONNX, pooled"),
              ("rayinfer", "python"): ("tab:orange", "-", "rayinfer, Python, a replica each"),
              ("rayinfer", "python-pool"): ("tab:orange", "--", "rayinfer, Python, pooled"),
              ("triton", "python"): ("tab:green", "-", "Triton 2.51, Python")}
    for key, (color, line, label) in styles.items():
        points = results.get(key)
        if points:
            counts = sorted(points)
            ax.plot(counts, [points[c][0] for c in counts], line, color=color, marker="o", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("models loaded")
    ax.set_ylabel("PSS of every server process (MiB)")
    ax.set_title("Memory against the number of small models")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def counts_of(args: argparse.Namespace, kind: str) -> list[int]:
    """The model counts measured for ``kind`` (the pooled kind's own, given --pool-counts)."""
    return args.pool_counts if kind.endswith("-pool") else args.counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default="1,10,25", help="model counts, comma-separated")
    parser.add_argument("--pool-counts", default="", help="model counts for the pooled kinds (default: --counts)")
    parser.add_argument("--kinds", default="onnx,onnx-pool,python,python-pool",
                        help="onnx, onnx-pool, python and/or python-pool")
    parser.add_argument("--no-triton", action="store_true", help="measure rayinfer only")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    args.counts = sorted(int(c) for c in args.counts.split(","))
    args.pool_counts = sorted(int(c) for c in args.pool_counts.split(",")) if args.pool_counts else args.counts
    args.kinds = [k for k in args.kinds.split(",") if k]
    args.cores = len(__import__("os").sched_getaffinity(0))
    if not args.no_triton:
        ensure_anchor()  # before the network goes away
    ensure_installed()  # the plotting library, likewise
    if not in_private_netns():
        reexec_in_netns()
    results: dict[tuple[str, str], dict[int, tuple[float, int, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="model-memory-") as tmp:
        work = Path(tmp)
        for kind in args.kinds:
            for count in counts_of(args, kind):
                repo = write_repository(work / "repository", kind, count)
                results.setdefault(("rayinfer", kind), {})[count] = point = measure_rayinfer(repo, work,
                                                                                      kind.endswith("-pool"))
                print(f"rayinfer {kind} x{count}: {point[0]:,.0f} MiB PSS, {point[1]} processes, ready in "
                      f"{point[2]:.0f} s", flush=True)
                if kind == "python" and not args.no_triton:  # python-pool: the same repository
                    results.setdefault(("triton", kind), {})[count] = point = measure_triton(repo, work)
                    print(f"triton {kind} x{count}: {point[0]:,.0f} MiB PSS, {point[1]} processes, ready in "
                          f"{point[2]:.0f} s", flush=True)
    section = render(results, args)
    print(section)
    write_doc(section, args.output, MARKS)
    plot(results, args.output.parent / "images" / "model_memory.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
