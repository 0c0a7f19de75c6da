#!/usr/bin/env python3
"""Side-by-side throughput of the Triton anchor and rayinfer on the same ONNX MLP.

    .venv/bin/python benchmarks/compare_triton.py [--concurrency 1,2,4,8,16,32] [--protocols http,grpc]
        [--batching on,off,python] [--rounds 3]

Installs the Triton anchor (../shared/anchors/triton/setup) if missing, builds the anchor's MLP
weights, then alternates the two servers on loopback inside a private network namespace,
running NVIDIA's perf_analyzer over HTTP and gRPC at each concurrency (batch 1 per request; with
``--protocols grpc-stream``, gRPC with every client's requests on one stream),
with dynamic batching on (the anchor's ``mlp_onnx``, unmodified) and off (``mlp_onnx_nobatch``:
the same model and config without ``dynamic_batching``), and on the anchor's Python model
``identity_fp32``, the same model.py in both servers (``--batching python``). Triton serves the anchor's python-backend
model; rayinfer serves the same model.onnx natively with its ONNX Runtime adapter and the same
settings. The batch sizes each server formed come from its statistics extension. The in-process
limit (onnxruntime alone in this process, same threads) is measured in every round. Writes the
tables to docs/benchmarks.md and the plots to docs/images/.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
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
# Batching on: the anchor's model; off: the same model with no dynamic_batching, for both servers;
# python: the anchor's identity_fp32, a Python-backend model both servers run unmodified.
PYTHON_MODEL = "identity_fp32"
MODELS = {"on": MODEL, "off": f"{MODEL}_nobatch", "python": PYTHON_MODEL}
LABELS = {"on": "on", "off": "off", "python": f"`{PYTHON_MODEL}` (Python model, batching on)"}
# The example repository's MLP config (same batching and threads as the anchor's), renamed.
RAYINFER_CONFIG = MLP_CONFIG.replace('name: "mlp"', f'name: "{MODEL}"')
MARK_BEGIN = "<!-- compare_triton:begin -->"
MARK_END = "<!-- compare_triton:end -->"
IMAGES = ROOT / "docs" / "images"
IN_PROCESS_BATCHES = (1, 8, 64)


def in_private_netns() -> bool:
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.splitlines()
    return len(links) == 1


def ensure_installed() -> None:
    """The plotting library (as in the ``bench`` extra), installed before the network goes away."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "matplotlib>=3.7"], check=True)


def ensure_anchor() -> None:
    """The Triton anchor (tritonserver, perf_analyzer, the weights' builder), installed if missing."""
    if not (ANCHOR_HOME / "tritonserver" / "bin" / "tritonserver").exists():
        subprocess.run([str(ANCHORS / "triton" / "setup")], check=True)


def processes() -> dict[int, str]:
    """{pid: command line} of every process."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            out[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return out


def start_rayinfer(repo: Path, base_port: int, log_path: Path, extra: tuple[str, ...] = (),
                   env: dict[str, str] | None = None) -> subprocess.Popen:
    """``rayinfer serve`` on ``repo``: HTTP on ``base_port``, gRPC + 1, metrics + 2, Serve's own
    HTTP and gRPC ingress + 10 and + 11. Stop it with :func:`stop_server`."""
    with log_path.open("w") as log:
        return subprocess.Popen(
            [str(Path(sys.executable).parent / "rayinfer"), "serve", "--model-repository", str(repo),
             "--http-port", str(base_port), "--grpc-port", str(base_port + 1), "--metrics-port", str(base_port + 2),
             "--serve-http-port", str(base_port + 10), "--serve-grpc-port", str(base_port + 11), *extra],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )


def python_model_repository(repo: Path, example: bool) -> Path:
    """``repo`` holding the anchor's Python model ``identity_fp32``, and with ``example`` the
    example repository beside it (what rayinfer serves; Triton's anchor has the Python backend
    only)."""
    if example:
        from rayinfer.cluster.example_repository import write_example_repository
        write_example_repository(repo)
    shutil.copytree(ANCHORS / "models" / PYTHON_MODEL, repo / PYTHON_MODEL)
    return repo


def start_triton(repo: Path, port: int, log_path: Path, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """The anchor's tritonserver on ``repo`` with its start script's flags (HTTP on ``port``,
    gRPC + 1, metrics + 2, on 127.0.0.1) and ``extra``. Stop it with :func:`stop_triton`."""
    server = ANCHOR_HOME / "tritonserver"
    flags = [f"--model-repository={repo}", f"--backend-directory={server / 'backends'}",
             f"--cache-directory={server / 'caches'}", "--http-address=127.0.0.1", f"--http-port={port}",
             "--grpc-address=127.0.0.1", f"--grpc-port={port + 1}", "--metrics-address=127.0.0.1",
             f"--metrics-port={port + 2}", "--allow-gpu-metrics=false", "--allow-sagemaker=false",
             "--allow-vertex-ai=false", "--log-verbose=0", *extra]
    script = f'source "{ANCHORS / "triton" / "env"}" && exec "{server / "bin" / "tritonserver"}" "$@"'
    with log_path.open("w") as log:
        return subprocess.Popen(["bash", "-c", script, "tritonserver", *flags], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "TRITON_ANCHOR": str(ANCHOR_HOME)})


def stop_triton(proc: subprocess.Popen) -> None:
    stop_server(proc, signal.SIGTERM, 60.0)


def stop_server(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout_s: float = 90.0) -> None:
    """Stop a server started here by its own PID: ``sig``, then SIGKILL after ``timeout_s``."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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


def without_batching(config: str, name: str) -> str:
    """A config.pbtxt with its dynamic_batching block removed and the model renamed."""
    config = re.sub(r"dynamic_batching\s*\{[^}]*\}\n?", "", config)
    changed = re.sub(r'^name:\s*"[^"]*"', f'name: "{name}"', config, count=1, flags=re.M)
    if "dynamic_batching" in changed or changed == config:
        raise RuntimeError(f"could not derive the {name} config")
    return changed


# Both servers: HTTP on the port base, gRPC on base + 1, metrics on base + 2. "grpc-stream":
# perf_analyzer's --streaming (every request of a client on one ModelStreamInfer stream).
PROTOCOL_PORT_OFFSET = {"http": 0, "grpc": 1, "grpc-stream": 1}
PROTOCOL_NAMES = {"http": "HTTP", "grpc": "gRPC", "grpc-stream": "gRPC stream"}


def execution_counts(base_port: int, model: str) -> tuple[int, int]:
    """(inferences, executions) of ``model`` so far, from the server's statistics extension."""
    with urllib.request.urlopen(f"http://127.0.0.1:{base_port}/v2/models/{model}/stats", timeout=10) as r:
        stats = json.load(r)["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


def perf_analyzer_command(base_port: int, model: str, protocol: str, concurrency: int, interval_ms: int,
                          stability_percentage: int = 25, max_trials: int = 10) -> list[str]:
    port = base_port + PROTOCOL_PORT_OFFSET[protocol]
    return [
        str(ANCHORS / "triton" / "perf_analyzer"), "-m", model, "-u", f"127.0.0.1:{port}",
        "-i", protocol.partition("-")[0], *(["--streaming"] if protocol == "grpc-stream" else []),
        "--concurrency-range", f"{concurrency}:{concurrency}", "--measurement-interval", str(interval_ms),
        "--stability-percentage", str(stability_percentage), "--max-trials", str(max_trials),
    ]


def perf_analyzer(base_port: int, model: str, protocol: str, concurrency: int, interval_ms: int,
                  out_csv: Path, extra_args: tuple[str, ...] = ()) -> dict[str, float]:
    """One perf_analyzer measurement; if it fails (as when no window is stable within 25%), one
    more that accepts 50%. ``extra_args``: more perf_analyzer flags (``--input-data``)."""
    inferences, executions = execution_counts(base_port, model)
    for stability in (25, 50):
        cmd = [*perf_analyzer_command(base_port, model, protocol, concurrency, interval_ms, stability),
               *extra_args, "-f", str(out_csv)]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if result.returncode == 0:
            break
    else:
        raise RuntimeError(f"perf_analyzer failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    inferences_after, executions_after = execution_counts(base_port, model)
    with out_csv.open() as f:
        row = next(csv.DictReader(f))
    return {
        "infer_s": float(row["Inferences/Second"]),
        "p50_us": float(row["p50 latency"]),
        "p99_us": float(row["p99 latency"]),
        "queue_us": float(row["Server Queue"]),
        "compute_us": float(row["Server Compute Input"]) + float(row["Server Compute Infer"])
        + float(row["Server Compute Output"]),
        "batch": (inferences_after - inferences) / max(executions_after - executions, 1),
    }


def prepare(work: Path) -> tuple[Path, Path]:
    ensure_anchor()
    triton_repo = work / "triton"
    shutil.copytree(ANCHORS / "models", triton_repo)
    subprocess.run(
        [str(ANCHOR_HOME / "venv" / "bin" / "python"), "make_mlp_onnx.py", f"{MODEL}/1/model.onnx"],
        cwd=triton_repo, check=True, capture_output=True,
    )
    nobatch = triton_repo / MODELS["off"]
    shutil.copytree(triton_repo / MODEL, nobatch)
    (nobatch / "config.pbtxt").write_text(without_batching((nobatch / "config.pbtxt").read_text(), MODELS["off"]))
    for path in triton_repo.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    ray_repo = work / "rayinfer"
    shutil.copytree(triton_repo / PYTHON_MODEL, ray_repo / PYTHON_MODEL)
    for batching, name in MODELS.items():
        if batching == "python":
            continue
        (ray_repo / name / "1").mkdir(parents=True)
        config = RAYINFER_CONFIG if batching == "on" else without_batching(RAYINFER_CONFIG, name)
        (ray_repo / name / "config.pbtxt").write_text(config)
        shutil.copy(triton_repo / MODEL / "1" / "model.onnx", ray_repo / name / "1" / "model.onnx")
    return triton_repo, ray_repo


def in_process_limit(model_path: Path, seconds: float = 2.0) -> dict[int, float]:
    """Rows per second onnxruntime computes on the MLP in this process, one intra-op thread, by batch size."""
    import numpy as np
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(model_path), sess_options=options, providers=["CPUExecutionProvider"])
    rates = {}
    for batch in IN_PROCESS_BATCHES:
        feed = {"INPUT0": np.random.default_rng(0).random((batch, 256), dtype=np.float32)}
        session.run(None, feed)
        runs, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            session.run(None, feed)
            runs += 1
        rates[batch] = runs * batch / elapsed
    return rates


Point = tuple[str, str, int]  # (protocol, batching on/off, concurrency)


def measure(server: str, port: int, points: list[Point], interval_ms: int, work: Path) -> dict[Point, dict]:
    results = {}
    for p, b, c in points:
        results[(p, b, c)] = perf_analyzer(port, MODELS[b], p, c, interval_ms, work / f"{server}_{p}_{b}_{c}.csv")
        print(f"  {server} {p} batching {b} c={c}: {results[(p, b, c)]}", flush=True)
    return results


def run_triton(repo: Path, points: list[Point], interval_ms: int, work: Path) -> dict[Point, dict]:
    subprocess.run([str(ANCHORS / "triton" / "start"), str(repo), str(TRITON_PORT)], check=True)
    try:
        return measure("triton", TRITON_PORT, points, interval_ms, work)
    finally:
        subprocess.run([str(ANCHORS / "triton" / "stop")], check=False)


def run_rayinfer(repo: Path, points: list[Point], interval_ms: int, work: Path) -> dict[Point, dict]:
    proc = start_rayinfer(repo, RAYINFER_PORT, work / "rayinfer.log")
    try:
        wait_ready(RAYINFER_PORT, proc, 300)
        return measure("rayinfer", RAYINFER_PORT, points, interval_ms, work)
    finally:
        stop_server(proc)


Results = dict[str, list[dict[Point, dict]]]


def median(results: Results, server: str, point: Point, key: str) -> float:
    return statistics.median(r[point][key] for r in results[server])


def render(results: Results, limits: list[dict[int, float]], points: list[Point], args: argparse.Namespace) -> str:
    def m(server: str, point: Point, key: str) -> float:
        return median(results, server, point, key)

    limit = {b: statistics.median(r[b] for r in limits) for b in IN_PROCESS_BATCHES}
    lines = [
        MARK_BEGIN,
        f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
        f"Python {platform.python_version()}, median of {args.rounds} round(s) (each round's infer/s in brackets), "
        "servers alternated, perf_analyzer on the "
        "same cores, batch 1 per request, model `mlp_onnx` (256->1024->1024->10 FP32), max_batch_size 64, one "
        "instance, one intra-op thread; batching on: dynamic batching with a 500 us queue delay, off: none; "
        f"`{PYTHON_MODEL}`: the anchor's Python model (FP32 [16] identity, max_batch_size 32, 500 us delay). "
        "\"batch\" is the average number of requests per model execution, from each server's statistics; "
        "queue and compute are each server's own per-request figures as perf_analyzer reports them (compute: "
        "input + infer + output; for a Python model in Triton it includes the round trip to its stub process).",
        "",
        "| protocol | batching | concurrency | Triton infer/s | rayinfer infer/s | ratio | Triton p50 / p99 (us) "
        "| rayinfer p50 / p99 (us) | p99 ratio | batch Triton / rayinfer | queue / compute (us), Triton "
        "| queue / compute (us), rayinfer |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    def rounds(server: str, point: Point) -> str:
        """The median, and each round's figure when there are several (the noise)."""
        values = [run[point]["infer_s"] for run in results[server]]
        each = f" ({' / '.join(f'{v:,.0f}' for v in values)})" if len(values) > 1 else ""
        return f"{statistics.median(values):,.0f}{each}"

    for point in points:
        t, r = m("triton", point, "infer_s"), m("rayinfer", point, "infer_s")
        lines.append(
            f"| {point[0]} | {LABELS[point[1]]} | {point[2]} | {rounds('triton', point)} | {rounds('rayinfer', point)} "
            f"| {r / t:.2f}x "
            f"| {m('triton', point, 'p50_us'):,.0f} / {m('triton', point, 'p99_us'):,.0f} "
            f"| {m('rayinfer', point, 'p50_us'):,.0f} / {m('rayinfer', point, 'p99_us'):,.0f} "
            f"| {m('rayinfer', point, 'p99_us') / m('triton', point, 'p99_us'):.2f}x "
            f"| {m('triton', point, 'batch'):.1f} / {m('rayinfer', point, 'batch'):.1f} "
            f"| {m('triton', point, 'queue_us'):,.0f} / {m('triton', point, 'compute_us'):,.0f} "
            f"| {m('rayinfer', point, 'queue_us'):,.0f} / {m('rayinfer', point, 'compute_us'):,.0f} |"
        )
    gains = [(p, c) for p, b, c in points if b == "on" and (p, "off", c) in points]
    if gains:
        lines += ["", "Gain from dynamic batching (throughput with batching on / off, same server, same run):", "",
                  "| protocol | concurrency | Triton gain | rayinfer gain |", "|---|---|---|---|"]
        for p, c in gains:
            t_gain = m("triton", (p, "on", c), "infer_s") / m("triton", (p, "off", c), "infer_s")
            r_gain = m("rayinfer", (p, "on", c), "infer_s") / m("rayinfer", (p, "off", c), "infer_s")
            lines.append(f"| {p} | {c} | {t_gain:.2f}x | {r_gain:.2f}x |")
    best = max((m("rayinfer", point, "infer_s") for point in points if point[1] != "python"), default=0.0)
    if best:  # the MLP was measured: how far its best is from onnxruntime alone
        lines += [
            "",
            "In-process limit: onnxruntime alone on the same model.onnx in one Python process, one intra-op thread, "
            "no server (median of the rounds):",
            "",
            "| batch rows | " + " | ".join(str(b) for b in IN_PROCESS_BATCHES) + " |",
            "|---|" + "---|" * len(IN_PROCESS_BATCHES),
            "| rows/s | " + " | ".join(f"{limit[b]:,.0f}" for b in IN_PROCESS_BATCHES) + " |",
            "| rayinfer's best (" + f"{best:,.0f} infer/s) as a fraction | "
            + " | ".join(f"{best / limit[b]:.0%}" for b in IN_PROCESS_BATCHES) + " |",
        ]
    lines += [
        "",
        "![throughput against concurrency](images/bench_throughput.png)",
        "",
        "![latency against throughput](images/bench_latency.png)",
        "",
        f"Reproduce: `.venv/bin/python benchmarks/compare_triton.py --concurrency {args.concurrency} "
        f"--protocols {args.protocols} --batching {args.batching} --rounds {args.rounds}`",
        MARK_END,
    ]
    return "\n".join(lines)


def write_doc(section: str, path: Path, marks: tuple[str, str] = (MARK_BEGIN, MARK_END)) -> None:
    """Replaces the part of ``path`` between ``marks`` with ``section`` (which holds them), or appends it."""
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if marks[0] in text and marks[1] in text:
        head, rest = text.split(marks[0], 1)
        text = head + section + rest.split(marks[1], 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,2,4,8,16,32")
    parser.add_argument("--protocols", default="http,grpc", help="http, grpc, grpc-stream")
    parser.add_argument("--batching", default="on,off,python",
                        help="on, off (the MLP with and without dynamic batching), python (identity_fp32)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measurement-interval", type=int, default=3000, help="ms per perf_analyzer window")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--images", type=Path, default=IMAGES, help="where the plots go")
    args = parser.parse_args()
    if not in_private_netns():
        ensure_installed()
        reexec_in_netns()
    points = [(p, b, int(c)) for p in args.protocols.split(",") for b in args.batching.split(",")
              for c in args.concurrency.split(",")]
    results: Results = {"triton": [], "rayinfer": []}
    limits: list[dict[int, float]] = []
    with tempfile.TemporaryDirectory(prefix="rayinfer-bench-") as tmp:
        work = Path(tmp)
        triton_repo, ray_repo = prepare(work)
        for round_index in range(args.rounds):
            limits.append(in_process_limit(ray_repo / MODEL / "1" / "model.onnx"))
            print(f"round {round_index + 1}: in-process rows/s {limits[-1]}", flush=True)
            order = ["triton", "rayinfer"] if round_index % 2 == 0 else ["rayinfer", "triton"]
            for server in order:
                runner = run_triton if server == "triton" else run_rayinfer
                repo = triton_repo if server == "triton" else ray_repo
                print(f"round {round_index + 1}: {server}", flush=True)
                results[server].append(runner(repo, points, args.measurement_interval, work))
    section = render(results, limits, points, args)
    print(section)
    write_doc(section, args.output)
    from bench_plots import plot

    plot(results, points, args.images)
    return 0


if __name__ == "__main__":
    sys.exit(main())
