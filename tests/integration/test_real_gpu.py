"""KIND_GPU models on a machine with a real NVIDIA GPU: Ray finds the GPU itself (no
``--num-gpus``), two instances share it as two replicas at 0.5 GPU, a TorchScript model runs on
CUDA there, and an ONNX model on GPU instances runs on onnxruntime's CUDA provider (or, without
the gpu extra, fails to load naming it while the others serve); inputs and outputs in CUDA
shared memory as Triton's simple_*_cudashm_client examples use it. Skipped without a GPU.

The machine may have one GPU: each test loads its model (explicit model control) and unloads it
at the end, so that the next one finds the GPU free."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import HTTP_PORT, port_flags, start_server, stop_server, stop_shared_server
from rayinfer.cluster.example_repository import SIMPLE_CONFIG, add_sub_model, write_model, write_python_model
from waiting import wait_until

torch = pytest.importorskip("torch", reason="needs PyTorch (the torch or test extra)")
pytestmark = [
    pytest.mark.own_cluster,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA"),
]

PORT = HTTP_PORT + 700

PROBE = '''import json, os
import numpy as np
import ray
import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.kind = args["model_instance_kind"]
        self.device = args["model_instance_device_id"]

    def execute(self, requests):
        answer = json.dumps({
            "pid": os.getpid(), "kind": self.kind, "device": self.device,
            "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cuda_devices": torch.cuda.device_count(),
            "gpu_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        })
        out = np.array([[answer.encode()]], dtype=object)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("ANSWER", out)]) for _ in requests]
'''

PROBE_CONFIG = """backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "ANSWER" data_type: TYPE_STRING dims: [ 1, 1 ] } ]
instance_group [ { count: 2 kind: KIND_GPU } ]
"""

TS_CONFIG = """platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [
  { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT__1" data_type: TYPE_INT32 dims: [ 1 ] }
]
instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]
dynamic_batching { max_queue_delay_microseconds: 2000 }
"""

# The example's simple model in FP32, on GPU instances.
ONNX_CONFIG = SIMPLE_CONFIG.replace('name: "simple"\n', "").replace("TYPE_INT32", "TYPE_FP32") + \
    "instance_group [ { count: 1 kind: KIND_GPU } ]\n"


# OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 (the example's simple) on a GPU instance,
# so that its replica sees the GPU the client's CUDA shared memory is on.
ADD_SUB = '''import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", a + b),
                                                         pb_utils.Tensor("OUTPUT1", a - b)]))
        return responses
'''

ADD_SUB_CONFIG = """backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
instance_group [ { count: 1 kind: KIND_GPU } ]
"""


def cuda_linear():
    """OUTPUT__0 = 2 * x + 1 through a Linear layer, OUTPUT__1 = 1 where it ran on CUDA."""

    class OnDevice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            with torch.no_grad():
                self.linear.weight.copy_(2 * torch.eye(4))
                self.linear.bias.fill_(1.0)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            on_cuda = torch.full([x.shape[0], 1], 1 if x.is_cuda else 0, dtype=torch.int32, device=x.device)
            return self.linear(x), on_cuda

    return torch.jit.script(OnDevice())


def onnx_has_cuda() -> bool:
    import onnxruntime

    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    stop_shared_server()  # one Ray cluster at a time
    repo = tmp_path_factory.mktemp("real_gpu_repo")
    write_python_model(repo, "gpu_probe", PROBE_CONFIG, PROBE)
    write_python_model(repo, "cuda_add_sub", ADD_SUB_CONFIG, ADD_SUB)
    version_dir = repo / "ts_cuda" / "1"
    version_dir.mkdir(parents=True)
    (repo / "ts_cuda" / "config.pbtxt").write_text(TS_CONFIG)
    torch.jit.save(cuda_linear(), str(version_dir / "model.pt"))
    from onnx import TensorProto

    write_model(repo, "onnx_gpu", ONNX_CONFIG, add_sub_model(TensorProto.FLOAT))
    log = tmp_path_factory.mktemp("real_gpu_server") / "rayinfer.log"
    proc = start_server(repo, log, [
        "--model-control-mode", "explicit", "--gpu-wait-secs", "20",
        *port_flags(PORT),
    ])
    try:
        yield httpclient.InferenceServerClient(f"127.0.0.1:{PORT}", network_timeout=120.0), log
    finally:
        stop_server(proc)


@pytest.fixture
def loaded(gpu_server):
    """Loads a model of the repository for one test and unloads it afterwards."""
    client, _ = gpu_server
    names: list[str] = []

    def load(name: str) -> None:
        names.append(name)
        client.load_model(name)

    yield load
    for name in names:
        client.unload_model(name)
        wait_until(lambda n=name: not client.is_model_ready(n), f"{name} to unload")


def test_two_instances_share_the_real_gpu(gpu_server, loaded):
    client, _ = gpu_server
    loaded("gpu_probe")
    seen: dict[int, dict] = {}

    def ask() -> bool:
        inp = httpclient.InferInput("IN", [1], "INT32")
        inp.set_data_from_numpy(np.array([1], dtype=np.int32))
        answer = json.loads(client.infer("gpu_probe", [inp]).as_numpy("ANSWER")[0, 0])
        seen[answer["pid"]] = answer
        return len(seen) >= 2

    wait_until(ask, "both replicas of gpu_probe to answer", interval_s=0.05)
    assert len(seen) == 2
    for answer in seen.values():
        assert answer["kind"] == "GPU" and answer["device"] == "0"
        assert answer["gpu_ids"] == ["0"] and answer["cuda_visible_devices"] == "0"
        assert answer["cuda_devices"] == 1 and answer["gpu_name"].startswith("NVIDIA")


def test_torchscript_runs_on_cuda_through_both_protocols(gpu_server, loaded):
    client, _ = gpu_server
    loaded("ts_cuda")
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    inp = httpclient.InferInput("INPUT__0", [3, 4], "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("ts_cuda", [inp])
    np.testing.assert_allclose(result.as_numpy("OUTPUT__0"), 2 * x + 1, rtol=1e-5)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__1"), [[1], [1], [1]])
    with grpcclient.InferenceServerClient(f"127.0.0.1:{PORT + 1}") as grpc:
        g = grpcclient.InferInput("INPUT__0", [3, 4], "FP32")
        g.set_data_from_numpy(x)
        answer = grpc.infer("ts_cuda", [g])
        np.testing.assert_allclose(answer.as_numpy("OUTPUT__0"), 2 * x + 1, rtol=1e-5)
        np.testing.assert_array_equal(answer.as_numpy("OUTPUT__1"), [[1], [1], [1]])


def test_onnx_on_gpu_instances(gpu_server, loaded):
    client, _ = gpu_server
    if not onnx_has_cuda():
        loaded("ts_cuda")
        client.unload_model("ts_cuda")  # the GPU free again for onnx_gpu
        wait_until(lambda: not client.is_model_ready("ts_cuda"), "ts_cuda to unload")
        with pytest.raises(InferenceServerException) as failure:
            client.load_model("onnx_gpu")
        assert "no CUDA execution provider" in str(failure.value)
        assert "rayinfer[gpu]" in str(failure.value)
        assert not client.is_model_ready("onnx_gpu")
        loaded("ts_cuda")  # a load after the failed one serves
        assert client.is_model_ready("ts_cuda")
        return
    loaded("onnx_gpu")
    a, b = np.full((2, 16), 5, np.float32), np.full((2, 16), 2, np.float32)
    inputs = [httpclient.InferInput("INPUT0", [2, 16], "FP32"), httpclient.InferInput("INPUT1", [2, 16], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("onnx_gpu", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_gpu_metrics_name_the_gpu(gpu_server):
    client, _ = gpu_server
    import urllib.request

    pytest.importorskip("pynvml", reason="the GPU metrics read NVML (nvidia-ml-py, the gpu extra)")
    text = urllib.request.urlopen(f"http://127.0.0.1:{PORT + 2}/metrics", timeout=30).read().decode()
    assert 'nv_gpu_memory_total_bytes{gpu_uuid="GPU-' in text
    assert 'nv_gpu_utilization{gpu_uuid="GPU-' in text


def test_cuda_shared_memory_as_tritons_cudashm_examples_use_it(gpu_server, loaded):
    """The steps of Triton's simple_http_cudashm_client.py and simple_grpc_cudashm_client.py:
    device regions made with tritonclient's helper, registered by their IPC handles, inputs read
    and outputs written there by the model's replica (another process)."""
    try:
        import tritonclient.utils.cuda_shared_memory as cudashm
    except (ImportError, RuntimeError):
        pytest.skip("needs cuda-python (the gpu extra) for tritonclient's CUDA shared memory helper")
    client, _ = gpu_server
    loaded("cuda_add_sub")
    a, b = np.arange(16, dtype=np.int32).reshape(1, 16), np.ones((1, 16), dtype=np.int32)
    size = a.nbytes
    handles = {name: cudashm.create_shared_memory_region(name, size, 0)
               for name in ("input0_data", "input1_data", "output0_data", "output1_data")}
    try:
        cudashm.set_shared_memory_region(handles["input0_data"], [a])
        cudashm.set_shared_memory_region(handles["input1_data"], [b])
        with grpcclient.InferenceServerClient(f"127.0.0.1:{PORT + 1}") as grpc:
            for module, own in ((httpclient, client), (grpcclient, grpc)):
                own.unregister_cuda_shared_memory()
                for name, handle in handles.items():
                    own.register_cuda_shared_memory(name, cudashm.get_raw_handle(handle), 0, size)
                inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
                inputs[0].set_shared_memory("input0_data", size)
                inputs[1].set_shared_memory("input1_data", size)
                outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
                outputs[0].set_shared_memory("output0_data", size)
                outputs[1].set_shared_memory("output1_data", size)
                own.infer("cuda_add_sub", inputs, outputs=outputs)
                np.testing.assert_array_equal(
                    cudashm.get_contents_as_numpy(handles["output0_data"], np.int32, [1, 16]), a + b)
                np.testing.assert_array_equal(
                    cudashm.get_contents_as_numpy(handles["output1_data"], np.int32, [1, 16]), a - b)
                cudashm.set_shared_memory_region(handles["input0_data"], [a * 3])  # the next call's input
                a = a * 3
                status = own.get_cuda_shared_memory_status()
                names = [r["name"] for r in status] if isinstance(status, list) else list(status.regions)
                assert sorted(names) == sorted(handles)
                own.unregister_cuda_shared_memory()
    finally:
        client.unregister_cuda_shared_memory()
        for handle in handles.values():
            cudashm.destroy_shared_memory_region(handle)
