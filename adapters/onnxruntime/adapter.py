"""ONNX Runtime adapter: one InferenceSession per replica, Triton's auto-complete from the graph."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from rayinfer.adapters.base import check_declared_tensors, model_file
from rayinfer.protocol.errors import InternalError, InvalidArgError, ModelConfigError
from rayinfer.repository.instance_groups import runs_on_gpu
from rayinfer.repository.model_config import ModelConfig, ModelTensor, auto_complete_io

logger = logging.getLogger(__name__)

# ONNX Runtime's type strings -> Triton wire datatypes.
_ORT_TO_WIRE = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}

# Triton's default max_batch_size for auto-completed models that can batch.
DEFAULT_MAX_BATCH_SIZE = 4


def execution_providers(config: ModelConfig, available: list[str]) -> list[str]:
    """onnxruntime's providers for the model's (resolved) instance kind: CPU for CPU instances;
    CUDA for GPU instances, TensorRT first when the config's ``gpu_execution_accelerator`` asks
    for ``tensorrt``; a GPU instance without the CUDA provider is a load error naming the extra."""
    if not runs_on_gpu(config):
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in available:
        raise ModelConfigError(
            f"model '{config.name}' has GPU instances, but onnxruntime here has no CUDA execution provider "
            f"(available: {', '.join(available)}): install the gpu extra (pip install 'rayinfer[gpu]')"
        )
    accelerators = config.optimization.execution_accelerators.gpu_execution_accelerator
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if any(a.name == "tensorrt" for a in accelerators):
        if "TensorrtExecutionProvider" not in available:
            raise ModelConfigError(
                f"model '{config.name}' asks for the tensorrt execution accelerator, which onnxruntime here "
                f"does not have (available: {', '.join(available)})"
            )
        providers.insert(0, "TensorrtExecutionProvider")
    return providers


class OnnxRuntimeAdapter:
    """Runs an ONNX model with onnxruntime: the CPU execution provider, or CUDA (and TensorRT)
    on a GPU replica."""

    def __init__(self) -> None:
        self._session: Any = None
        self._string_inputs: set[str] = set()
        self._string_outputs: set[str] = set()

    def load(self, model_dir: Path, version: int, config: ModelConfig, auto_complete: bool) -> None:
        import onnxruntime as ort

        path = model_file(model_dir, version, config)
        if path.is_dir():
            path = path / "model.onnx"
        options = ort.SessionOptions()
        params = {k: v.string_value for k, v in config.parameters.items()}
        intra = params.get("intra_op_thread_count") or params.get("intra_op_num_threads")
        inter = params.get("inter_op_thread_count") or params.get("inter_op_num_threads")
        try:
            if intra:
                options.intra_op_num_threads = int(intra)
            if inter:
                options.inter_op_num_threads = int(inter)
        except ValueError as exc:
            raise ModelConfigError(f"model '{config.name}': invalid thread count parameter: {exc}") from None
        level = config.optimization.graph.level if config.HasField("optimization") else 0
        if level == -1:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        elif level == 1:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        providers = execution_providers(config, ort.get_available_providers())
        try:
            self._session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
        except Exception as exc:  # onnxruntime raises its own untyped errors
            raise ModelConfigError(f"failed to load ONNX model {path}: {exc}") from None
        if auto_complete:
            self._auto_complete(config)
        self._check_against_model(config, path)
        self._string_inputs = {i.name for i in self._session.get_inputs() if i.type == "tensor(string)"}
        self._string_outputs = {o.name for o in self._session.get_outputs() if o.type == "tensor(string)"}

    def _auto_complete(self, config: ModelConfig) -> None:
        """Fill missing inputs, outputs and max_batch_size from the graph, as Triton does."""
        model_inputs = self._session.get_inputs()
        model_outputs = self._session.get_outputs()
        all_io = list(model_inputs) + list(model_outputs)
        can_batch = all(io.shape and not isinstance(io.shape[0], int) for io in all_io)

        def described(model_io: Any) -> list[ModelTensor]:
            return [(io.name, _ORT_TO_WIRE[io.type], [d if isinstance(d, int) and d > 0 else -1 for d in io.shape])
                    for io in model_io if io.type in _ORT_TO_WIRE]

        auto_complete_io(config, described(model_inputs), described(model_outputs),
                         DEFAULT_MAX_BATCH_SIZE if can_batch else 0)

    def _check_against_model(self, config: ModelConfig, path: Path) -> None:
        """Config tensors must exist in the graph with the same datatype."""
        for what, declared, model_io in (
            ("input", config.input, self._session.get_inputs()),
            ("output", config.output, self._session.get_outputs()),
        ):
            check_declared_tensors(config, what, declared,
                                   {io.name: (io.type, _ORT_TO_WIRE.get(io.type)) for io in model_io}, path)

    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str], parameters: dict[str, Any]
    ) -> dict[str, np.ndarray]:
        feed = {}
        for name, array in inputs.items():
            if name in self._string_inputs:
                array = np.vectorize(_to_str, otypes=[object])(array) if array.size else array
            feed[name] = array
        try:
            results = self._session.run(output_names, feed)
        except Exception as exc:  # onnxruntime raises its own untyped errors
            message = str(exc)
            if "INVALID_ARGUMENT" in message or "Invalid" in message:
                raise InvalidArgError(f"onnxruntime rejected the request: {message}") from None
            raise InternalError(f"onnxruntime execution failed: {message}") from None
        out = {}
        for name, array in zip(output_names, results):
            if name in self._string_outputs:
                array = np.vectorize(_to_bytes, otypes=[object])(array) if array.size else array.astype(object)
            out[name] = array
        return out

    def unload(self) -> None:
        self._session = None


def _to_str(item: Any) -> str:
    return item.decode("utf-8", errors="surrogateescape") if isinstance(item, bytes) else str(item)


def _to_bytes(item: Any) -> bytes:
    return item.encode("utf-8", errors="surrogateescape") if isinstance(item, str) else bytes(item)
