#!/usr/bin/env python3
"""The example MLP served as TorchScript and as ONNX by one rayinfer, in the same run.

    .venv/bin/python benchmarks/torchscript_vs_onnx.py [--concurrency 8] [--protocols http,grpc] [--rounds 3]

Writes a repository holding the example ``mlp`` (ONNX, onnxruntime) and ``mlp_torchscript``
(the ONNX model's own weights in a scripted torch module), both with max_batch_size 64, dynamic batching
with a 500 us queue delay, one CPU instance and one intra-op thread, starts ``rayinfer serve``
on it inside a private network namespace, checks that both give the same outputs, and runs
NVIDIA's perf_analyzer (from the Triton anchor) against each model in turn, ``--rounds`` times,
alternating. Prints a markdown table of the medians. Needs the torch extra.
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
from rayinfer.cluster.example_repository import MLP_CONFIG, mlp_model, write_model

DIMS = (256, 1024, 1024, 10)
TORCHSCRIPT_CONFIG = (
    MLP_CONFIG.replace('name: "mlp"', 'name: "mlp_torchscript"')
    .replace('backend: "onnxruntime"', 'platform: "pytorch_libtorch"')
    .replace("INPUT0", "INPUT__0").replace("OUTPUT0", "OUTPUT__0")
    .replace('parameters { key: "intra_op_thread_count" value: { string_value: "1" } }',
             'parameters { key: "INTRA_OP_THREAD_COUNT" value: { string_value: "1" } }\n'
             'parameters { key: "INTER_OP_THREAD_COUNT" value: { string_value: "1" } }')
)


def torchscript_mlp(onnx_model):
    """The ONNX MLP's layers as a scripted module, with its very weights (its Gemm initializers)."""
    import torch
    from onnx import numpy_helper

    weights = {init.name: numpy_helper.to_array(init) for init in onnx_model.graph.initializer}
    layers: list[torch.nn.Module] = []
    for i in range(len(DIMS) - 1):
        linear = torch.nn.Linear(DIMS[i], DIMS[i + 1])
        with torch.no_grad():  # Gemm computes x @ W + B; Linear computes x @ weight.T + bias
            linear.weight.copy_(torch.from_numpy(weights[f"W{i}"].T.copy()))
            linear.bias.copy_(torch.from_numpy(weights[f"B{i}"].copy()))
        layers.append(linear)
        if i < len(DIMS) - 2:
            layers.append(torch.nn.ReLU())
    return torch.jit.script(torch.nn.Sequential(*layers).eval())


def write_repository(root: Path) -> None:
    import torch

    onnx_model = mlp_model(DIMS)
    write_model(root, "mlp", MLP_CONFIG, onnx_model)
    (root / "mlp_torchscript" / "1").mkdir(parents=True)
    (root / "mlp_torchscript" / "config.pbtxt").write_text(TORCHSCRIPT_CONFIG)
    torch.jit.save(torchscript_mlp(onnx_model), str(root / "mlp_torchscript" / "1" / "model.pt"))


def check_same_outputs(port: int) -> float:
    import tritonclient.http as httpclient

    x = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    with httpclient.InferenceServerClient(f"127.0.0.1:{port}") as client:
        outs = []
        for model, name in (("mlp", "INPUT0"), ("mlp_torchscript", "INPUT__0")):
            inp = httpclient.InferInput(name, list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            result = client.infer(model, [inp])
            outs.append(result.as_numpy("OUTPUT0" if model == "mlp" else "OUTPUT__0"))
    difference = float(np.max(np.abs(outs[0] - outs[1])))
    if difference > 1e-3:
        raise RuntimeError(f"the two models disagree by {difference}")
    return difference


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--protocols", default="http,grpc")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measurement-interval", type=int, default=3000, help="ms per perf_analyzer window")
    args = parser.parse_args()
    if not in_private_netns():
        ensure_anchor()
        reexec_in_netns()
    protocols = args.protocols.split(",")
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="rayinfer-ts-") as tmp:
        work = Path(tmp)
        write_repository(work / "repo")
        server = start_rayinfer(work / "repo", RAYINFER_PORT, work / "rayinfer.log")
        try:
            wait_ready(RAYINFER_PORT, server, 300)
            print(f"outputs agree (largest difference {check_same_outputs(RAYINFER_PORT):.2e})", flush=True)
            for round_ in range(args.rounds):
                for protocol in protocols:
                    for model in ("mlp", "mlp_torchscript"):
                        result = perf_analyzer(RAYINFER_PORT, model, protocol, args.concurrency,
                                               args.measurement_interval, work / "perf.csv")
                        results.setdefault((protocol, model), []).append(result)
                        print(f"  round {round_ + 1} {protocol} {model}: {result}", flush=True)
        finally:
            stop_server(server)
    print(f"\n| protocol | concurrency | ONNX Runtime infer/s | TorchScript infer/s | ratio | "
          "ONNX p50 / p99 (us) | TorchScript p50 / p99 (us) | batch ONNX / TorchScript |")
    print("|---|---|---|---|---|---|---|---|")
    for protocol in protocols:
        onnx, ts = ({k: statistics.median(r[k] for r in results[(protocol, m)]) for k in results[(protocol, m)][0]}
                    for m in ("mlp", "mlp_torchscript"))
        print(f"| {protocol} | {args.concurrency} | {onnx['infer_s']:,.0f} | {ts['infer_s']:,.0f} | "
              f"{ts['infer_s'] / onnx['infer_s']:.2f}x | {onnx['p50_us']:,.0f} / {onnx['p99_us']:,.0f} | "
              f"{ts['p50_us']:,.0f} / {ts['p99_us']:,.0f} | {onnx['batch']:.1f} / {ts['batch']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
