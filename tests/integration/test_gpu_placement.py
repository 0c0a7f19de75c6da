"""KIND_GPU instance groups on a Ray cluster with one logical GPU (``rayinfer serve --num-gpus 1``
on this CPU machine, with ``--gpu-fraction-per-model 0.5``): fractional GPU replicas, two models
sharing the GPU, what each replica is given, and a model asking for more GPUs than the cluster
has left, reported while the others serve; a model asking for more CPUs than the cluster has
free, reported at once and then UNAVAILABLE; CUDA shared memory registered on a cluster with a
GPU."""

from __future__ import annotations

import base64
import concurrent.futures
import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import HTTP_PORT, port_flags, start_server, stop_server, stop_shared_server
from onnx import TensorProto

from rayinfer.adapters.base import backend_uses_gpus
from rayinfer.cluster.example_repository import SIMPLE_CONFIG, add_sub_model, write_model, write_python_model
from waiting import wait_until

pytestmark = pytest.mark.own_cluster

PORT = HTTP_PORT + 200
GPU_WAIT_S = 8
RESOURCE_WAIT_S = 8
# Each replica reserves this many of the cluster's 2 CPUs (start_server's --num-cpus 2).
REPLICA_CPUS = 0.3

PROBE = '''import json, os
import numpy as np
import ray
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.kind = args["model_instance_kind"]
        self.device = args["model_instance_device_id"]
        self.config_kind = json.loads(args["model_config"])["instance_group"][0]["kind"]

    def execute(self, requests):
        answer = json.dumps({
            "pid": os.getpid(), "kind": self.kind, "device": self.device, "config_kind": self.config_kind,
            "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        })
        out = np.array([[answer.encode()]], dtype=object)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("ANSWER", out)]) for _ in requests]
'''


def probe_config(groups: str) -> str:
    return f"""backend: "python"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "ANSWER" data_type: TYPE_STRING dims: [ 1, 1 ] }} ]
{groups}
"""


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    stop_shared_server()  # one Ray cluster at a time on a small machine
    repo = tmp_path_factory.mktemp("gpu_repo")
    # --gpu-fraction-per-model 0.5: each model's GPU instances reserve half the GPU together.
    # Two instances sharing it: two replicas at 0.25 GPU each.
    write_python_model(repo, "gpu_probe", probe_config("instance_group [ { count: 2 kind: KIND_GPU } ]"), PROBE)
    # One instance: 0.5, beside gpu_probe; then the GPU is full for gpu_too_many.
    write_python_model(repo, "gpu_single", probe_config("instance_group [ { count: 1 kind: KIND_GPU } ]"), PROBE)
    write_python_model(repo, "gpu_too_many", probe_config("instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]"), PROBE)
    write_python_model(repo, "cpu_probe", probe_config("instance_group [ { count: 1 kind: KIND_CPU } ]"), PROBE)
    # No instance_group (Triton's default, KIND_AUTO): GPU instances only where onnxruntime can use a GPU.
    write_model(repo, "onnx_auto", SIMPLE_CONFIG.replace('name: "simple"\n', ""), add_sub_model(TensorProto.INT32))
    # Seven instances at 0.3 CPU each: more than the cluster's 2 CPUs.
    write_model(repo, "cpu_too_many", SIMPLE_CONFIG.replace('name: "simple"\n', "")
                + "instance_group [ { count: 7 kind: KIND_CPU } ]\n", add_sub_model(TensorProto.INT32))
    log = tmp_path_factory.mktemp("gpu_server") / "rayinfer.log"
    proc = start_server(repo, log, [
        "--num-gpus", "1", "--gpu-fraction-per-model", "0.5", "--gpu-wait-secs", str(GPU_WAIT_S),
        "--replica-num-cpus", str(REPLICA_CPUS), "--resource-wait-secs", str(RESOURCE_WAIT_S),
        "--model-control-mode", "explicit",
        "--load-model", "gpu_probe", "--load-model", "cpu_probe", *port_flags(PORT), "--openai-api=false",
    ])
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{PORT}", network_timeout=120.0)
        yield client, log
    finally:
        stop_server(proc)


def answers(client, model: str, replicas: int) -> dict[int, dict]:
    """The probe's answer from each of ``replicas`` replicas, by process id (the front picks a
    replica at random per call, among those registered so far)."""
    seen: dict[int, dict] = {}

    def ask() -> bool:
        inp = httpclient.InferInput("IN", [1], "INT32")
        inp.set_data_from_numpy(np.array([1], dtype=np.int32))
        answer = json.loads(client.infer(model, [inp]).as_numpy("ANSWER")[0, 0])
        seen[answer["pid"]] = answer
        return len(seen) >= replicas

    wait_until(ask, f"{replicas} replica(s) of {model} to answer", interval_s=0.05)
    return seen


def test_two_instances_share_one_logical_gpu(gpu_server):
    client, _ = gpu_server
    replicas = answers(client, "gpu_probe", 2)
    assert len(replicas) == 2  # count: 2 -> two replicas
    for answer in replicas.values():
        assert answer["kind"] == "GPU" and answer["device"] == "0" and answer["config_kind"] == "KIND_GPU"
        assert len(answer["gpu_ids"]) == 1
        assert answer["cuda_visible_devices"] == answer["gpu_ids"][0]
    # 0.25 + 0.25 on the one GPU.
    assert {a["gpu_ids"][0] for a in replicas.values()} == {"0"}
    config = client.get_model_config("gpu_probe")
    assert [(g["kind"], g["count"]) for g in config["instance_group"]] == [("KIND_GPU", 2)]


def test_cpu_instances_get_no_gpu(gpu_server):
    client, _ = gpu_server
    (answer,) = answers(client, "cpu_probe", 1).values()
    assert answer["kind"] == "CPU" and answer["gpu_ids"] == []


@pytest.mark.skipif(backend_uses_gpus("onnxruntime"), reason="shows onnxruntime's CPU build: the GPU build "
                    "is installed here (its model would be a GPU replica)")
def test_a_model_without_instance_groups_runs_on_cpus_where_its_backend_has_no_gpu(gpu_server):
    """An ONNX model without instance_group on a cluster with a GPU, onnxruntime's CPU build
    installed: CPU instances that serve (not a GPU replica that cannot load), as Triton's
    KIND_AUTO chooses GPU instances only for a backend that can use them."""
    client, _ = gpu_server
    client.load_model("onnx_auto")
    try:
        assert [g["kind"] for g in client.get_model_config("onnx_auto")["instance_group"]] == ["KIND_CPU"]
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs = [httpclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(a)
        np.testing.assert_array_equal(client.infer("onnx_auto", inputs).as_numpy("OUTPUT0"), 2 * a)
    finally:
        client.unload_model("onnx_auto")


def test_models_share_the_gpu_by_their_fraction_and_one_too_many_is_reported(gpu_server):
    """gpu_single's 0.5 fits beside gpu_probe's 2 x 0.25 (two models on one GPU); gpu_too_many's
    0.5 then waits, is reported while it waits, and fails naming the GPUs while the others serve."""
    client, _ = gpu_server
    client.load_model("gpu_single")
    (single,) = answers(client, "gpu_single", 1).values()
    assert single["kind"] == "GPU" and single["gpu_ids"] == ["0"]
    try:
        _one_too_many(client)
    finally:
        client.unload_model("gpu_single")


def _one_too_many(client) -> None:

    def load() -> str:
        with httpclient.InferenceServerClient(f"127.0.0.1:{PORT}", network_timeout=120.0) as own:
            with pytest.raises(InferenceServerException) as failure:
                own.load_model("gpu_too_many")
        return str(failure.value)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        loading = pool.submit(load)

        def waiting_reason() -> str:
            rows = {row["name"]: row for row in client.get_model_repository_index()}
            return rows["gpu_too_many"].get("reason", "")

        # While it waits, the index says for what.
        wait_until(lambda: waiting_reason().startswith("waiting for GPU resources: 1 of its 1 replicas need 0.5 GPU"),
                   "the index to say that gpu_too_many waits for a GPU", timeout_s=GPU_WAIT_S)
        # Readiness and metadata over HTTP answer at once while it loads, as in Triton.
        with httpclient.InferenceServerClient(f"127.0.0.1:{PORT}", network_timeout=5.0) as quick:
            assert not quick.is_model_ready("gpu_too_many")
            with pytest.raises(InferenceServerException, match="waiting for GPU resources") as metadata:
                quick.get_model_metadata("gpu_too_many")
            assert metadata.value.status() == "404"  # as for any model not ready
            assert quick.is_model_ready("gpu_probe") and quick.get_model_metadata("gpu_probe")["name"] == "gpu_probe"
        message = loading.result(timeout=120)
    assert (f"waited {GPU_WAIT_S} s for GPU resources: 1 of its 1 replicas need 0.5 GPU each; "
            "the cluster has 1 GPU(s), 0 free") in message
    assert not client.is_model_ready("gpu_too_many")
    with grpcclient.InferenceServerClient(f"127.0.0.1:{PORT + 1}") as grpc:
        assert not grpc.is_model_ready("gpu_too_many")
    rows = {row["name"]: row for row in client.get_model_repository_index()}
    assert rows["gpu_too_many"]["state"] == "UNAVAILABLE"
    assert "GPU resources" in rows["gpu_too_many"]["reason"]
    assert client.is_model_ready("gpu_probe") and client.is_model_ready("cpu_probe") and client.is_model_ready("gpu_single")


def test_a_model_the_cluster_has_no_cpus_for_is_reported_at_once_then_unavailable(gpu_server):
    """Seven replicas at 0.3 CPU on a cluster of 2 CPUs: the log and the repository index say at
    once which resource is missing, how much and what to change; after --resource-wait-secs the
    load fails with that reason, and the other models serve on."""
    client, log = gpu_server

    def load() -> str:
        with httpclient.InferenceServerClient(f"127.0.0.1:{PORT}", network_timeout=120.0) as own:
            with pytest.raises(InferenceServerException) as failure:
                own.load_model("cpu_too_many")
        return str(failure.value)

    def waiting_reason() -> str:
        rows = {row["name"]: row for row in client.get_model_repository_index()}
        return rows["cpu_too_many"].get("reason", "")

    needs = f"of its 7 replicas need {REPLICA_CPUS:g} CPU each; the cluster has 2 CPU ("
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        loading = pool.submit(load)
        wait_until(lambda: waiting_reason().startswith("waiting for CPU resources: ") and needs in waiting_reason(),
                   "the index to say that cpu_too_many waits for CPUs", timeout_s=RESOURCE_WAIT_S)
        assert "lower --replica-num-cpus or the model's instance count" in waiting_reason()
        wait_until(lambda: f"model 'cpu_too_many' waits for CPU resources (up to {RESOURCE_WAIT_S} s)" in
                   log.read_text(), "the log to say that cpu_too_many waits for CPUs", timeout_s=5)
        message = loading.result(timeout=120)
    assert f"waited {RESOURCE_WAIT_S} s for CPU resources: " in message and needs in message
    rows = {row["name"]: row for row in client.get_model_repository_index()}
    assert rows["cpu_too_many"]["state"] == "UNAVAILABLE" and "CPU resources" in rows["cpu_too_many"]["reason"]
    assert client.is_model_ready("gpu_probe") and client.is_model_ready("cpu_probe")


def test_cuda_shared_memory_registers_where_the_cluster_has_gpus(gpu_server):
    """A cluster with a GPU names the extension and keeps CUDA regions (over both protocols); a
    request naming one gets an error naming the region where the model's replica cannot open
    its handle (here: a made-up handle, on a machine with or without the CUDA driver)."""
    client, _ = gpu_server
    assert "cuda_shared_memory" in client.get_server_metadata()["extensions"]
    handle = base64.b64encode(bytes(range(64)))
    with grpcclient.InferenceServerClient(f"127.0.0.1:{PORT + 1}") as grpc:
        client.register_cuda_shared_memory("by_http", handle, 0, 64)
        grpc.register_cuda_shared_memory("by_grpc", handle, 0, 16)
        assert client.get_cuda_shared_memory_status() == [
            {"name": "by_grpc", "device_id": 0, "byte_size": 16}, {"name": "by_http", "device_id": 0, "byte_size": 64}]
        status = grpc.get_cuda_shared_memory_status("by_http", as_json=True)
        assert status["regions"]["by_http"]["byte_size"] == "64"
        assert client.get_system_shared_memory_status() == []
        with pytest.raises(InferenceServerException, match="registered as CUDA shared memory, not system"):
            client.get_system_shared_memory_status("by_http")
        for infer, module in ((client.infer, httpclient), (grpc.infer, grpcclient)):
            inp = module.InferInput("IN", [1], "INT32")
            inp.set_shared_memory("by_grpc", 4)
            with pytest.raises(InferenceServerException) as failure:
                infer("gpu_probe", [inp])
            assert "Unable to open CUDA shared memory region 'by_grpc' on GPU 0: " in str(failure.value)
        grpc.unregister_cuda_shared_memory()
        assert client.get_cuda_shared_memory_status() == []
    answers(client, "gpu_probe", 1)  # the model still serves
