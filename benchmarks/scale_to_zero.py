#!/usr/bin/env python3
"""Cold starts of models that scale to zero (``autoscaling_min_replicas`` 0): how long the
first request after an idle spell waits for its replica, over HTTP and gRPC.

    .venv/bin/python benchmarks/scale_to_zero.py [--rounds 4]

Writes a repository holding two models that scale to zero after 2 s idle (``autoscaling_
downscale_to_zero_delay_s``) and back to one replica: ``py_cold`` (a Python model answering the
PID of its replica) and ``onnx_cold`` (the example's ``simple`` add/sub ONNX model), starts
``rayinfer serve`` on it inside a private network namespace, and for each round and protocol
waits until the model has no replica process left, then times one request (the cold start) and
one more right after it (warm). Prints each cold start and the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto

from compare_triton import in_private_netns, reexec_in_netns, start_rayinfer, stop_server, wait_ready
from rayinfer.cluster.example_repository import SIMPLE_CONFIG, add_sub_model, write_model, write_python_model

PORT = 18720
TO_ZERO = """parameters { key: "autoscaling_min_replicas" value: { string_value: "0" } }
parameters { key: "autoscaling_max_replicas" value: { string_value: "1" } }
parameters { key: "autoscaling_downscale_to_zero_delay_s" value: { string_value: "2" } }
"""
PY_CONFIG = """name: "py_cold"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
""" + TO_ZERO
PY_MODEL = '''import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PID", np.array([[os.getpid()]], np.int64))])
                for _ in requests]
'''


def replica_processes(model: str) -> int:
    """Serve replica processes of ``model`` on this machine (Ray titles them
    ``ray::ServeReplica:<app>:<deployment>``)."""
    title = f"ray::ServeReplica:{model}:".encode()
    count = 0
    for entry in Path("/proc").iterdir():
        try:
            count += entry.name.isdigit() and title in (entry / "cmdline").read_bytes()
        except OSError:
            continue
    return count


def call(protocol: str, model: str) -> float:
    """One request; its latency in seconds."""
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    module = httpclient if protocol == "http" else grpcclient
    url = f"127.0.0.1:{PORT}" if protocol == "http" else f"127.0.0.1:{PORT + 1}"
    client = module.InferenceServerClient(url, **({"network_timeout": 300.0} if protocol == "http" else {}))
    names = ["INPUT0"] if model == "py_cold" else ["INPUT0", "INPUT1"]
    inputs = [module.InferInput(name, [1, 16], "INT32") for name in names]
    for tensor in inputs:
        tensor.set_data_from_numpy(data)
    start = time.perf_counter()
    client.infer(model, inputs)
    elapsed = time.perf_counter() - start
    client.close()
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    if not in_private_netns():
        reexec_in_netns()
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="rayinfer-scale-to-zero-") as tmp:
        repo = Path(tmp) / "repo"
        write_python_model(repo, "py_cold", PY_CONFIG, PY_MODEL)
        write_model(repo, "onnx_cold", SIMPLE_CONFIG.replace('name: "simple"', 'name: "onnx_cold"') + TO_ZERO,
                    add_sub_model(TensorProto.INT32))
        server = start_rayinfer(repo, PORT, Path(tmp) / "rayinfer.log")
        try:
            wait_ready(PORT, server, 300)
            for round_ in range(args.rounds):
                for model in ("py_cold", "onnx_cold"):
                    for protocol in ("http", "grpc"):
                        deadline = time.monotonic() + 120
                        while replica_processes(model) and time.monotonic() < deadline:
                            time.sleep(0.2)
                        if replica_processes(model):
                            raise SystemExit(f"{model} did not scale to zero within 120 s")
                        cold, warm = call(protocol, model), call(protocol, model)
                        results.setdefault((model, protocol), []).append((cold, warm))
                        print(f"  round {round_ + 1}  {model:9s} {protocol:4s}  cold {cold:6.2f} s  "
                              f"warm {warm * 1000:6.1f} ms", flush=True)
        finally:
            stop_server(server)
    print("\n| model | protocol | cold starts (s) | median cold start (s) | median warm request after it (ms) |")
    print("|---|---|---|---|---|")
    for (model, protocol), rows in results.items():
        colds = ", ".join(f"{c:.2f}" for c, _ in rows)
        print(f"| {model} | {protocol} | {colds} | {statistics.median(c for c, _ in rows):.2f} | "
              f"{statistics.median(w for _, w in rows) * 1000:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
