"""A tree model file loaded by the library that reads it, and predicted by the fastest one here.

Triton's FIL backend reads every format through Treelite and predicts with RAPIDS FIL. Here the
frameworks' own CPU predictors and Treelite's GTIL are used, whichever ran faster on the same
forest (``benchmarks/fil_predictors.py``): XGBoost's ``inplace_predict`` costs about 0.2 ms per
call whatever the rows, so batches under :data:`SMALL_BATCH_ROWS` rows of an XGBoost model go
to Treelite's GTIL, larger ones to XGBoost; LightGBM's own predictor was the faster at every
size; a Treelite checkpoint has only GTIL. A forest predicts probabilities (or values) for
each row: shape ``(rows,)`` for one output, ``(rows, classes)`` for several.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

import numpy as np

from rayinfer.adapters.base import error_line
from rayinfer.protocol.errors import ModelConfigError

logger = logging.getLogger(__name__)

# Below this many rows, an XGBoost model is predicted by Treelite's GTIL (see the module text).
SMALL_BATCH_ROWS = 32
_EXTRA = "install rayinfer with the fil extra (pip install 'rayinfer[fil]')"


@dataclass
class Forest:
    """A loaded forest: ``predict`` for any batch, its feature count, SHAP values when the
    framework has them."""

    num_features: int
    predict_large: Callable[[np.ndarray], np.ndarray]
    predict_small: Callable[[np.ndarray], np.ndarray] | None = None
    shap: Callable[[np.ndarray], np.ndarray] | None = None
    library: str = ""

    def predict(self, x: np.ndarray) -> np.ndarray:
        small = self.predict_small if x.shape[0] < SMALL_BATCH_ROWS else None
        out = (small or self.predict_large)(x)
        out = np.asarray(out, dtype=np.float32).reshape(x.shape[0], -1)
        return out[:, 0] if out.shape[1] == 1 else out


def load_forest(path: Path, model_type: str, threads: int, on_gpu: bool, model: str,
                allow_unknown_field: bool = False) -> Forest:
    """Load ``path`` as ``model_type``; errors name the file (and the extra when a library is
    missing). ``threads``: CPU threads per prediction (0: every core); ``allow_unknown_field``:
    an XGBoost JSON file's unknown keys are ignored (else refused by Treelite)."""
    threads = threads or _omp_threads() or os.cpu_count() or 1
    try:
        if model_type.startswith("xgboost"):
            return _xgboost(path, model_type, threads, on_gpu, model, allow_unknown_field)
        if on_gpu:
            raise ModelConfigError(
                f"model '{model}' has GPU instances, but only XGBoost forests run on a GPU here "
                f"(model_type '{model_type}'): use KIND_CPU"
            )
        if model_type == "lightgbm":
            return _lightgbm(path, threads, model)
        return _treelite_checkpoint(path, threads, model)
    except ModelConfigError:
        raise
    except Exception as exc:  # the frameworks raise their own untyped errors
        raise ModelConfigError(f"failed to load {model_type} model {path}: {error_line(exc)}") from None


def _optional(name: str) -> Any:
    try:
        return __import__(name)
    except ImportError:
        return None


def _omp_threads() -> int:
    """OpenMP's thread limit in this process (Ray sets OMP_NUM_THREADS in a replica from its
    CPUs); 0 when unset."""
    try:
        return max(int(os.environ.get("OMP_NUM_THREADS", "0")), 0)
    except ValueError:
        return 0


def _gtil(tl_model: Any, threads: int) -> Callable[[np.ndarray], np.ndarray]:
    import treelite.gtil

    limit = _omp_threads()  # Treelite refuses more threads than OpenMP allows
    threads = min(threads, limit) if limit else threads
    return lambda x: treelite.gtil.predict(tl_model, x, nthread=threads)


def _xgboost(path: Path, model_type: str, threads: int, on_gpu: bool, model: str, allow_unknown_field: bool) -> Forest:
    xgb, treelite = _optional("xgboost"), _optional("treelite")
    if xgb is None and (treelite is None or on_gpu):
        raise ModelConfigError(f"model '{model}' is an XGBoost forest ({model_type}) and needs xgboost: {_EXTRA}")
    tl_model = None
    if treelite is not None and not on_gpu:
        import treelite.frontend  # noqa: F401  (the submodule, for the loaders below)

        if model_type == "xgboost":
            tl_model = treelite.frontend.load_xgboost_model_legacy_binary(str(path))
        else:
            tl_model = treelite.frontend.load_xgboost_model(
                str(path), format_choice="json" if model_type == "xgboost_json" else "ubjson",
                allow_unknown_field=allow_unknown_field)
    if xgb is None:
        assert tl_model is not None
        return Forest(tl_model.num_feature, _gtil(tl_model, threads), library="treelite")
    booster = xgb.Booster()
    booster.load_model(bytearray(path.read_bytes()))  # the format read from the bytes, not the name
    booster.set_param({"nthread": threads})
    if on_gpu:
        if not xgb.build_info().get("USE_CUDA"):
            raise ModelConfigError(
                f"model '{model}' has GPU instances, but this xgboost has no CUDA support: install the "
                "xgboost package (its CUDA build) in place of xgboost-cpu"
            )
        booster.set_param({"device": "cuda"})

    def shap(x: np.ndarray) -> np.ndarray:
        return booster.predict(xgb.DMatrix(x, nthread=threads), pred_contribs=True)

    return Forest(
        booster.num_features(), lambda x: booster.inplace_predict(x, validate_features=False),
        _gtil(tl_model, threads) if tl_model is not None else None, shap, library="xgboost",
    )


def _lightgbm(path: Path, threads: int, model: str) -> Forest:
    lgb = _optional("lightgbm")
    if lgb is None:
        treelite = _optional("treelite")
        if treelite is None:
            raise ModelConfigError(f"model '{model}' is a LightGBM forest and needs lightgbm: {_EXTRA}")
        import treelite.frontend  # noqa: F401

        tl_model = treelite.frontend.load_lightgbm_model(str(path))
        return Forest(tl_model.num_feature, _gtil(tl_model, threads), library="treelite")
    booster = lgb.Booster(model_file=str(path))

    def shap(x: np.ndarray) -> np.ndarray:
        return booster.predict(x, pred_contrib=True, num_threads=threads)

    return Forest(booster.num_feature(), lambda x: booster.predict(x, num_threads=threads),
                  None, shap, library="lightgbm")


def _treelite_checkpoint(path: Path, threads: int, model: str) -> Forest:
    treelite = _optional("treelite")
    if treelite is None:
        raise ModelConfigError(f"model '{model}' is a Treelite checkpoint and needs treelite: {_EXTRA}")
    tl_model = treelite.Model.deserialize(str(path))
    return Forest(tl_model.num_feature, _gtil(tl_model, threads), library="treelite")
