#!/usr/bin/env python3
"""OpenVINO against ONNX Runtime on the same MLP, and FIL against a Python model calling
XGBoost on the same forest, served by one rayinfer in the same run.

    .venv/bin/python benchmarks/cpu_backends.py [--concurrency 8,32] [--protocols grpc] [--rounds 2]

Writes a repository holding the example ``mlp`` (onnxruntime) and ``mlp_openvino`` (the same
ONNX model converted to OpenVINO IR, FP32), both with max_batch_size 64, dynamic batching with a
500 us queue delay, one CPU instance and one inference thread; and the example ``fil_forest``
(XGBoost, 100 trees, FIL backend, ``cpu_nthread`` 1) beside ``forest_python``, a Python-backend
model that loads the same file with xgboost and predicts with ``inplace_predict`` on one thread,
with the same batching settings. Starts ``rayinfer serve`` on it inside a private network
namespace, checks that each pair answers alike, and runs NVIDIA's perf_analyzer (from the Triton
anchor) against each model in turn, ``--rounds`` times, alternating. Prints a markdown table of
the medians. Needs the fil and openvino extras.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
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
from rayinfer.cluster.example_backends import (
    FIL_FOREST_CONFIG, MLP_OPENVINO_CONFIG, forest_data, write_forest, write_openvino_model, xgboost_forest,
)
from rayinfer.cluster.example_repository import MLP_CONFIG, mlp_model, write_model, write_python_model

FOREST_PYTHON_CONFIG = FIL_FOREST_CONFIG.replace('name: "fil_forest"', 'name: "forest_python"').replace(
    'backend: "fil"', 'backend: "python"').split("parameters")[0]
# The forest predicted as a FIL model's output__0 with predict_proba: [1 - p, p] per row.
FOREST_PYTHON_MODEL = '''import numpy as np
import xgboost
import triton_python_backend_utils as pb_utils
from pathlib import Path


class TritonPythonModel:
    def initialize(self, args):
        self.booster = xgboost.Booster(model_file=str(Path(__file__).parent / "xgboost.ubj"))
        self.booster.set_param({"nthread": 1})

    def execute(self, requests):
        rows = [pb_utils.get_input_tensor_by_name(r, "input__0").as_numpy() for r in requests]
        p = self.booster.inplace_predict(np.concatenate(rows), validate_features=False).astype(np.float32)
        out, start = [], 0
        for x in rows:
            q = p[start:start + len(x)]
            start += len(x)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("output__0", np.stack([1 - q, q], axis=1))]))
        return out
'''
PAIRS = (("mlp", "mlp_openvino"), ("forest_python", "fil_forest"))
INPUTS = {"mlp": ("INPUT0", 256, "OUTPUT0"), "mlp_openvino": ("INPUT0", 256, "OUTPUT0"),
          "forest_python": ("input__0", 16, "output__0"), "fil_forest": ("input__0", 16, "output__0")}


def write_repository(root: Path) -> None:
    onnx_model = mlp_model()
    write_model(root, "mlp", MLP_CONFIG, onnx_model)
    write_openvino_model(root, "mlp_openvino", MLP_OPENVINO_CONFIG, onnx_model)
    forest = xgboost_forest()
    write_forest(root, "fil_forest", FIL_FOREST_CONFIG, forest, "xgboost.ubj")
    write_python_model(root, "forest_python", FOREST_PYTHON_CONFIG, FOREST_PYTHON_MODEL)
    forest.save_model(str(root / "forest_python" / "1" / "xgboost.ubj"))


def check_pairs_agree(port: int) -> dict[tuple[str, str], float]:
    import tritonclient.http as httpclient

    differences = {}
    with httpclient.InferenceServerClient(f"127.0.0.1:{port}") as client:
        for pair in PAIRS:
            outs = []
            for model in pair:
                name, features, output = INPUTS[model]
                x = forest_data(rows=4, seed=1)[0] if features == 16 else \
                    np.random.default_rng(1).standard_normal((4, features)).astype(np.float32)
                inp = httpclient.InferInput(name, list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                outs.append(client.infer(model, [inp]).as_numpy(output))
            differences[pair] = float(np.max(np.abs(outs[0] - outs[1])))
            if differences[pair] > 1e-3:
                raise RuntimeError(f"{pair[0]} and {pair[1]} disagree by {differences[pair]}")
    return differences


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--protocols", default="grpc")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--measurement-interval", type=int, default=3000, help="ms per perf_analyzer window")
    args = parser.parse_args()
    if not in_private_netns():
        ensure_anchor()
        reexec_in_netns()
    protocols, levels = args.protocols.split(","), [int(c) for c in args.concurrency.split(",")]
    results: dict[tuple[str, int, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="rayinfer-backends-") as tmp:
        work = Path(tmp)
        write_repository(work / "repo")
        server = start_rayinfer(work / "repo", RAYINFER_PORT, work / "rayinfer.log")
        try:
            wait_ready(RAYINFER_PORT, server, 600)
            for pair, difference in check_pairs_agree(RAYINFER_PORT).items():
                print(f"{pair[0]} and {pair[1]} agree (largest difference {difference:.2e})", flush=True)
            for round_ in range(args.rounds):
                for protocol in protocols:
                    for concurrency in levels:
                        for model in (m for pair in PAIRS for m in pair):
                            result = perf_analyzer(RAYINFER_PORT, model, protocol, concurrency,
                                                   args.measurement_interval, work / "perf.csv")
                            results.setdefault((protocol, concurrency, model), []).append(result)
                            print(f"  round {round_ + 1} {protocol} c={concurrency} {model}: {result}", flush=True)
        finally:
            stop_server(server)
    print("\n| protocol | concurrency | baseline | infer/s | candidate | infer/s | ratio | p99 (us) baseline / candidate "
          "| batch baseline / candidate |")
    print("|---|---|---|---|---|---|---|---|---|")
    for protocol in protocols:
        for concurrency in levels:
            for base, candidate in PAIRS:
                b, c = ({k: statistics.median(r[k] for r in results[(protocol, concurrency, m)])
                         for k in results[(protocol, concurrency, m)][0]} for m in (base, candidate))
                print(f"| {protocol} | {concurrency} | {base} | {b['infer_s']:,.0f} | {candidate} | {c['infer_s']:,.0f} | "
                      f"{c['infer_s'] / b['infer_s']:.2f}x | {b['p99_us']:,.0f} / {c['p99_us']:,.0f} | "
                      f"{b['batch']:.1f} / {c['batch']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
