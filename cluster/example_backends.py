"""The example repository's models for the backends with optional extras: a forest for FIL, the
benchmark MLP as OpenVINO IR, a small TensorFlow SavedModel. Each is built here from code (a
forest trained on synthetic data, weights from a fixed seed) when its framework is installed,
and skipped, with the extra to install, when it is not.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np

FOREST_FEATURES = 16

FIL_FOREST_CONFIG = """name: "fil_forest"
backend: "fil"
max_batch_size: 256
input [ { name: "input__0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "output__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
dynamic_batching { max_queue_delay_microseconds: 500 }
parameters { key: "model_type" value: { string_value: "xgboost_ubj" } }
parameters { key: "output_class" value: { string_value: "true" } }
parameters { key: "predict_proba" value: { string_value: "true" } }
parameters { key: "cpu_nthread" value: { string_value: "1" } }
"""

MLP_OPENVINO_CONFIG = """name: "mlp_openvino"
backend: "openvino"
max_batch_size: 64
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 256 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 10 ] } ]
dynamic_batching { max_queue_delay_microseconds: 500 }
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "INFERENCE_NUM_THREADS" value: { string_value: "1" } }
parameters { key: "NUM_STREAMS" value: { string_value: "1" } }
parameters { key: "PERFORMANCE_HINT" value: { string_value: "LATENCY" } }
parameters { key: "INFERENCE_PRECISION_HINT" value: { string_value: "f32" } }
"""

# A SavedModel whose config Triton's auto-complete fills from the signature.
TF_MLP_CONFIG = """name: "tf_mlp"
platform: "tensorflow_savedmodel"
dynamic_batching { max_queue_delay_microseconds: 500 }
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "TF_NUM_INTRA_THREADS" value: { string_value: "1" } }
parameters { key: "TF_NUM_INTER_THREADS" value: { string_value: "1" } }
"""


def forest_data(rows: int = 2000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic features and binary labels: class 1 when x0 + x1 * x2 > 0."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, FOREST_FEATURES)).astype(np.float32)
    return x, (x[:, 0] + x[:, 1] * x[:, 2] > 0).astype(np.float32)


def xgboost_forest(objective: str = "binary:logistic", trees: int = 100, classes: int = 0):
    """An XGBoost booster trained on :func:`forest_data` (``classes`` > 0: labels 0..classes-1)."""
    import xgboost

    x, y = forest_data()
    params: dict = {"objective": objective, "max_depth": 6, "nthread": 1, "seed": 0}
    if classes:
        params["num_class"] = classes
        y = np.digitize(x[:, 0], np.linspace(-1, 1, classes - 1)).astype(np.float32)
    return xgboost.train(params, xgboost.DMatrix(x, y), trees)


def lightgbm_forest(trees: int = 100):
    """A LightGBM binary classifier trained on :func:`forest_data`."""
    import lightgbm

    x, y = forest_data()
    return lightgbm.train({"objective": "binary", "verbose": -1, "num_threads": 1, "seed": 0},
                          lightgbm.Dataset(x, y), trees)


def _version_dir(repository: Path, name: str, config: str | None, version: int = 1) -> Path:
    version_dir = Path(repository) / name / str(version)
    version_dir.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (Path(repository) / name / "config.pbtxt").write_text(config)
    return version_dir


def write_forest(repository: Path, name: str, config: str | None, booster, filename: str) -> Path:
    """An XGBoost or LightGBM booster saved as ``<version>/<filename>`` (XGBoost picks the format
    from the extension: ``.json``, ``.ubj``)."""
    booster.save_model(str(_version_dir(repository, name, config) / filename))
    return Path(repository) / name


def write_openvino_model(repository: Path, name: str, config: str | None, onnx_model) -> Path:
    """An ONNX model converted to OpenVINO IR (``model.xml`` and ``model.bin``, FP32 weights)."""
    import onnx
    import openvino

    version_dir = _version_dir(repository, name, config)
    source = version_dir / "source.onnx"
    onnx.save(onnx_model, str(source))
    try:
        openvino.save_model(openvino.convert_model(str(source)), str(version_dir / "model.xml"), compress_to_fp16=False)
    finally:
        source.unlink()
    return Path(repository) / name


TF_MLP_DIMS = (8, 16, 4)


def mlp_weights(dims: tuple[int, ...] = TF_MLP_DIMS, seed: int = 0) -> list[np.ndarray]:
    """The weight matrices of :func:`tf_mlp_module`'s MLP, from a fixed seed."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32) for a, b in zip(dims, dims[1:])]


def tf_mlp_module(dims: tuple[int, ...] = TF_MLP_DIMS, seed: int = 0):
    """A tf.Module with a ``serving_default`` signature: a ReLU MLP with :func:`mlp_weights`,
    input ``INPUT0`` [batch, dims[0]], output ``OUTPUT0``; and its weights."""
    import tensorflow as tf

    weights = mlp_weights(dims, seed)

    class Mlp(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = [tf.Variable(w) for w in weights]

        @tf.function(input_signature=[tf.TensorSpec([None, dims[0]], tf.float32, name="INPUT0")])
        def serve(self, x):
            for i, w in enumerate(self.layers):
                x = tf.matmul(x, w)
                x = tf.nn.relu(x) if i < len(self.layers) - 1 else x
            return {"OUTPUT0": x}

    return Mlp(), weights


def mlp_reference(weights: list[np.ndarray], x: np.ndarray) -> np.ndarray:
    """What :func:`tf_mlp_module`'s model computes, in numpy."""
    for i, w in enumerate(weights):
        x = x @ w
        x = np.maximum(x, 0) if i < len(weights) - 1 else x
    return x


def write_tf_savedmodel(repository: Path, name: str, config: str | None, module, signatures: dict | None = None) -> Path:
    """``<version>/model.savedmodel`` from a tf.Module (``signatures``: name -> function; default
    the module's ``serve`` as ``serving_default``)."""
    import tensorflow as tf

    path = _version_dir(repository, name, config) / "model.savedmodel"
    tf.saved_model.save(module, str(path), signatures=signatures or {"serving_default": module.serve})
    return Path(repository) / name


def write_tf_graphdef(repository: Path, name: str, config: str | None, module) -> Path:
    """``<version>/model.graphdef``: the module's ``serve`` frozen into one GraphDef (its input
    ``INPUT0``, its output ``Identity``)."""
    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2

    frozen = convert_variables_to_constants_v2(module.serve.get_concrete_function())
    (_version_dir(repository, name, config) / "model.graphdef").write_bytes(frozen.graph.as_graph_def().SerializeToString())
    return Path(repository) / name


def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def write_backend_examples(repository: Path) -> tuple[list[Path], list[str]]:
    """The FIL, OpenVINO and TensorFlow example models whose frameworks are installed; returns
    the folders written and, for each skipped, the reason."""
    from rayinfer.cluster.example_repository import mlp_model

    written, skipped = [], []
    if _installed("xgboost"):
        written.append(write_forest(repository, "fil_forest", FIL_FOREST_CONFIG, xgboost_forest(), "xgboost.ubj"))
    else:
        skipped.append("fil_forest: needs the fil extra (pip install 'rayinfer[fil]')")
    if _installed("openvino"):
        written.append(write_openvino_model(repository, "mlp_openvino", MLP_OPENVINO_CONFIG, mlp_model()))
    else:
        skipped.append("mlp_openvino: needs the openvino extra (pip install 'rayinfer[openvino]')")
    if _installed("tensorflow"):
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        written.append(write_tf_savedmodel(repository, "tf_mlp", TF_MLP_CONFIG, tf_mlp_module()[0]))
    else:
        skipped.append("tf_mlp: needs the tensorflow extra (pip install 'rayinfer[tensorflow]')")
    return written, skipped
