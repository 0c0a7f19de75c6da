"""OpenVINO adapter: Triton's OpenVINO backend, run with the ``openvino`` runtime from PyPI.

The model file is ``model.xml`` (with ``model.bin`` beside it) unless ``default_model_filename``
names another that OpenVINO reads (``model.onnx``, a ``model.saved_model`` folder, ...). The
config's ``parameters``, with the meaning Triton's OpenVINO backend gives them:

- ``PERFORMANCE_HINT`` (``LATENCY``, ``THROUGHPUT``, ``CUMULATIVE_THROUGHPUT``), ``NUM_STREAMS``
  (``AUTO``, ``NUMA`` or a number), ``INFERENCE_NUM_THREADS``, ``COMPILATION_NUM_THREADS``,
  ``HINT_BF16`` (``YES``: bfloat16 where the CPU has it), ``CPU_EXTENSION_PATH`` (a library of
  custom layers): passed to OpenVINO as its own properties; and beyond Triton's list,
  ``INFERENCE_PRECISION_HINT`` (``f32``, ``bf16``, ``f16``): OpenVINO computes in bfloat16 by
  default on CPUs that have it, ``f32`` keeps full precision;
- ``RESHAPE_IO_LAYERS`` (``YES``): the inputs take the config's dims (``-1`` dynamic);
- ``SKIP_OV_DYNAMIC_BATCHSIZE`` (``YES``): the batch dimension stays fixed at max_batch_size
  instead of becoming dynamic, and then ``ENABLE_BATCH_PADDING`` (``YES``) pads smaller batches
  up to it (without it, a smaller batch is an error, as in Triton).

KIND_CPU instances compile for OpenVINO's ``CPU`` device, KIND_GPU ones for its ``GPU`` plugin
(Intel GPUs).
"""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import numpy as np

from rayinfer.adapters import parameters as params
from rayinfer.adapters.base import check_declared_tensors, error_line, model_file
from rayinfer.protocol.dtypes import wire_datatype
from rayinfer.protocol.errors import InternalError, InvalidArgError, ModelConfigError
from rayinfer.repository.instance_groups import runs_on_gpu
from rayinfer.repository.model_config import ModelConfig, ModelTensor, auto_complete_io

# Triton's default max_batch_size for auto-completed models that can batch.
DEFAULT_MAX_BATCH_SIZE = 4
_HINTS = ("LATENCY", "THROUGHPUT", "CUMULATIVE_THROUGHPUT")


def _import_openvino(model: str) -> Any:
    try:
        import openvino
    except ImportError:
        raise ModelConfigError(
            f"model '{model}' is an OpenVINO model and needs openvino: install rayinfer with the "
            "openvino extra (pip install 'rayinfer[openvino]')"
        ) from None
    return openvino


def _yes(config: ModelConfig, key: str) -> bool:
    return params.flag(config, key, False)


def compile_properties(config: ModelConfig) -> dict[str, Any]:
    """OpenVINO's compile-time properties from the config's parameters."""
    props: dict[str, Any] = {}
    hint = params.choice(config, "PERFORMANCE_HINT", "", _HINTS)
    if hint:
        props["PERFORMANCE_HINT"] = hint
    streams = params.text(config, "NUM_STREAMS").upper()
    if streams:
        if streams not in ("AUTO", "NUMA"):
            streams = str(params.integer(config, "NUM_STREAMS", 1, minimum=1))
        props["NUM_STREAMS"] = streams
    for key in ("INFERENCE_NUM_THREADS", "COMPILATION_NUM_THREADS"):
        if params.text(config, key):
            props[key] = params.integer(config, key, 0)
    if _yes(config, "HINT_BF16"):
        props["INFERENCE_PRECISION_HINT"] = "bf16"
    precision = params.choice(config, "INFERENCE_PRECISION_HINT", "", ("f32", "bf16", "f16"))
    if precision:  # beyond Triton's list: OpenVINO's own property, e.g. f32 where it would pick bf16
        props["INFERENCE_PRECISION_HINT"] = precision
    return props


class OpenVinoAdapter:
    """Runs an OpenVINO model: one compiled model per replica, a pool of infer requests."""

    def __init__(self) -> None:
        self._compiled: Any = None
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._pad_to = 0  # SKIP_OV_DYNAMIC_BATCHSIZE with ENABLE_BATCH_PADDING: the fixed batch
        self._fixed_batch = 0  # SKIP_OV_DYNAMIC_BATCHSIZE: the one batch size the model takes
        self._model = ""

    def load(self, model_dir: Path, version: int, config: ModelConfig, auto_complete: bool) -> None:
        ov = _import_openvino(config.name)
        self._model = config.name
        path = model_file(model_dir, version, config)
        core = ov.Core()
        extension = params.text(config, "CPU_EXTENSION_PATH")
        try:
            if extension:
                core.add_extension(extension)
            model = core.read_model(str(path))
        except Exception as exc:  # openvino raises its own untyped errors
            raise ModelConfigError(f"failed to load OpenVINO model {path}: {_reason(exc)}") from None
        if auto_complete:
            self._auto_complete(config, model)
        self._check_against_model(config, model, path)
        self._reshape(ov, config, model, path)
        device = "GPU" if runs_on_gpu(config) else "CPU"
        if device not in core.available_devices:
            raise ModelConfigError(
                f"model '{config.name}' has GPU instances, but OpenVINO here has no GPU device "
                f"(available: {', '.join(core.available_devices)})"
            )
        try:
            self._compiled = core.compile_model(model, device, compile_properties(config))
        except Exception as exc:
            raise ModelConfigError(f"failed to compile OpenVINO model {path} for {device}: {_reason(exc)}") from None

    def _auto_complete(self, config: ModelConfig, model: Any) -> None:
        """Triton's OpenVINO auto-complete: names, datatypes and dims from the model; a model
        whose every tensor has a dynamic first dimension batches."""
        ports = list(model.inputs) + list(model.outputs)
        can_batch = all(p.get_partial_shape().rank.is_static and len(p.get_partial_shape()) > 0
                        and p.get_partial_shape()[0].is_dynamic for p in ports)

        def described(model_ports: Any) -> list[ModelTensor]:
            return [(p.get_any_name(), wire_datatype(p.get_element_type().to_dtype()),
                     [-1 if d.is_dynamic else d.get_length() for d in p.get_partial_shape()])
                    for p in model_ports if p.get_partial_shape().rank.is_static]

        auto_complete_io(config, described(model.inputs), described(model.outputs),
                         DEFAULT_MAX_BATCH_SIZE if can_batch else 0)

    def _check_against_model(self, config: ModelConfig, model: Any, path: Path) -> None:
        """Config tensors must exist in the model, with the same datatype."""
        for what, declared, ports in (("input", config.input, model.inputs), ("output", config.output, model.outputs)):
            found = {}
            for port in ports:
                wire = wire_datatype(port.get_element_type().to_dtype())
                found.update({name: (wire, wire) for name in port.get_names()})
            check_declared_tensors(config, what, declared, found, path)

    def _reshape(self, ov: Any, config: ModelConfig, model: Any, path: Path) -> None:
        """The input shapes the compiled model takes: the config's dims with RESHAPE_IO_LAYERS,
        and a dynamic batch dimension (or max_batch_size with SKIP_OV_DYNAMIC_BATCHSIZE)."""
        batch = config.max_batch_size
        skip_dynamic = _yes(config, "SKIP_OV_DYNAMIC_BATCHSIZE")
        if batch > 0 and skip_dynamic:
            self._fixed_batch = batch
            self._pad_to = batch if _yes(config, "ENABLE_BATCH_PADDING") else 0
        declared = {t.name: list(t.dims) for t in config.input}
        shapes = {}
        for port in model.inputs:
            name = port.get_any_name()
            shape = port.get_partial_shape()
            if _yes(config, "RESHAPE_IO_LAYERS") and name in declared:
                dims = ([-1] if batch > 0 else []) + declared[name]
                shape = ov.PartialShape([ov.Dimension() if d == -1 else ov.Dimension(d) for d in dims])
            if batch > 0 and shape.rank.is_static and len(shape) > 0:
                shape = ov.PartialShape([ov.Dimension(batch) if skip_dynamic else ov.Dimension()] + list(shape)[1:])
            shapes[port] = shape
        try:
            model.reshape(shapes)
        except Exception as exc:
            raise ModelConfigError(
                f"model '{config.name}': OpenVINO cannot reshape the model in {path} to the config's "
                f"shapes: {_reason(exc)}"
            ) from None

    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str], parameters: dict[str, Any]
    ) -> dict[str, np.ndarray]:
        rows = next(iter(inputs.values())).shape[0] if inputs and self._fixed_batch else 0
        if self._fixed_batch and rows != self._fixed_batch:
            if not self._pad_to or rows > self._pad_to:
                raise InvalidArgError(
                    f"model '{self._model}' takes batches of exactly {self._fixed_batch} "
                    f"(SKIP_OV_DYNAMIC_BATCHSIZE), got {rows}; set ENABLE_BATCH_PADDING to pad smaller ones"
                )
            inputs = {name: np.concatenate([a, np.zeros((self._pad_to - rows, *a.shape[1:]), a.dtype)])
                      for name, a in inputs.items()}
        try:
            request = self._requests.get_nowait()
        except queue.Empty:
            request = self._compiled.create_infer_request()
        try:
            results = request.infer(inputs)
            out = {name: np.array(results[self._compiled.output(name)]) for name in output_names}
        except Exception as exc:  # openvino raises its own untyped errors
            message = _reason(exc)
            if "shape" in message.lower() or "dimension" in message.lower():
                raise InvalidArgError(f"OpenVINO rejected the request: {message}") from None
            raise InternalError(f"OpenVINO execution failed: {message}") from None
        finally:
            self._requests.put(request)
        if self._pad_to and rows < self._pad_to:
            out = {name: a[:rows] for name, a in out.items()}
        return out

    def unload(self) -> None:
        self._compiled = None
        self._requests = queue.SimpleQueue()


def _reason(exc: BaseException) -> str:
    """OpenVINO's message without the source location of the check it starts with."""
    return error_line(exc, skip=("Exception from", "Check '"))
