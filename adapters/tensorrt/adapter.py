"""TensorRT adapter: Triton's TensorRT backend (``platform: "tensorrt_plan"``, ``model.plan``).

One replica deserializes the engine once and keeps one execution context and one CUDA stream on
its GPU (Ray gives a GPU replica one device, as device 0). Tensors are bound by name; dynamic
shapes go through the engine's optimization profiles: the instance groups' ``profile`` list (all
of them by default), the one in use kept while a batch fits it. Inputs, outputs and
max_batch_size are auto-completed from the engine. TensorRT and CUDA's runtime bindings
(``tensorrt``, ``cuda-python``) are the ``gpu`` extra; a replica without a GPU reports the model
UNAVAILABLE saying so.
"""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path
from typing import Any

import numpy as np

from rayinfer.adapters.base import model_file
from rayinfer.adapters.tensorrt.engine_io import (
    EngineTensor, Profile, allowed_profiles, auto_complete, check_config, pick_profile,
)
from rayinfer.protocol.dtypes import numpy_dtype
from rayinfer.protocol.errors import InternalError, InvalidArgError, ModelConfigError
from rayinfer.repository.instance_groups import runs_on_gpu
from rayinfer.repository.model_config import ModelConfig

logger = logging.getLogger(__name__)

_EXTRA = "install rayinfer with the gpu extra (pip install 'rayinfer[gpu]')"


def _import_runtime(model: str) -> tuple[Any, Any]:
    try:
        import tensorrt as trt
    except ImportError:
        raise ModelConfigError(f"model '{model}' is a TensorRT plan and needs TensorRT: {_EXTRA}") from None
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # cuda-python before 12.6
        except ImportError:
            raise ModelConfigError(
                f"model '{model}' is a TensorRT plan and needs CUDA's Python bindings (cuda-python): {_EXTRA}"
            ) from None
    return trt, cudart


class TensorRTAdapter:
    """Runs a serialized TensorRT engine on the replica's GPU."""

    def __init__(self) -> None:
        self._trt: Any = None
        self._cudart: Any = None
        self._runtime: Any = None
        self._engine: Any = None
        self._context: Any = None
        self._stream: Any = None
        self._model = ""
        self._tensors: list[EngineTensor] = []
        self._dtypes: dict[str, np.dtype] = {}
        self._profiles: list[int] = []
        self._profile = -1
        self._buffers: dict[str, tuple[int, int]] = {}  # name -> (device pointer, bytes)
        self._errors: Any = None  # TensorRT's error messages since the last look
        # One execution at a time on the context, stream and buffers (the serving core may run a
        # short execution on its loop while a long one still runs on the model thread).
        self._lock = threading.Lock()

    def load(self, model_dir: Path, version: int, config: ModelConfig, auto_complete_config: bool) -> None:
        self._model = config.name
        path = model_file(model_dir, version, config)
        if not runs_on_gpu(config):
            raise ModelConfigError(
                f"model '{config.name}' is a TensorRT plan and needs a GPU, but its replica has none "
                "(the cluster has no GPU, its instance_group is KIND_CPU, or --gpu-fallback cpu is set)"
            )
        trt, self._cudart = _import_runtime(config.name)
        self._trt = trt
        errors = self._errors = _ErrorLog.create(trt)
        self._runtime = trt.Runtime(errors)  # kept as long as the engine
        self._engine = self._runtime.deserialize_cuda_engine(path.read_bytes())
        if self._engine is None:
            raise ModelConfigError(
                f"failed to load TensorRT engine {path}: {'; '.join(errors.messages) or 'not a serialized engine'}"
            )
        self._tensors = self._describe(path)
        count = max(self._engine.num_optimization_profiles, 1)
        self._profiles = allowed_profiles(config, count, path)
        if auto_complete_config:
            auto_complete(config, self._tensors, self._profiles)
        check_config(config, self._tensors, self._profiles, path)
        self._dtypes = {t.name: numpy_dtype(t.wire) for t in self._tensors if t.wire is not None}
        self._stream = self._cuda(self._cudart.cudaStreamCreate())
        self._context = self._engine.create_execution_context()
        if self._context is None:
            raise ModelConfigError(f"TensorRT could not create an execution context for {path}: "
                                   f"{'; '.join(errors.messages) or 'out of GPU memory?'}")
        self._use_profile(self._profiles[0])
        errors.messages.clear()

    def _describe(self, path: Path) -> list[EngineTensor]:
        trt, engine = self._trt, self._engine
        tensors = []
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            if is_input and engine.is_shape_inference_io(name):
                raise ModelConfigError(
                    f"model '{self._model}': input '{name}' is a shape tensor, which rayinfer's TensorRT backend "
                    f"does not support ({path})"
                )
            shape = tuple(engine.get_tensor_shape(name))
            profiles = []
            if is_input:
                for p in range(max(engine.num_optimization_profiles, 1)):
                    if -1 not in shape:  # a static input: its one shape in every profile
                        profiles.append(Profile(shape, shape, shape))
                        continue
                    low, opt, high = engine.get_tensor_profile_shape(name, p)
                    profiles.append(Profile(tuple(low), tuple(opt), tuple(high)))
            dtype = engine.get_tensor_dtype(name).name
            tensor = EngineTensor(name, is_input, dtype, shape, profiles)
            if tensor.wire is None:
                raise ModelConfigError(
                    f"model '{self._model}': tensor '{name}' has TensorRT type {dtype}, which rayinfer's "
                    f"TensorRT backend does not support ({path})"
                )
            tensors.append(tensor)
        return tensors

    def _cuda(self, result: Any) -> Any:
        """The value of a cuda-python call (``(error, value...)``), raising on an error."""
        error, *values = result if isinstance(result, tuple) else (result,)
        if error != self._cudart.cudaError_t.cudaSuccess:
            _, name = self._cudart.cudaGetErrorName(error)
            raise InternalError(f"model '{self._model}': CUDA error {name.decode() if isinstance(name, bytes) else name}")
        return values[0] if len(values) == 1 else values

    def _use_profile(self, profile: int) -> None:
        if profile != self._profile:
            try:  # TensorRT raises on failure (the bool it returns is always true)
                self._context.set_optimization_profile_async(profile, int(self._stream))
            except RuntimeError:
                raise InternalError(f"model '{self._model}': TensorRT could not switch to optimization profile "
                                    f"{profile}{self._logged()}") from None
            self._profile = profile

    def _logged(self) -> str:
        """TensorRT's error messages since the last look, for an error's text (and forgotten)."""
        messages = self._errors.messages if self._errors is not None else []
        text = f": {'; '.join(messages)}" if messages else ""
        messages.clear()
        return text

    def _buffer(self, name: str, nbytes: int) -> int:
        """A device buffer of at least ``nbytes`` for ``name``, grown (never shrunk) as needed."""
        nbytes = max(nbytes, 1)
        pointer, size = self._buffers.get(name, (0, 0))
        if size < nbytes:
            if pointer:
                self._cuda(self._cudart.cudaFree(pointer))
            pointer = int(self._cuda(self._cudart.cudaMalloc(nbytes)))
            self._buffers[name] = (pointer, nbytes)
        return pointer

    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str], parameters: dict[str, Any]
    ) -> dict[str, np.ndarray]:
        with self._lock:
            return self._execute(inputs, output_names)

    def _execute(self, inputs: dict[str, np.ndarray], output_names: list[str]) -> dict[str, np.ndarray]:
        cudart, context, stream = self._cudart, self._context, int(self._stream)
        missing = [t.name for t in self._tensors if t.is_input and t.name not in inputs]
        if missing:
            raise InvalidArgError(f"model '{self._model}': the engine needs input(s) {missing}")
        self._use_profile(pick_profile(self._model, self._tensors, {n: a.shape for n, a in inputs.items()},
                                       self._profiles, self._profile))
        host_inputs = []  # alive until the stream is done with them
        to_device = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        for name, array in inputs.items():
            array = np.require(array, self._dtypes[name], "C")  # keeps a 0-d array 0-d
            if not context.set_input_shape(name, array.shape):
                raise InvalidArgError(f"model '{self._model}': TensorRT rejected shape {list(array.shape)} "
                                      f"for input '{name}'{self._logged()}")
            pointer = self._buffer(name, array.nbytes)
            self._cuda(cudart.cudaMemcpyAsync(pointer, array.ctypes.data, array.nbytes, to_device, stream))
            context.set_tensor_address(name, pointer)
            host_inputs.append(array)
        results = {}
        for tensor in self._tensors:  # every output needs an address, asked for or not
            if tensor.is_input:
                continue
            shape = tuple(context.get_tensor_shape(tensor.name))
            if any(d < 0 for d in shape):
                raise InternalError(f"model '{self._model}': TensorRT left output '{tensor.name}' shape {list(shape)}")
            dtype = self._dtypes[tensor.name]
            pointer = self._buffer(tensor.name, math.prod(shape) * dtype.itemsize)
            context.set_tensor_address(tensor.name, pointer)
            if tensor.name in output_names:
                results[tensor.name] = (np.empty(shape, dtype), pointer)
        if not context.execute_async_v3(stream):
            raise InternalError(f"model '{self._model}': TensorRT execution failed{self._logged()}")
        to_host = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        for array, pointer in results.values():
            self._cuda(cudart.cudaMemcpyAsync(array.ctypes.data, pointer, array.nbytes, to_host, stream))
        self._cuda(cudart.cudaStreamSynchronize(stream))
        del host_inputs
        return {name: array for name, (array, _) in results.items()}

    def unload(self) -> None:
        if self._cudart is not None:
            for pointer, _ in self._buffers.values():
                self._cudart.cudaFree(pointer)
            if self._stream is not None:
                self._cudart.cudaStreamDestroy(self._stream)
        self._buffers.clear()
        self._context = self._engine = self._runtime = self._stream = None


class _ErrorLog:
    """A TensorRT logger that keeps the errors, for the load error's message."""

    @staticmethod
    def create(trt: Any) -> Any:
        class ErrorLog(trt.ILogger):
            def __init__(self) -> None:
                trt.ILogger.__init__(self)
                self.messages: list[str] = []

            def log(self, severity: Any, msg: str) -> None:
                if int(severity) <= int(trt.ILogger.Severity.ERROR):
                    self.messages.append(msg)
                elif int(severity) <= int(trt.ILogger.Severity.WARNING):
                    logger.warning("TensorRT: %s", msg)

        return ErrorLog()
