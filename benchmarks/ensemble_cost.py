#!/usr/bin/env python3
"""What an ensemble costs: a two-member ensemble against its slowest member alone and against a
client calling the members one by one, in the same run; and the example text pipeline.

    .venv/bin/python benchmarks/ensemble_cost.py [--concurrency 8] [--protocols http,grpc] [--rounds 2]
        [--models mlp,scale,mlp_pipeline,...,chain]

Writes a repository holding the example ``mlp`` (ONNX, 256 -> 1024 -> 1024 -> 10, dynamic
batching with a 500 us queue delay, one intra-op thread), ``scale`` (a Python model: FP32 [256]
times 0.5, the same batching) and ``mlp_pipeline`` (an ensemble: ``scale`` then ``mlp``), plus
the example text pipeline (``nlp_ensemble``: a Python tokenizer, a transformer encoder in ONNX
with dynamic batching, a Python head), and ``mlp_pipeline_batched``: ``mlp_pipeline`` with its
own requests batched (the ``max_queue_delay_microseconds`` parameter, 500 us); and
``mlp_pipeline_in_place``, ``mlp_pipeline_batched_in_place``, ``nlp_ensemble_in_place`` and
``nlp_ensemble_batched_in_place``, the same ensembles with their steps run in the ensemble's
replica (the ``steps_in_place`` parameter). Starts ``rayinfer serve`` on it inside a private network
namespace and measures at the given concurrency, batch 1 per request, alternating in rounds:
each member alone and the ensemble with NVIDIA's perf_analyzer (from the Triton anchor; the
encoder is sent one tokenized sentence), and the members called one by one by a Python client
(tritonclient, one thread per concurrent chain, each sending ``scale``'s output to ``mlp``).
Prints a markdown table of the medians; an ensemble's ratio is against its slowest member
measured alone (``nlp_ensemble``'s: against ``nlp_encoder``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

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
from rayinfer.cluster.example_nlp import SEQUENCE_LENGTH, vocabulary, write_nlp_pipeline
from rayinfer.cluster.example_repository import MLP_CONFIG, mlp_model, write_model, write_python_model

SCALE_CONFIG = """name: "scale"
backend: "python"
max_batch_size: 64
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 256 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 256 ] } ]
dynamic_batching { max_queue_delay_microseconds: 500 }
instance_group [ { count: 1 kind: KIND_CPU } ]
"""
SCALE_MODEL = '''import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT0", (pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() * 0.5).astype(np.float32))])
            for r in requests]
'''
PIPELINE_CONFIG = """name: "mlp_pipeline"
platform: "ensemble"
max_batch_size: 64
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 256 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 10 ] } ]
ensemble_scheduling { step [
  { model_name: "scale" model_version: -1 input_map { key: "INPUT0" value: "INPUT0" } output_map { key: "OUTPUT0" value: "SCALED" } },
  { model_name: "mlp" model_version: -1 input_map { key: "INPUT0" value: "SCALED" } output_map { key: "OUTPUT0" value: "OUTPUT0" } }
] }
"""
BATCH_PARAMETER = 'parameters { key: "max_queue_delay_microseconds" value: { string_value: "500" } }\n'
# The same ensemble, its own requests batched too (rayinfer's max_queue_delay_microseconds).
BATCHED_CONFIG = PIPELINE_CONFIG.replace('name: "mlp_pipeline"', 'name: "mlp_pipeline_batched"') + BATCH_PARAMETER
# The same ensembles, their steps run in the ensemble's replica (rayinfer's steps_in_place).
IN_PLACE_PARAMETER = 'parameters { key: "steps_in_place" value: { string_value: "true" } }\n'
IN_PLACE_CONFIG = PIPELINE_CONFIG.replace('name: "mlp_pipeline"', 'name: "mlp_pipeline_in_place"') + IN_PLACE_PARAMETER
BATCHED_IN_PLACE_CONFIG = BATCHED_CONFIG.replace('name: "mlp_pipeline_batched"',
                                                 'name: "mlp_pipeline_batched_in_place"') + IN_PLACE_PARAMETER
PERF_MODELS = ("mlp", "scale", "mlp_pipeline", "mlp_pipeline_batched", "mlp_pipeline_in_place",
               "mlp_pipeline_batched_in_place", "nlp_encoder", "nlp_ensemble", "nlp_ensemble_in_place",
               "nlp_ensemble_batched_in_place")
# The encoder's inputs for perf_analyzer: random ids would index past the vocabulary.
ENCODER_TEXT = "this was a really great movie and i would watch it again with my family"
CHAIN = "one by one (client)"


def encoder_input_data(path: Path) -> Path:
    """perf_analyzer's --input-data file for ``nlp_encoder``: one tokenized sentence."""
    vocab = {word: i for i, word in enumerate(vocabulary())}
    ids = [2] + [vocab.get(word, 1) for word in ENCODER_TEXT.split()]
    ids += [0] * (SEQUENCE_LENGTH - len(ids))
    mask = [1 if i else 0 for i in ids]
    path.write_text(json.dumps({"data": [{"input_ids": ids, "attention_mask": mask}]}))
    return path


def write_repository(root: Path) -> None:
    write_model(root, "mlp", MLP_CONFIG, mlp_model())
    write_python_model(root, "scale", SCALE_CONFIG, SCALE_MODEL)
    (root / "mlp_pipeline" / "1").mkdir(parents=True)
    (root / "mlp_pipeline" / "config.pbtxt").write_text(PIPELINE_CONFIG)
    (root / "mlp_pipeline_batched" / "1").mkdir(parents=True)
    (root / "mlp_pipeline_batched" / "config.pbtxt").write_text(BATCHED_CONFIG)
    (root / "mlp_pipeline_in_place" / "1").mkdir(parents=True)
    (root / "mlp_pipeline_in_place" / "config.pbtxt").write_text(IN_PLACE_CONFIG)
    (root / "mlp_pipeline_batched_in_place" / "1").mkdir(parents=True)
    (root / "mlp_pipeline_batched_in_place" / "config.pbtxt").write_text(BATCHED_IN_PLACE_CONFIG)
    write_nlp_pipeline(root)
    nlp = (root / "nlp_ensemble" / "config.pbtxt").read_text()
    (root / "nlp_ensemble_in_place" / "1").mkdir(parents=True)
    (root / "nlp_ensemble_in_place" / "config.pbtxt").write_text(
        nlp.replace('name: "nlp_ensemble"', 'name: "nlp_ensemble_in_place"') + IN_PLACE_PARAMETER)
    (root / "nlp_ensemble_batched_in_place" / "1").mkdir(parents=True)
    (root / "nlp_ensemble_batched_in_place" / "config.pbtxt").write_text(
        nlp.replace('name: "nlp_ensemble"', 'name: "nlp_ensemble_batched_in_place"') + BATCH_PARAMETER + IN_PLACE_PARAMETER)


def client_chain(protocol: str, concurrency: int, seconds: float) -> dict[str, float]:
    """``concurrency`` threads, each calling scale then mlp with scale's output, for ``seconds``:
    chains per second and their p50 / p99 latency in us."""
    if protocol == "http":
        import tritonclient.http as module
    else:
        import tritonclient.grpc as module  # type: ignore[no-redef]
    url = f"127.0.0.1:{RAYINFER_PORT + (0 if protocol == 'http' else 1)}"
    latencies: list[float] = []
    lock = threading.Lock()
    start_at = time.monotonic() + 1.0  # every thread connected and warm first
    stop_at = start_at + seconds

    def run() -> None:
        client = module.InferenceServerClient(url)
        x = np.random.default_rng(0).standard_normal((1, 256)).astype(np.float32)
        mine = []
        while (now := time.monotonic()) < stop_at:
            first = module.InferInput("INPUT0", [1, 256], "FP32")
            first.set_data_from_numpy(x)
            scaled = client.infer("scale", [first]).as_numpy("OUTPUT0")
            second = module.InferInput("INPUT0", [1, 256], "FP32")
            second.set_data_from_numpy(scaled)
            client.infer("mlp", [second]).as_numpy("OUTPUT0")
            if now >= start_at:
                mine.append(time.monotonic() - now)
        client.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=run) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    latencies.sort()
    return {"infer_s": len(latencies) / seconds, "p50_us": latencies[len(latencies) // 2] * 1e6,
            "p99_us": latencies[int(len(latencies) * 0.99)] * 1e6, "batch": float("nan")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--protocols", default="http,grpc")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--measurement-interval", type=int, default=4000, help="ms per perf_analyzer window")
    parser.add_argument("--models", default=",".join((*PERF_MODELS, "chain")),
                        help="what to measure, of: " + ", ".join((*PERF_MODELS, "chain")))
    args = parser.parse_args()
    if not in_private_netns():
        ensure_anchor()
        reexec_in_netns()
    protocols = args.protocols.split(",")
    chosen = [CHAIN if m == "chain" else m for m in args.models.split(",")]
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="rayinfer-ensemble-") as tmp:
        work = Path(tmp)
        write_repository(work / "repo")
        encoder_data = encoder_input_data(work / "encoder.json")
        server = start_rayinfer(work / "repo", RAYINFER_PORT, work / "rayinfer.log")
        try:
            wait_ready(RAYINFER_PORT, server, 300)
            for round_ in range(args.rounds):
                for protocol in protocols:
                    for model in chosen:
                        if model == CHAIN:
                            result = client_chain(protocol, args.concurrency, args.measurement_interval / 1000 * 2)
                        else:
                            extra = ("--input-data", str(encoder_data)) if model == "nlp_encoder" else ()
                            result = perf_analyzer(RAYINFER_PORT, model, protocol, args.concurrency,
                                                   args.measurement_interval, work / "perf.csv", extra)
                        results.setdefault((protocol, model), []).append(result)
                        print(f"  round {round_ + 1} {protocol} {model}: {result}", flush=True)
        finally:
            stop_server(server)
    print("\n| protocol | concurrency | what | infer/s | p50 / p99 (us) | batch | against the slowest member |")
    print("|---|---|---|---|---|---|---|")
    labels = {"mlp": "`mlp` alone", "scale": "`scale` alone", "mlp_pipeline": "`mlp_pipeline` (ensemble: `scale`, `mlp`)",
              "mlp_pipeline_batched": "`mlp_pipeline_batched` (the same, its requests batched)",
              CHAIN: "`scale` then `mlp`, one by one from the client", "nlp_encoder": "`nlp_encoder` alone",
              "nlp_ensemble": "`nlp_ensemble` (tokenizer, encoder, head)",
              "mlp_pipeline_in_place": "`mlp_pipeline_in_place` (`mlp_pipeline`, its steps in place)",
              "mlp_pipeline_batched_in_place": "`mlp_pipeline_batched_in_place` (batched and in place)",
              "nlp_ensemble_in_place": "`nlp_ensemble_in_place` (`nlp_ensemble`, its steps in place)",
              "nlp_ensemble_batched_in_place": "`nlp_ensemble_batched_in_place` (batched and in place)"}
    for protocol in protocols:
        medians = {m: {k: statistics.median(r[k] for r in results[(protocol, m)]) for k in results[(protocol, m)][0]}
                   for m in chosen}
        nan = float("nan")
        slowest = min([medians[m]["infer_s"] for m in ("mlp", "scale") if m in medians] or [nan])
        encoder = medians.get("nlp_encoder", {}).get("infer_s", nan)
        # Each ensemble against its slowest member alone.
        against = {model: slowest for model in PERF_MODELS if model.startswith("mlp_pipeline")}
        against |= {model: encoder for model in PERF_MODELS if model.startswith("nlp_ensemble")}
        against[CHAIN] = slowest
        for model in (*PERF_MODELS[:6], CHAIN, *PERF_MODELS[6:]):
            if model not in medians:
                continue
            m = medians[model]
            ratio = f"{m['infer_s'] / against[model]:.2f}x" if model in against else ""
            batch = "" if np.isnan(m["batch"]) else f"{m['batch']:.1f}"
            print(f"| {protocol} | {args.concurrency} | {labels[model]} | {m['infer_s']:,.0f} | {m['p50_us']:,.0f} / "
                  f"{m['p99_us']:,.0f} | {batch} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
