"""The adapter contract every backend implements, and the registry that picks one."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from rayinfer.protocol.dtypes import wire_to_config
from rayinfer.protocol.errors import ModelConfigError, UnsupportedError
from rayinfer.repository.model_config import ModelConfig, mc


class ModelAdapter(Protocol):
    """Runs one model version in one process: ``load`` once, ``execute`` many times, ``unload``.

    Adapters are plain synchronous code with no Ray inside; the deployment runs ``execute`` off
    the event loop. Arrays passed to ``execute`` already carry the batch dimension when the
    model batches, and are in the model's own shapes (after any ``reshape``).
    """

    def load(self, model_dir: Path, version: int, config: ModelConfig, auto_complete: bool) -> None:
        """Load the model file of ``version``; with ``auto_complete``, fill gaps in ``config``."""

    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str], parameters: dict[str, Any]
    ) -> dict[str, np.ndarray]:
        """Run the model on one batch and return the requested outputs."""

    def unload(self) -> None:
        """Free the model's resources."""


# Triton backend name -> "module:Class", imported only when a model needs it.
_REGISTRY = {
    "fil": "rayinfer.adapters.fil.adapter:FilAdapter",
    "onnxruntime": "rayinfer.adapters.onnxruntime.adapter:OnnxRuntimeAdapter",
    "openvino": "rayinfer.adapters.openvino.adapter:OpenVinoAdapter",
    "python": "rayinfer.adapters.python_backend.backend:PythonBackendAdapter",
    "pytorch": "rayinfer.adapters.torchscript.adapter:TorchScriptAdapter",
    "tensorflow": "rayinfer.adapters.tensorflow.adapter:TensorFlowAdapter",
    "tensorrt": "rayinfer.adapters.tensorrt.adapter:TensorRTAdapter",
    "vllm": "rayinfer.adapters.vllm.adapter:VllmAdapter",
}


def backend_uses_gpus(backend: str, package_dir: Callable[[str], Path | None] | None = None) -> bool:
    """Whether ``backend``, as installed here, can run a model on a GPU: what Triton asks of a
    KIND_AUTO group (and of a config without instance groups) before it makes GPU instances.
    vllm: yes.
    onnxruntime: a build with the CUDA provider (onnxruntime-gpu, the gpu extra); pytorch: a
    CUDA or ROCm build of torch; python and tensorrt: yes; fil, openvino and tensorflow: no (their
    KIND_AUTO instances run on the CPU, KIND_GPU asks for the GPU). Read from the installed files, without
    importing the framework (the ``/v2`` replica asks). ``package_dir``: where an installed
    package's folder is (default: this interpreter's)."""
    if backend in ("python", "tensorrt", "vllm"):
        return True
    package = (package_dir or _package_dir)({"onnxruntime": "onnxruntime", "pytorch": "torch"}.get(backend, ""))
    if package is None:
        return False
    if backend == "onnxruntime":
        return (package / "capi" / "libonnxruntime_providers_cuda.so").exists()
    try:  # torch/version.py: cuda = '12.8' (or hip = ...) in a GPU build, None in a CPU one
        text = (package / "version.py").read_text()
    except OSError:
        return False
    return re.search(r"^(cuda|hip)\b[^=\n]*=\s*['\"]", text, re.MULTILINE) is not None


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name) if name else None
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def create_adapter(backend: str) -> ModelAdapter:
    """A new, unloaded adapter for a Triton backend name (``onnxruntime``, ...)."""
    target = _REGISTRY.get(backend)
    if target is None:
        raise UnsupportedError(
            f"backend '{backend}' is not supported; available backends: {', '.join(sorted(_REGISTRY))}"
        )
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)()


def check_declared_tensors(config: ModelConfig, what: str, declared: Any,
                           found: dict[str, tuple[str, str | None]], path: Path) -> None:
    """The config's tensors of one kind (``what``: ``input`` or ``output``) exist in the model
    file with the same datatype, else a load error naming the model, the tensor and the file.
    ``found``: the model's tensors, name -> (its type as the framework writes it, the wire
    datatype that type is, or None when Triton has none)."""
    for tensor in declared:
        if tensor.name not in found:
            raise ModelConfigError(
                f"model '{config.name}': unexpected inference {what} '{tensor.name}', "
                f"allowed {what}s are: {', '.join(found)} ({path})"
            )
        shown, wire = found[tensor.name]
        expected = mc.DataType.Name(tensor.data_type)
        if wire is None or wire_to_config(wire) != expected:
            raise ModelConfigError(
                f"model '{config.name}': {what} '{tensor.name}' is {shown} in the model "
                f"but {expected} in the config ({path})"
            )


def error_line(exc: BaseException, skip: tuple[str, ...] = ()) -> str:
    """The line of a framework's error that says what went wrong: its first non-empty line that
    does not start with one of ``skip`` (a source location some frameworks put first)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    for line in lines:
        if not line.startswith(skip):
            return line
    return lines[-1] if lines else type(exc).__name__


def model_file(model_dir: Path, version: int, config: ModelConfig) -> Path:
    """Path of the version's model file, raising an error that names the missing file."""
    path = model_dir / str(version) / config.default_model_filename
    if not path.exists():
        raise ModelConfigError(f"model file not found: {path}")
    return path
