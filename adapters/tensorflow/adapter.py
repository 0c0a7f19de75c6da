"""TensorFlow adapter: Triton's TensorFlow backend for SavedModels and GraphDefs, on the CPU.

A SavedModel (folder ``model.savedmodel``) runs one of its signatures: ``TF_SIGNATURE_DEF``
(default ``serving_default``) of the MetaGraph tagged ``TF_GRAPH_TAG`` (default ``serve``); the
config's tensor names are the signature's input and output keys, and a config that leaves them
out is completed from the signature, as Triton does. A GraphDef (file ``model.graphdef``) is a
frozen graph whose config names its tensors (``name`` or ``name:0``); Triton completes nothing
for it. ``TF_NUM_INTRA_THREADS`` and ``TF_NUM_INTER_THREADS`` set TensorFlow's thread pools
(one model per replica process). KIND_GPU instances run on the replica's GPU when TensorFlow
sees one. TensorFlow itself is the optional ``tensorflow`` extra.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from rayinfer.adapters import parameters as params
from rayinfer.adapters.base import check_declared_tensors, error_line, model_file
from rayinfer.protocol.dtypes import wire_datatype
from rayinfer.protocol.errors import InternalError, InvalidArgError, ModelConfigError
from rayinfer.repository.instance_groups import runs_on_gpu
from rayinfer.repository.model_config import ModelConfig, ModelTensor, auto_complete_io

logger = logging.getLogger(__name__)

# Triton's default max_batch_size for auto-completed models that can batch.
DEFAULT_MAX_BATCH_SIZE = 4


def _import_tensorflow(model: str) -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter
    try:
        import tensorflow as tf
    except ImportError:
        raise ModelConfigError(
            f"model '{model}' is a TensorFlow model and needs TensorFlow: install rayinfer with the "
            "tensorflow extra (pip install 'rayinfer[tensorflow]')"
        ) from None
    return tf


class TensorFlowAdapter:
    """Runs a SavedModel signature (eagerly, as a concrete function) or a frozen GraphDef (in a
    ``tf.compat.v1.Session``)."""

    def __init__(self) -> None:
        self._tf: Any = None
        self._signature: Any = None  # SavedModel: the concrete function
        self._saved: Any = None  # SavedModel: keeps the loaded object (and its variables) alive
        self._session: Any = None  # GraphDef
        self._graph_inputs: dict[str, Any] = {}
        self._graph_outputs: dict[str, Any] = {}
        self._device = "/CPU:0"

    def load(self, model_dir: Path, version: int, config: ModelConfig, auto_complete: bool) -> None:
        tf = self._tf = _import_tensorflow(config.name)
        path = model_file(model_dir, version, config)
        self._threads(tf, config)
        if runs_on_gpu(config):
            if not tf.config.list_physical_devices("GPU"):
                raise ModelConfigError(
                    f"model '{config.name}' has GPU instances, but TensorFlow sees no GPU in this replica"
                )
            self._device = "/GPU:0"
        if config.platform == "tensorflow_graphdef":
            self._load_graphdef(tf, path, config)
        else:
            self._load_savedmodel(tf, path, config, auto_complete)

    @staticmethod
    def _threads(tf: Any, config: ModelConfig) -> None:
        intra = params.integer(config, "TF_NUM_INTRA_THREADS", 0)
        inter = params.integer(config, "TF_NUM_INTER_THREADS", 0)
        try:
            if intra:
                tf.config.threading.set_intra_op_parallelism_threads(intra)
            if inter:
                tf.config.threading.set_inter_op_parallelism_threads(inter)
        except RuntimeError:  # TensorFlow allows it once per process, before its first op
            logger.info("model '%s': TensorFlow's thread pools were set in this process already; "
                        "TF_NUM_INTRA_THREADS / TF_NUM_INTER_THREADS keep their first values", config.name)

    def _load_savedmodel(self, tf: Any, path: Path, config: ModelConfig, auto_complete: bool) -> None:
        tag = params.text(config, "TF_GRAPH_TAG", "serve")
        key = params.text(config, "TF_SIGNATURE_DEF", "serving_default")
        try:
            self._saved = tf.saved_model.load(str(path), tags=[tag])
        except Exception as exc:  # TensorFlow raises its own untyped errors
            raise ModelConfigError(f"failed to load SavedModel {path} (tag '{tag}'): {error_line(exc)}") from None
        signatures = dict(self._saved.signatures)
        if key not in signatures:
            raise ModelConfigError(
                f"model '{config.name}': the SavedModel in {path} has no signature '{key}' "
                f"(it has: {', '.join(signatures) or 'none'}); set TF_SIGNATURE_DEF"
            )
        self._signature = signatures[key]
        inputs = dict(self._signature.structured_input_signature[1])
        outputs = dict(self._signature.structured_outputs)
        if auto_complete:
            described_in = [_described(name, spec) for name, spec in inputs.items()]
            described_out = [_described(name, spec) for name, spec in outputs.items()]
            can_batch = all(s[2] and s[2][0] == -1 for s in described_in + described_out)
            auto_complete_io(config, described_in, described_out, DEFAULT_MAX_BATCH_SIZE if can_batch else 0)
        _check(config, "input", inputs, path)
        _check(config, "output", outputs, path)

    def _load_graphdef(self, tf: Any, path: Path, config: ModelConfig) -> None:
        graph_def = tf.compat.v1.GraphDef()
        try:
            graph_def.ParseFromString(path.read_bytes())
            graph = tf.Graph()
            with graph.as_default():
                tf.compat.v1.import_graph_def(graph_def, name="")
        except Exception as exc:
            raise ModelConfigError(f"failed to load GraphDef {path}: {error_line(exc)}") from None
        if not config.input or not config.output:
            raise ModelConfigError(
                f"model '{config.name}': a GraphDef model's config must declare its inputs and outputs ({path})"
            )

        def tensor(what: str, name: str) -> Any:
            try:
                found = graph.get_tensor_by_name(name if ":" in name else f"{name}:0")
            except (KeyError, ValueError):
                raise ModelConfigError(
                    f"model '{config.name}': unexpected inference {what} '{name}': the graph in {path} has no such tensor"
                ) from None
            return found

        self._graph_inputs = {t.name: tensor("input", t.name) for t in config.input}
        self._graph_outputs = {t.name: tensor("output", t.name) for t in config.output}
        for what, declared, tensors in (("input", config.input, self._graph_inputs),
                                        ("output", config.output, self._graph_outputs)):
            check_declared_tensors(config, what, declared,
                                   {n: (_wire(t.dtype), _wire(t.dtype)) for n, t in tensors.items()}, path)
        self._session = tf.compat.v1.Session(graph=graph)

    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str], parameters: dict[str, Any]
    ) -> dict[str, np.ndarray]:
        tf = self._tf
        try:
            if self._session is not None:
                fetched = self._session.run([self._graph_outputs[n] for n in output_names],
                                            {self._graph_inputs[n]: a for n, a in inputs.items()})
                return {n: _numpy(v) for n, v in zip(output_names, fetched)}
            with tf.device(self._device):
                results = self._signature(**{n: tf.constant(a) for n, a in inputs.items()})
            return {n: _numpy(results[n].numpy()) for n in output_names}
        except (tf.errors.InvalidArgumentError, ValueError, TypeError) as exc:
            raise InvalidArgError(f"TensorFlow rejected the request: {error_line(exc)}") from None
        except Exception as exc:
            raise InternalError(f"TensorFlow execution failed: {error_line(exc)}") from None

    def unload(self) -> None:
        if self._session is not None:
            self._session.close()
        self._session = self._signature = self._saved = None


def _described(name: str, spec: Any) -> ModelTensor:
    shape = [-1 if d is None else int(d) for d in spec.shape.as_list()] if spec.shape.rank is not None else [-1]
    return (name, _wire(spec.dtype), shape)


def _wire(dtype: Any) -> str:
    return "BYTES" if dtype.name == "string" else wire_datatype(np.dtype(dtype.as_numpy_dtype))


def _check(config: ModelConfig, what: str, specs: dict[str, Any], path: Path) -> None:
    """Config tensors must be keys of the signature, with the same datatype."""
    declared = config.input if what == "input" else config.output
    check_declared_tensors(config, what, declared, {n: (_wire(s.dtype), _wire(s.dtype)) for n, s in specs.items()}, path)


def _numpy(value: Any) -> np.ndarray:
    array = np.asarray(value)
    return array.astype(object) if array.dtype.kind in ("S", "O") else array
