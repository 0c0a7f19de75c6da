"""FIL adapter: Triton's FIL backend for tree models (XGBoost, LightGBM, Treelite checkpoints).

As Triton's FIL backend: input ``input__0`` (FP32, one row of features per batch row; NaN is a
missing value), output ``output__0`` (FP32), and an optional ``treeshap_output`` with SHAP
values (XGBoost and LightGBM forests). The config's ``parameters``:

- ``model_type``: ``xgboost`` (the legacy binary format), ``xgboost_json``, ``xgboost_ubj``,
  ``lightgbm``, ``treelite_checkpoint``; the default file names are ``xgboost.model``,
  ``xgboost.json``, ``xgboost.ubj``, ``model.txt``, ``checkpoint.tl``
  (``default_model_filename`` overrides them).
- ``output_class`` (default false): a classifier; ``output__0`` is then the class index,
  unless ``predict_proba`` (default false) asks for each class's probability (a binary
  classifier's one probability, or ``[1-p, p]`` when ``output__0`` has 2 columns).
- ``threshold`` (default 0.5): a binary classifier's cut-off for class 1.
- ``cpu_nthread`` (default: the replica's OpenMP limit, which Ray sets from its CPUs, else every
  core): threads per prediction.
- ``xgboost_allow_unknown_field`` (default false): an XGBoost JSON file's unknown keys are ignored.
- ``storage_type``, ``algo``, ``threads_per_tree``, ``blocks_per_sm``, ``transfer_threshold``,
  ``use_experimental_optimizations``, ``layout``, ``chunk_size``: RAPIDS FIL's tuning, which
  changes no answer; checked and accepted.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from rayinfer.adapters import parameters as params
from rayinfer.adapters.base import model_file
from rayinfer.adapters.fil.forest import Forest, load_forest
from rayinfer.protocol.errors import InternalError, ModelConfigError
from rayinfer.repository.instance_groups import runs_on_gpu
from rayinfer.repository.model_config import FIL_MODEL_FILES, ModelConfig, auto_complete_io, mc

logger = logging.getLogger(__name__)

INPUT = "input__0"
OUTPUT = "output__0"
SHAP_OUTPUT = "treeshap_output"
# Triton's default max_batch_size for auto-completed models that can batch.
DEFAULT_MAX_BATCH_SIZE = 4
# RAPIDS FIL's tuning parameters: they change speed on a GPU, never an answer.
_TUNING = {
    "storage_type": ("AUTO", "DENSE", "SPARSE", "SPARSE8"),
    "algo": ("ALGO_AUTO", "NAIVE", "TREE_REORG", "BATCH_TREE_REORG"),
    "layout": ("depth_first", "breadth_first", "layered"),
}
_TUNING_COUNTS = ("threads_per_tree", "blocks_per_sm", "transfer_threshold", "chunk_size")
_TUNING_FLAGS = ("use_experimental_optimizations",)


class FilAdapter:
    """Runs a forest with the frameworks' CPU predictors (see :mod:`rayinfer.adapters.fil.forest`)."""

    def __init__(self) -> None:
        self._forest: Forest | None = None
        self._classes = 1
        self._output_class = False
        self._predict_proba = False
        self._threshold = 0.5
        self._proba_columns = 1

    def load(self, model_dir: Path, version: int, config: ModelConfig, auto_complete: bool) -> None:
        model_type = params.choice(config, "model_type", "xgboost", tuple(FIL_MODEL_FILES))
        self._output_class = params.flag(config, "output_class", False)
        self._predict_proba = params.flag(config, "predict_proba", False)
        self._threshold = params.number(config, "threshold", 0.5)
        threads = params.integer(config, "cpu_nthread", 0)
        for key, allowed in _TUNING.items():
            params.choice(config, key, allowed[0], allowed)
        for key in _TUNING_COUNTS:
            params.integer(config, key, 0)
        for key in _TUNING_FLAGS:
            params.flag(config, key, False)
        path = model_file(model_dir, version, config)  # named by model_type when the config names none
        self._forest = load_forest(path, model_type, threads, runs_on_gpu(config), config.name,
                                   params.flag(config, "xgboost_allow_unknown_field", False))
        probe = self._forest.predict(np.zeros((1, self._forest.num_features), dtype=np.float32))
        self._classes = probe.shape[1] if probe.ndim == 2 else 1
        if auto_complete:
            self._auto_complete(config)
        self._check_config(config, path)
        logger.info("model '%s': %s forest, %d features, %d output column(s), predicted by %s",
                    config.name, model_type, self._forest.num_features, self._classes, self._forest.library)

    def _output_width(self) -> int:
        if self._output_class and not self._predict_proba:
            return 1
        return self._classes

    def _auto_complete(self, config: ModelConfig) -> None:
        """Fill ``input__0``, ``output__0`` and max_batch_size from the forest when absent."""
        assert self._forest is not None
        auto_complete_io(config, [(INPUT, "FP32", [-1, self._forest.num_features])],
                         [(OUTPUT, "FP32", [-1, self._output_width()])], DEFAULT_MAX_BATCH_SIZE)

    def _check_config(self, config: ModelConfig, path: Path) -> None:
        assert self._forest is not None
        names = {t.name: t for t in config.input}
        if INPUT not in names:
            raise ModelConfigError(
                f"model '{config.name}': a FIL model takes one input named '{INPUT}' "
                f"(the config declares {', '.join(names) or 'none'})"
            )
        if len(names) > 1:
            extra = ", ".join(n for n in names if n != INPUT)
            raise ModelConfigError(f"model '{config.name}': unexpected inference input '{extra}', "
                                   f"allowed inputs are: {INPUT}")
        for tensor in list(config.input) + list(config.output):
            if tensor.data_type != mc.TYPE_FP32:
                raise ModelConfigError(
                    f"model '{config.name}': {tensor.name} must be TYPE_FP32 for the FIL backend, "
                    f"not {mc.DataType.Name(tensor.data_type)}"
                )
        dims = list(names[INPUT].dims)
        if dims and dims[-1] not in (-1, self._forest.num_features):
            raise ModelConfigError(
                f"model '{config.name}': {INPUT} has {dims[-1]} features in the config but the model in "
                f"{path} takes {self._forest.num_features}"
            )
        for tensor in config.output:
            if tensor.name == SHAP_OUTPUT:
                if self._forest.shap is None:
                    raise ModelConfigError(
                        f"model '{config.name}': {SHAP_OUTPUT} needs an XGBoost or LightGBM forest ({path})"
                    )
            elif tensor.name != OUTPUT:
                raise ModelConfigError(f"model '{config.name}': unexpected inference output '{tensor.name}', "
                                       f"allowed outputs are: {OUTPUT}, {SHAP_OUTPUT}")
            elif tensor.dims and tensor.dims[-1] == 2 and self._predict_proba and self._classes == 1:
                self._proba_columns = 2

    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str], parameters: dict[str, Any]
    ) -> dict[str, np.ndarray]:
        assert self._forest is not None
        x = np.ascontiguousarray(inputs[INPUT], dtype=np.float32)
        rows = x.shape[0] if x.ndim > 1 else 1
        x = x.reshape(rows, -1)
        out: dict[str, np.ndarray] = {}
        try:
            if OUTPUT in output_names:
                out[OUTPUT] = self._postprocess(self._forest.predict(x))
            if SHAP_OUTPUT in output_names and self._forest.shap is not None:
                out[SHAP_OUTPUT] = np.asarray(self._forest.shap(x), dtype=np.float32).reshape(rows, -1)
        except Exception as exc:  # the frameworks raise their own untyped errors
            raise InternalError(f"{self._forest.library} prediction failed: {exc}") from None
        return out

    def _postprocess(self, scores: np.ndarray) -> np.ndarray:
        """FIL's outputs from the forest's probabilities or values: class indices, the
        probabilities themselves, or regression values; one column per class."""
        if self._output_class and not self._predict_proba:
            if scores.ndim == 2:
                return np.argmax(scores, axis=1).astype(np.float32).reshape(-1, 1)
            return (scores > self._threshold).astype(np.float32).reshape(-1, 1)
        if scores.ndim == 1:
            if self._proba_columns == 2:
                return np.stack([1.0 - scores, scores], axis=1).astype(np.float32)
            return scores.reshape(-1, 1)
        return scores

    def unload(self) -> None:
        self._forest = None
