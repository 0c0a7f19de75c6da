#!/usr/bin/env python3
"""What a rollout's split costs, and one automatic rollback as it happens.

    .venv/bin/python benchmarks/rollout_split.py [--concurrency 8] [--protocols http,grpc] [--rounds 2]
                                                [--images docs/images]

Writes a repository with the example ``mlp`` (onnxruntime, max_batch_size 64, dynamic batching
with a 500 us queue delay, one CPU instance and one inference thread) twice, as ``mlp_plain``
and ``mlp_split``, each with versions 1 and 2 (the same file) served side by side, once more as
``mlp_pair`` with one version and two instances (a split's two replicas, with no split), and a
Python model ``degrading`` whose version 2 answers well for its first 600 requests, then fails
one in five. Starts ``rayinfer serve`` inside a private network namespace; gives ``mlp_split`` a
rollout (``rollout_automatic`` false, so the weight stays where it is set) and runs NVIDIA's
perf_analyzer (version-less requests) against ``mlp_plain``, ``mlp_split`` at 50%,
``mlp_split`` at 1% and ``mlp_pair`` in turn, ``--rounds`` times, alternating; prints a markdown
table of the medians. Then starts an automatic rollout of ``degrading`` (steps 10, 50, 100; 4 s
and 100 requests a step) under a steady client, samples its state every 0.25 s until it ends,
and plots weight, the candidate's failure rate over the step and both versions' p99 latency
against time (``--images``/rollout_rollback.png).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from compare_triton import (
    RAYINFER_PORT,
    ensure_anchor,
    in_private_netns,
    perf_analyzer,
    reexec_in_netns,
    start_rayinfer,
    stop_server,
    wait_ready,
)
from rayinfer.cluster.example_repository import MLP_CONFIG, mlp_model, write_model, write_python_model

TWO_VERSIONS = "version_policy: { latest: { num_versions: 2 } }\n"
DEGRADING_CONFIG = """name: "degrading"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
version_policy: { latest: { num_versions: 2 } }
"""
DEGRADING_MODEL = '''import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.version = int(args["model_version"])
        self.calls = 0

    def execute(self, requests):
        out = []
        for request in requests:
            self.calls += 1
            if self.version == 2 and self.calls > 600 and self.calls % 5 == 0:
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("version 2 degraded")))
                continue
            time.sleep(0.002)
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x * self.version)]))
        return out
'''


def write_repository(root: Path) -> None:
    onnx_model = mlp_model()
    for name in ("mlp_plain", "mlp_split"):
        config = MLP_CONFIG.replace('name: "mlp"', f'name: "{name}"') + TWO_VERSIONS
        write_model(root, name, config, onnx_model)
        write_model(root, name, None, onnx_model, version=2)
    # One version with two instances: the replicas and CPU of two versions, without a split.
    config = MLP_CONFIG.replace('name: "mlp"', 'name: "mlp_pair"').replace("count: 1 kind", "count: 2 kind")
    assert "count: 2" in config
    write_model(root, "mlp_pair", config, onnx_model)
    for version in (1, 2):
        write_python_model(root, "degrading", DEGRADING_CONFIG, DEGRADING_MODEL, version=version)


def api(port: int, method: str, path: str, doc: dict | None = None) -> dict:
    data = None if doc is None else json.dumps(doc).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method)
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.loads(answer.read())


def start_rollout(port: int, model: str, **settings: object) -> dict:
    return api(port, "POST", f"/v2/repository/models/{model}/rollout/start",
               {"stable_version": "1", "candidate_version": "2",
                "parameters": {f"rollout_{k}": str(v) for k, v in settings.items()}})


# What is measured: the model with no rollout; with its rollout at 50% and at 1% (every request
# still split, nearly all answered by the stable version's replica); and one version with two
# instances, which spreads the requests over two replicas as a 50% split does, without one.
VARIANTS = (("mlp_plain", None), ("mlp_split", 50), ("mlp_split", 1), ("mlp_pair", None))
ROWS = {"mlp_plain": "none", "mlp_split at 50%": "50%", "mlp_split at 1%": "1%",
        "mlp_pair": "none, 2 instances of 1 version"}


def split_cost(port: int, protocols: list[str], levels: list[int], rounds: int, interval_ms: int,
               work: Path) -> dict[tuple[str, int, str], list[dict[str, float]]]:
    # The weight stays where it is set; the slack keeps the latency checks from ending the
    # rollout (two versions on two cores: the one with fewer requests batches fewer of them).
    start_rollout(port, "mlp_split", steps="50,100", automatic="false", latency_slack_ms=10000)
    results: dict[tuple[str, int, str], list[dict[str, float]]] = {}
    for round_ in range(rounds):
        for protocol in protocols:
            for concurrency in levels:
                for model, weight in VARIANTS:
                    if weight is not None:
                        api(port, "POST", f"/v2/repository/models/{model}/rollout/weight", {"weight": weight})
                        # The fronts and replicas are told at once (a new weight cuts the runs begun
                        # under the last one); the pause keeps a late one out of the measurement.
                        time.sleep(2.5)
                    result = perf_analyzer(port, model, protocol, concurrency, interval_ms, work / "perf.csv")
                    name = model if weight is None else f"{model} at {weight}%"
                    results.setdefault((protocol, concurrency, name), []).append(result)
                    print(f"  round {round_ + 1} {protocol} c={concurrency} {name}: {result}", flush=True)
    stats = {m: api(port, "GET", f"/v2/models/{m}/stats") for m in ("mlp_split",)}
    versions = {s["version"]: s["inference_stats"]["success"]["count"] for s in stats["mlp_split"]["model_stats"]}
    print(f"mlp_split answered per version: {versions}", flush=True)
    return results


def rollback_timeline(port: int) -> list[dict[str, float]]:
    import numpy as np
    import tritonclient.http as httpclient

    stop = threading.Event()
    failed: list[str] = []  # each failed request's message

    def traffic() -> None:
        with httpclient.InferenceServerClient(f"127.0.0.1:{port}") as client:
            tensor = httpclient.InferInput("INPUT0", [1, 1], "FP32")
            tensor.set_data_from_numpy(np.ones((1, 1), np.float32))
            while not stop.is_set():
                try:
                    client.infer("degrading", [tensor])
                except Exception as exc:  # noqa: BLE001  # the candidate's failures are the point: counted
                    failed.append(str(exc))

    threads = [threading.Thread(target=traffic, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    start = time.monotonic()
    start_rollout(port, "degrading", steps="10,50,100", step_seconds=4, step_requests=100)
    samples = []
    while time.monotonic() - start < 120:
        doc = api(port, "GET", "/v2/repository/models/degrading/rollout")
        figures = doc.get("figures") or {}
        samples.append({"t": time.monotonic() - start, "weight": doc["weight"],
                        "failure_rate": (figures.get("candidate") or {}).get("failure_rate"),
                        "candidate_p99_ms": (figures.get("candidate") or {}).get("p99_ms"),
                        "stable_p99_ms": (figures.get("stable") or {}).get("p99_ms"), "state": doc["state"]})
        if doc["state"] != "PROGRESSING":
            break
        time.sleep(0.25)  # the plot's sampling period, not a wait for something
    stop.set()
    for thread in threads:
        thread.join(30)
    own = sum("version 2 degraded" in message for message in failed)
    print(f"  {len(failed)} client requests failed, {own} of them with the candidate's own error", flush=True)
    for decision in doc["decisions"]:
        print(f"  {decision['action']} at {decision['weight']}%: {decision['reason']}", flush=True)
    return samples


def plot(samples: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    top.step(t, [s["weight"] for s in samples], where="post", label="candidate weight (%)", color="tab:blue")
    top.plot(t, [100 * (s["failure_rate"] or 0) for s in samples], label="candidate failure rate over the step (%)",
             color="tab:red")
    top.set_ylabel("percent")
    top.legend(loc="upper left", fontsize=8)
    for key, color in (("stable_p99_ms", "tab:green"), ("candidate_p99_ms", "tab:orange")):
        bottom.plot(t, [s[key] for s in samples], label=key.replace("_", " ").replace(" ms", " (ms)"), color=color)
    bottom.set_ylabel("p99 latency (ms)")
    bottom.set_xlabel("seconds since the rollout started")
    bottom.legend(loc="upper left", fontsize=8)
    top.set_title(f"An automatic rollback: {samples[-1]['state']} after {samples[-1]['t']:.1f} s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="8")
    parser.add_argument("--protocols", default="http,grpc")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--measurement-interval", type=int, default=3000, help="ms per perf_analyzer window")
    parser.add_argument("--images", type=Path, default=Path("docs/images"))
    args = parser.parse_args()
    if not in_private_netns():
        ensure_anchor()
        reexec_in_netns()
    protocols, levels = args.protocols.split(","), [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="rayinfer-rollout-") as tmp:
        work = Path(tmp)
        write_repository(work / "repo")
        server = start_rayinfer(work / "repo", RAYINFER_PORT, work / "rayinfer.log")
        try:
            wait_ready(RAYINFER_PORT, server, 600)
            results = split_cost(RAYINFER_PORT, protocols, levels, args.rounds, args.measurement_interval, work)
            samples = rollback_timeline(RAYINFER_PORT)
        finally:
            stop_server(server)
    plot(samples, args.images / "rollout_rollback.png")
    print("\n| protocol | concurrency | rollout | infer/s | against none | against 2 instances | p99 (us) "
          "| queue / compute (us) |")
    print("|---|---|---|---|---|---|---|---|")
    for protocol in protocols:
        for concurrency in levels:
            medians = {name: {k: statistics.median(r[k] for r in results[(protocol, concurrency, name)])
                              for k in results[(protocol, concurrency, name)][0]}
                       for name in (m if w is None else f"{m} at {w}%" for m, w in VARIANTS)}
            plain, pair = medians["mlp_plain"], medians["mlp_pair"]
            for name, figures in medians.items():
                print(f"| {protocol} | {concurrency} | {ROWS[name]} | {figures['infer_s']:,.0f} | "
                      f"{figures['infer_s'] / plain['infer_s']:.2f}x | {figures['infer_s'] / pair['infer_s']:.2f}x | "
                      f"{figures['p99_us']:,.0f} | {figures['queue_us']:,.0f} / {figures['compute_us']:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
