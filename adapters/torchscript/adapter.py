"""TorchScript adapter: Triton's PyTorch (LibTorch) backend, run with torch in the replica.

Tensors are bound as Triton's backend binds them:

- inputs named ``<anything>__<index>`` (``INPUT__0``) are passed by that position; otherwise
  inputs whose names are exactly ``forward``'s argument names are passed by name; otherwise in
  the config's order;
- outputs named ``<anything>__<index>`` are taken from that position of the returned tuple or
  list (a single tensor is position 0); otherwise in the config's order.

A sequence model's control inputs and implicit state inputs are bound as the config's inputs
are (in the config's order after them, when neither rule applies), and its state outputs as
the config's outputs are.

The config's ``parameters`` that apply here: ``INFERENCE_MODE`` (default true: executions run
under ``torch.inference_mode()``, else ``torch.no_grad()``), ``DISABLE_OPTIMIZED_EXECUTION``
(the TorchScript profiling optimizer off), ``INTRA_OP_THREAD_COUNT`` and
``INTER_OP_THREAD_COUNT`` (torch's thread pools; one model per replica process). torch itself
is the optional ``torch`` extra.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from rayinfer.adapters.base import model_file
from rayinfer.protocol.dtypes import config_to_wire
from rayinfer.protocol.errors import InternalError, InvalidArgError, ModelConfigError
from rayinfer.repository.instance_groups import runs_on_gpu
from rayinfer.repository.model_config import ModelConfig, mc

logger = logging.getLogger(__name__)

_INDEXED = re.compile(r"^.+__(\d+)$")
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
# Wire datatypes torch has a tensor type for (BYTES and BF16 travel as neither here).
_SUPPORTED = {"BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64"}


def positions(names: list[str]) -> list[int] | None:
    """The ``__<index>`` of every name, or None when any name lacks one (or two share one)."""
    found = [_INDEXED.match(name) for name in names]
    if not all(found):
        return None
    indices = [int(m.group(1)) for m in found if m is not None]
    return indices if len(set(indices)) == len(indices) else None


def _flag(config: ModelConfig, key: str, default: bool) -> bool:
    if key not in config.parameters:
        return default
    value = config.parameters[key].string_value.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ModelConfigError(f"model '{config.name}': parameter {key} must be true or false, got '{value}'")


def _reason(exc: BaseException) -> str:
    """The line of a torch error that says what went wrong: TorchScript puts the interpreter's
    traceback first and the error itself last."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _import_torch(model: str) -> Any:
    try:
        import torch
    except ImportError:
        raise ModelConfigError(
            f"model '{model}' is a TorchScript model (pytorch_libtorch) and needs PyTorch: "
            "install rayinfer with the torch extra (pip install 'rayinfer[torch]')"
        ) from None
    return torch


class TorchScriptAdapter:
    """Runs a TorchScript module with torch on the CPU, or on the GPU of a GPU replica."""

    def __init__(self) -> None:
        self._torch: Any = None
        self._module: Any = None
        self._device = "cpu"
        self._input_positions: dict[str, int] = {}  # by position, when not by name
        self._arg_count = 0
        self._by_name = False
        self._output_positions: dict[str, int] = {}
        self._inference_mode = True
        self._optimized = True

    def load(self, model_dir: Path, version: int, config: ModelConfig, auto_complete: bool) -> None:
        torch = self._torch = _import_torch(config.name)
        path = model_file(model_dir, version, config)
        if runs_on_gpu(config):
            if not torch.cuda.is_available():
                raise ModelConfigError(
                    f"model '{config.name}' has GPU instances, but torch sees no CUDA device in this replica "
                    f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})"
                )
            self._device = "cuda"  # the replica's one GPU (Ray sets CUDA_VISIBLE_DEVICES)
        self._inference_mode = _flag(config, "INFERENCE_MODE", True)
        self._optimized = not _flag(config, "DISABLE_OPTIMIZED_EXECUTION", False)
        self._set_threads(config)
        try:
            with warnings.catch_warnings():  # TorchScript is deprecated in torch; Triton's format still
                warnings.simplefilter("ignore", DeprecationWarning)
                self._module = torch.jit.load(str(path), map_location=self._device)
        except Exception as exc:  # torch raises RuntimeError and its own types for bad files
            raise ModelConfigError(f"failed to load TorchScript model {path}: {_reason(exc)}") from None
        self._module.eval()
        for tensor in (*config.input, *config.output):
            wire = config_to_wire(mc.DataType.Name(tensor.data_type))
            if wire not in _SUPPORTED:
                raise ModelConfigError(
                    f"model '{config.name}': tensor '{tensor.name}' has datatype {wire}, which the "
                    f"TorchScript backend does not support ({path})"
                )
        self._bind_inputs(config, path)
        self._arg_count = max(self._input_positions.values(), default=-1) + 1
        names = [t.name for t in config.output] + [s.output_name for s in config.sequence_batching.state]
        indices = positions(names)
        self._output_positions = dict(zip(names, indices if indices is not None else range(len(names))))

    def _set_threads(self, config: ModelConfig) -> None:
        for key, setter in (("INTRA_OP_THREAD_COUNT", self._torch.set_num_threads),
                            ("INTER_OP_THREAD_COUNT", self._torch.set_num_interop_threads)):
            if key not in config.parameters:
                continue
            raw = config.parameters[key].string_value
            try:
                count = int(raw)
            except ValueError:
                raise ModelConfigError(f"model '{config.name}': parameter {key} must be an integer, got '{raw}'") from None
            if count > 0:
                try:
                    setter(count)
                except RuntimeError as exc:  # the inter-op pool is fixed once torch has used it
                    logger.warning("model '%s': %s not applied: %s", config.name, key, exc)

    def _bind_inputs(self, config: ModelConfig, path: Path) -> None:
        sequences = config.sequence_batching
        names = [t.name for t in config.input] + [c.name for c in sequences.control_input] + \
            [s.input_name for s in sequences.state]
        indices = positions(names)
        if indices is not None:
            self._input_positions = dict(zip(names, indices))
            return
        arguments = self.forward_arguments()
        if arguments is not None and set(arguments) == set(names):
            self._by_name = True
            return
        if arguments is not None and len(arguments) != len(names):
            raise ModelConfigError(
                f"model '{config.name}': the config declares {len(names)} inputs {names} but forward() takes "
                f"{len(arguments)} {arguments}; name them as forward's arguments or INPUT__<index> ({path})"
            )
        self._input_positions = {name: i for i, name in enumerate(names)}

    def forward_arguments(self) -> list[str] | None:
        """``forward``'s argument names after ``self`` (a traced module's carry a ``.N`` suffix,
        dropped), or None when the module does not say."""
        try:
            schema = self._module.forward.schema
        except AttributeError:
            return None
        return [a.name.split(".")[0] for a in schema.arguments[1:]]

    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str], parameters: dict[str, Any]
    ) -> dict[str, np.ndarray]:
        torch = self._torch
        tensors = {name: self._tensor(array) for name, array in inputs.items()}
        mode = torch.inference_mode() if self._inference_mode else torch.no_grad()
        try:
            with mode, torch.jit.optimized_execution(self._optimized):
                if self._by_name:
                    result = self._module(**tensors)
                else:
                    args: list[Any] = [None] * self._arg_count
                    for name, tensor in tensors.items():
                        args[self._input_positions[name]] = tensor
                    result = self._module(*args)
        except RuntimeError as exc:
            raise InvalidArgError(f"PyTorch execute failure: {_reason(exc)}") from None
        if isinstance(result, torch.Tensor):
            result = (result,)
        elif isinstance(result, dict):
            raise InternalError("PyTorch execute failure: the model returned a dict; return a tensor, tuple or list")
        out = {}
        for name in output_names:
            index = self._output_positions[name]
            if index >= len(result) or not isinstance(result[index], torch.Tensor):
                raise InternalError(
                    f"PyTorch execute failure: output '{name}' is position {index} of the model's outputs, "
                    f"but the model returned {len(result)} value(s)"
                )
            out[name] = result[index].detach().cpu().numpy()
        return out

    def _tensor(self, array: np.ndarray) -> Any:
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array)  # torch.from_numpy shares memory and wants it writable
        return self._torch.from_numpy(array).to(self._device)

    def unload(self) -> None:
        self._module = None
