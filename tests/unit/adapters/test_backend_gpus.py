"""Which backends, as installed, can run a model on a GPU (Triton's question before it makes a
KIND_AUTO group's GPU instances), read from the installed files: packages laid out as
onnxruntime's and torch's CPU and GPU builds are, and this machine's own install."""

from __future__ import annotations

from pathlib import Path

from rayinfer.adapters.base import backend_uses_gpus

TORCH_VERSION = """__version__ = '2.11.0{local}'
debug = False
cuda: Optional[str] = {cuda}
git_version = 'abc'
hip: Optional[str] = {hip}
"""


def _packages(tmp_path: Path, *, ort_cuda: bool, torch_cuda: str, torch_hip: str = "None") -> dict[str, Path]:
    ort = tmp_path / "onnxruntime"
    (ort / "capi").mkdir(parents=True)
    (ort / "capi" / "libonnxruntime_providers_shared.so").write_bytes(b"")
    if ort_cuda:
        (ort / "capi" / "libonnxruntime_providers_cuda.so").write_bytes(b"")
    torch = tmp_path / "torch"
    torch.mkdir()
    (torch / "version.py").write_text(TORCH_VERSION.format(local="+cpu" if torch_cuda == "None" else "",
                                                           cuda=torch_cuda, hip=torch_hip))
    return {"onnxruntime": ort, "torch": torch}


def test_gpu_builds_can_and_cpu_builds_cannot(tmp_path: Path) -> None:
    gpu = _packages(tmp_path / "gpu", ort_cuda=True, torch_cuda="'13.0'")
    cpu = _packages(tmp_path / "cpu", ort_cuda=False, torch_cuda="None")
    rocm = _packages(tmp_path / "rocm", ort_cuda=False, torch_cuda="None", torch_hip="'6.4.1'")
    for backend in ("onnxruntime", "pytorch"):
        assert backend_uses_gpus(backend, gpu.get)
        assert not backend_uses_gpus(backend, cpu.get)
    assert backend_uses_gpus("pytorch", rocm.get)
    assert not backend_uses_gpus("onnxruntime", {}.get)  # not installed at all


def test_python_and_tensorrt_always_can_and_this_machines_cpu_builds_cannot() -> None:
    assert backend_uses_gpus("python") and backend_uses_gpus("tensorrt")
    assert not backend_uses_gpus("ensemble")
    import onnxruntime

    assert backend_uses_gpus("onnxruntime") == ("CUDAExecutionProvider" in onnxruntime.get_available_providers())
