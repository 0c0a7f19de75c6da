#!/usr/bin/env python3
"""Side-by-side throughput of the Triton anchor and rayinfer on the same ONNX MLP.

    .venv/bin/python benchmarks/compare_triton.py [--concurrency 1,4,8,16] [--protocols http,grpc] [--rounds 1]

Installs the Triton anchor (../shared/anchors/triton/setup) if missing, builds the anchor's MLP
weights, then alternates the two servers on loopback inside a private network namespace,
running NVIDIA's perf_analyzer over HTTP and gRPC at each concurrency (batch 1 per request). Triton
serves the anchor repository unmodified (python backend running the ONNX file); rayinfer serves
the same model.onnx natively with its ONNX Runtime adapter and the same batching settings.
Writes the table and the ratio to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from rayinfer.cluster.example_repository import MLP_CONFIG

ROOT = Path(__file__).resolve().parent.parent
ANCHORS = ROOT.parent / "shared" / "anchors"
ANCHOR_HOME = Path(os.environ.get("TRITON_ANCHOR", "/tmp/anchor-triton"))
TRITON_PORT = 18000
RAYINFER_PORT = 18100
MODEL = "mlp_onnx"
# The example repository's MLP config (same batching and threads as the anchor's), renamed.
RAYINFER_CONFIG = MLP_CONFIG.replace('name: "mlp"', f'name: "{MODEL}"')
MARK_BEGIN = "<!-- compare_triton:begin -->"
MARK_END = "<!-- compare_triton:end -->"


def in_private_netns() -> bool:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.splitlines()
    return len(links) == 1


def reexec_in_netns() -> None:
    script = "ip link set lo up && exec \"$0\" \"$@\""
    os.execvp("unshare", ["unshare", "-n", "sh", "-c", script, sys.executable, *sys.argv])


def wait_ready(port: int, proc: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last_error: OSError | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError as exc:  # not listening yet
            last_error = exc
        time.sleep(0.5)
    raise RuntimeError(f"server on port {port} not ready after {timeout_s} s (last error: {last_error})")


# Both servers: HTTP on the port base, gRPC on base + 1, metrics on base + 2.
PROTOCOL_PORT_OFFSET = {"http": 0, "grpc": 1}


def perf_analyzer(base_port: int, protocol: str, concurrency: int, interval_ms: int, out_csv: Path) -> dict[str, float]:
    port = base_port + PROTOCOL_PORT_OFFSET[protocol]
    cmd = [
        str(ANCHORS / "triton" / "perf_analyzer"), "-m", MODEL, "-u", f"127.0.0.1:{port}", "-i", protocol,
        "--concurrency-range", f"{concurrency}:{concurrency}", "--measurement-interval", str(interval_ms),
        "--stability-percentage", "25", "--max-trials", "20", "-f", str(out_csv),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    with out_csv.open() as f:
        row = next(csv.DictReader(f))
    return {
        "infer_s": float(row["Inferences/Second"]),
        "p50_us": float(row["p50 latency"]),
        "p99_us": float(row["p99 latency"]),
        "queue_us": float(row["Server Queue"]),
        "compute_us": float(row["Server Compute Input"]) + float(row["Server Compute Infer"])
        + float(row["Server Compute Output"]),
    }


def prepare(work: Path) -> tuple[Path, Path]:
    if not (ANCHOR_HOME / "tritonserver" / "bin" / "tritonserver").exists():
        subprocess.run([str(ANCHORS / "triton" / "setup")], check=True)
    triton_repo = work / "triton"
    shutil.copytree(ANCHORS / "models", triton_repo)
    for path in triton_repo.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    subprocess.run(
        [str(ANCHOR_HOME / "venv" / "bin" / "python"), "make_mlp_onnx.py", f"{MODEL}/1/model.onnx"],
        cwd=triton_repo, check=True, capture_output=True,
    )
    ray_repo = work / "rayinfer"
    (ray_repo / MODEL / "1").mkdir(parents=True)
    (ray_repo / MODEL / "config.pbtxt").write_text(RAYINFER_CONFIG)
    shutil.copy(triton_repo / MODEL / "1" / "model.onnx", ray_repo / MODEL / "1" / "model.onnx")
    return triton_repo, ray_repo


Point = tuple[str, int]  # (protocol, concurrency)


def measure(server: str, port: int, points: list[Point], interval_ms: int, work: Path) -> dict[Point, dict]:
    return {(p, c): perf_analyzer(port, p, c, interval_ms, work / f"{server}_{p}_{c}.csv") for p, c in points}


def run_triton(repo: Path, points: list[Point], interval_ms: int, work: Path) -> dict[Point, dict]:
    subprocess.run([str(ANCHORS / "triton" / "start"), str(repo), str(TRITON_PORT)], check=True)
    try:
        return measure("triton", TRITON_PORT, points, interval_ms, work)
    finally:
        subprocess.run([str(ANCHORS / "triton" / "stop")], check=False)


def run_rayinfer(repo: Path, points: list[Point], interval_ms: int, work: Path) -> dict[Point, dict]:
    log = (work / "rayinfer.log").open("w")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "rayinfer"), "serve", "--model-repository", str(repo),
         "--http-port", str(RAYINFER_PORT), "--grpc-port", str(RAYINFER_PORT + 1),
         "--metrics-port", str(RAYINFER_PORT + 2), "--serve-grpc-port", str(RAYINFER_PORT + 11),
         "--serve-http-port", str(RAYINFER_PORT + 10)],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        wait_ready(RAYINFER_PORT, proc, 300)
        return measure("rayinfer", RAYINFER_PORT, points, interval_ms, work)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def render(results: dict[str, list[dict[Point, dict]]], points: list[Point], args: argparse.Namespace) -> str:
    def median(server: str, c: Point, key: str) -> float:
        return statistics.median(r[c][key] for r in results[server])

    lines = [
        MARK_BEGIN,
        f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
        f"Python {platform.python_version()}, median of {args.rounds} round(s), servers alternated, perf_analyzer on the "
        "same cores, batch 1 per request, model `mlp_onnx` (256->1024->1024->10 FP32), dynamic batching "
        "500 us, max_batch_size 64, one instance.",
        "",
        "| protocol | concurrency | Triton infer/s | rayinfer infer/s | ratio | Triton p50 / p99 (us) | rayinfer p50 / p99 (us) | rayinfer queue / compute (us) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in points:
        t, r = median("triton", c, "infer_s"), median("rayinfer", c, "infer_s")
        lines.append(
            f"| {c[0]} | {c[1]} | {t:,.0f} | {r:,.0f} | {r / t:.2f}x | {median('triton', c, 'p50_us'):,.0f} / "
            f"{median('triton', c, 'p99_us'):,.0f} | {median('rayinfer', c, 'p50_us'):,.0f} / "
            f"{median('rayinfer', c, 'p99_us'):,.0f} | {median('rayinfer', c, 'queue_us'):,.0f} / "
            f"{median('rayinfer', c, 'compute_us'):,.0f} |"
        )
    lines += ["", f"Reproduce: `.venv/bin/python benchmarks/compare_triton.py --concurrency {args.concurrency} "
              f"--protocols {args.protocols} --rounds {args.rounds}`", MARK_END]
    return "\n".join(lines)


def write_doc(section: str, path: Path) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if MARK_BEGIN in text and MARK_END in text:
        head, rest = text.split(MARK_BEGIN, 1)
        text = head + section + rest.split(MARK_END, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--protocols", default="http,grpc")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--measurement-interval", type=int, default=3000, help="ms per perf_analyzer window")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    if not in_private_netns():
        reexec_in_netns()
    points = [(p, int(c)) for p in args.protocols.split(",") for c in args.concurrency.split(",")]
    results: dict[str, list[dict[Point, dict]]] = {"triton": [], "rayinfer": []}
    with tempfile.TemporaryDirectory(prefix="rayinfer-bench-") as tmp:
        work = Path(tmp)
        triton_repo, ray_repo = prepare(work)
        for round_index in range(args.rounds):
            order = ["triton", "rayinfer"] if round_index % 2 == 0 else ["rayinfer", "triton"]
            for server in order:
                runner = run_triton if server == "triton" else run_rayinfer
                repo = triton_repo if server == "triton" else ray_repo
                print(f"round {round_index + 1}: {server}", flush=True)
                results[server].append(runner(repo, points, args.measurement_interval, work))
                print(results[server][-1], flush=True)
    section = render(results, points, args)
    print(section)
    write_doc(section, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
