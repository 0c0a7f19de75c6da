"""Triton's ``model_warmup``: sample requests run through a freshly loaded model before it serves."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from rayinfer.adapters.model_runner import ModelRunner
from rayinfer.protocol.dtypes import config_to_wire, deserialize_bytes_tensor, numpy_dtype
from rayinfer.protocol.errors import ModelConfigError, ServingError
from rayinfer.protocol.types import InferInput, InferRequest
from rayinfer.repository.model_config import mc

logger = logging.getLogger(__name__)


def warmup_requests(runner: ModelRunner, model_dir: Path) -> list[tuple[str, int, InferRequest]]:
    """(sample name, repeat count, request) for every ``model_warmup`` entry of the config."""
    config = runner.spec.config
    out = []
    for sample in config.model_warmup:
        batch = max(int(sample.batch_size), 1)
        inputs = []
        for name, spec in sample.inputs.items():
            datatype = config_to_wire(mc.DataType.Name(spec.data_type))
            shape = ((batch,) if runner.spec.max_batch_size > 0 else ()) + tuple(int(d) for d in spec.dims)
            inputs.append(InferInput(name, datatype, shape, _sample_data(spec, datatype, shape, model_dir, sample.name)))
        out.append((sample.name, max(int(sample.count), 1), InferRequest(runner.spec.name, runner.version, inputs=inputs)))
    return out


def _sample_data(spec: Any, datatype: str, shape: tuple[int, ...], model_dir: Path, sample: str) -> np.ndarray:
    count = math.prod(shape)
    kind = spec.WhichOneof("input_data_type")
    if kind == "input_data_file":
        path = model_dir / "warmup" / spec.input_data_file
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise ModelConfigError(f"model_warmup '{sample}': cannot read {path}: {exc}") from None
        if datatype == "BYTES":
            return deserialize_bytes_tensor(raw, count, spec.input_data_file).reshape(shape)
        dtype = numpy_dtype(datatype)
        if len(raw) < count * dtype.itemsize:
            raise ModelConfigError(f"model_warmup '{sample}': {path} holds fewer than {count} elements")
        return np.frombuffer(raw[: count * dtype.itemsize], dtype=dtype).reshape(shape)
    if datatype == "BYTES":
        fill = b"0" if kind == "zero_data" else b"1"
        array = np.empty(count, dtype=object)
        array[:] = [fill] * count
        return array.reshape(shape)
    dtype = numpy_dtype(datatype)
    if kind == "random_data":
        rng = np.random.default_rng(0)
        if dtype.kind == "f":
            return rng.random(shape).astype(dtype)
        if dtype.kind == "b":
            return rng.integers(0, 2, shape).astype(dtype)
        return rng.integers(0, 8, shape).astype(dtype)
    return np.zeros(shape, dtype=dtype)


def run_warmup(runner: ModelRunner, model_dir: Path) -> None:
    """Run every warmup sample; a failing sample fails the load, naming the sample. (A decoupled
    model answers through response senders, which only a serving core provides: not warmed.)"""
    if runner.decoupled and runner.spec.config.model_warmup:
        logger.warning("model '%s': model_warmup is not run for decoupled models", runner.spec.name)
        return
    for name, count, request in warmup_requests(runner, model_dir):
        for _ in range(count):
            try:
                result = (runner.execute([runner.prepare(request)]) or [None])[0]
            except ServingError as exc:
                raise ModelConfigError(f"model_warmup '{name}' of model '{runner.spec.name}' failed: {exc}") from None
            if isinstance(result, ServingError):
                raise ModelConfigError(f"model_warmup '{name}' of model '{runner.spec.name}' failed: {result}")
        logger.info("model '%s': warmup sample '%s' ran %d time(s)", runner.spec.name, name, count)
