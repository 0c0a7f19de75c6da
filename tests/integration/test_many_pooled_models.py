"""Sixty small models (thirty ONNX, thirty Python) on a server of its own, as a user would serve
them: default model control, ``--model-hosting pool --pool-max-models 15``. The server is ready
with most of them unloaded, and every model answers right over HTTP and gRPC (most of them
loading again on the way) and counts its own statistics and metrics. (A model failing in the
pool beside its neighbours: test_model_pool.py; hundreds of models on one node, their memory and
start: benchmarks/model_memory.py.)"""

from __future__ import annotations

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import HTTP_PORT, add_sub_inputs, http_json, pids_titled, port_flags, start_server, stop_server, stop_shared_server
from waiting import wait_until

pytestmark = pytest.mark.own_cluster

PORT = HTTP_PORT + 900
MODELS = [f"tiny_{i:03d}" for i in range(60)]
PYTHON = MODELS[30:]  # the same add/sub in a model.py of its own
ADD_SUB_PY = """import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", a + b),
                                                         pb_utils.Tensor("OUTPUT1", a - b)]))
        return responses
"""
MAX_MODELS = 15
NOT_LOADED = "not loaded now (--pool-max-models)"


def write_repository(root):
    from onnx import TensorProto

    from rayinfer.cluster.example_repository import SIMPLE_CONFIG, add_sub_model, write_model, write_python_model

    model = add_sub_model(TensorProto.INT32)
    for name in MODELS:
        config = SIMPLE_CONFIG.replace('name: "simple"', f'name: "{name}"')
        if name in PYTHON:
            write_python_model(root, name, config.replace('platform: "onnxruntime_onnx"', 'backend: "python"'), ADD_SUB_PY)
        else:
            write_model(root, name, config, model)
    return root


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    stop_shared_server()  # one Ray cluster at a time on a small machine
    repo = write_repository(tmp_path_factory.mktemp("many_models"))
    log = tmp_path_factory.mktemp("many_server") / "rayinfer.log"
    proc = start_server(repo, log, [
        "--model-hosting", "pool", "--pool-max-models", str(MAX_MODELS), *port_flags(PORT), "--openai-api=false",
    ])
    try:
        yield log
    finally:
        stop_server(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]


def index() -> dict[str, dict]:
    status, rows = http_json("POST", "/v2/repository/index", port=PORT)
    assert status == 200
    return {row["name"]: row for row in rows}


def test_pooled_models_past_the_budget_each_answer_and_count_their_own(many):
    rows = index()
    assert all(rows[name]["state"] == "READY" for name in MODELS)
    unloaded = [name for name in MODELS if NOT_LOADED in rows[name].get("reason", "")]
    assert len(unloaded) == len(MODELS) - MAX_MODELS  # every one loaded once at start, 15 kept
    assert len(pids_titled("ServeReplica:rayinfer-pool:")) == 1
    assert not pids_titled("ServeReplica:tiny_")  # no model has a replica of its own
    status, _ = http_json("GET", "/v2/health/ready", port=PORT)
    assert status == 200  # ready, with most models loading on their first request

    def ask(name: str) -> str | None:
        i = MODELS.index(name)
        a = np.full((1, 16), i, np.int32)
        b = np.arange(16, dtype=np.int32).reshape(1, 16)
        http = httpclient.InferenceServerClient(f"127.0.0.1:{PORT}", network_timeout=120.0)
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{PORT + 1}")
        try:
            for client, module in ((http, httpclient), (grpc, grpcclient)):
                result = client.infer(name, add_sub_inputs(a, b) if module is httpclient else
                                      [_grpc_input("INPUT0", a), _grpc_input("INPUT1", b)])
                if not ((result.as_numpy("OUTPUT0") == a + b).all() and (result.as_numpy("OUTPUT1") == a - b).all()):
                    return f"{name}: a wrong answer"
        except Exception as exc:  # noqa: BLE001  # reported with the model's name
            return f"{name}: {exc}"
        finally:
            http.close()
            grpc.close()
        return None

    with ThreadPoolExecutor(4) as workers:
        errors = [e for e in workers.map(ask, MODELS) if e is not None]
    assert not errors, errors[:5]

    def counts() -> dict[str, int]:
        _, doc = http_json("GET", "/v2/models/stats", port=PORT)
        return {s["name"]: s["inference_stats"]["success"]["count"] for s in doc["model_stats"]}

    wait_until(lambda: all(counts().get(name) == 2 for name in MODELS), "each model's own two successes")
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT + 2}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    success = dict(re.findall(r'nv_inference_request_success\{model="(tiny_\d+)",version="1"\} (\d+)', metrics))
    assert {name: int(success.get(name, -1)) for name in MODELS} == {name: 2 for name in MODELS}
    # Past the budget while four were busy at once, the pool comes back to it.
    wait_until(lambda: sum(NOT_LOADED not in row.get("reason", "") for name, row in index().items()
                           if name in MODELS) == MAX_MODELS, f"the pool back to {MAX_MODELS} models loaded")
    assert len(pids_titled("ServeReplica:rayinfer-pool:")) == 1


def _grpc_input(name: str, array: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), "INT32")
    tensor.set_data_from_numpy(array)
    return tensor
