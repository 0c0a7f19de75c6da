"""OpenVINO adapter through the loader: IR and ONNX files, Triton's OpenVINO parameters,
auto-complete, and errors naming the model and file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from rayinfer.adapters.loader import load_runner
from rayinfer.cluster.example_backends import write_openvino_model
from rayinfer.cluster.example_repository import mlp_model
from rayinfer.protocol.errors import InvalidArgError, ModelConfigError
from rayinfer.repository.model_config import config_to_json

pytest.importorskip("openvino", reason="needs the openvino extra")

DIMS = (8, 16, 4)
F32 = 'parameters { key: "INFERENCE_PRECISION_HINT" value: { string_value: "f32" } }\n'
CONFIG = f"""backend: "openvino"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 8 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
parameters {{ key: "INFERENCE_NUM_THREADS" value: {{ string_value: "1" }} }}
{F32}"""


def _param(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'


def _expected(x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(mlp_model(DIMS).SerializeToString()).run(None, {"INPUT0": x})[0]


X = np.random.default_rng(5).standard_normal((3, 8)).astype(np.float32)


def test_ir_model_answers_as_onnxruntime_does(tmp_path: Path) -> None:
    write_openvino_model(tmp_path, "ir", CONFIG, mlp_model(DIMS))
    assert sorted(p.name for p in (tmp_path / "ir" / "1").iterdir()) == ["model.bin", "model.xml"]
    runner, _ = load_runner(tmp_path, "ir", 1)
    for rows in (1, 3):
        out = runner.adapter.execute({"INPUT0": X[:rows]}, ["OUTPUT0"], {})["OUTPUT0"]
        np.testing.assert_allclose(out, _expected(X[:rows]), rtol=1e-4, atol=1e-5)


def test_an_onnx_file_through_default_model_filename(tmp_path: Path) -> None:
    (tmp_path / "onnx" / "1").mkdir(parents=True)
    onnx.save(mlp_model(DIMS), str(tmp_path / "onnx" / "1" / "model.onnx"))
    (tmp_path / "onnx" / "config.pbtxt").write_text(CONFIG + 'default_model_filename: "model.onnx"\n')
    runner, _ = load_runner(tmp_path, "onnx", 1)
    out = runner.adapter.execute({"INPUT0": X}, ["OUTPUT0"], {})["OUTPUT0"]
    np.testing.assert_allclose(out, _expected(X), rtol=1e-4, atol=1e-5)


def test_auto_complete_from_the_model(tmp_path: Path) -> None:
    write_openvino_model(tmp_path, "auto", 'backend: "openvino"\n' + F32, mlp_model(DIMS))
    runner, entry = load_runner(tmp_path, "auto", 1)
    doc = config_to_json(entry.config)
    assert doc["max_batch_size"] == 4 and "dynamic_batching" in doc
    assert [(t["name"], t["data_type"], t["dims"]) for t in doc["input"]] == [("INPUT0", "TYPE_FP32", [8])]
    assert [(t["name"], t["dims"]) for t in doc["output"]] == [("OUTPUT0", [4])]


def test_a_fixed_batch_without_padding_refuses_smaller_batches(tmp_path: Path) -> None:
    write_openvino_model(tmp_path, "fixed", CONFIG + _param("SKIP_OV_DYNAMIC_BATCHSIZE", "YES"), mlp_model(DIMS))
    runner, _ = load_runner(tmp_path, "fixed", 1)
    full = np.repeat(X[:1], 8, axis=0)
    np.testing.assert_allclose(runner.adapter.execute({"INPUT0": full}, ["OUTPUT0"], {})["OUTPUT0"],
                               _expected(full), rtol=1e-4, atol=1e-5)
    with pytest.raises(InvalidArgError, match="takes batches of exactly 8 .* got 3; set ENABLE_BATCH_PADDING"):
        runner.adapter.execute({"INPUT0": X}, ["OUTPUT0"], {})


def test_batch_padding_answers_smaller_batches(tmp_path: Path) -> None:
    config = CONFIG + _param("SKIP_OV_DYNAMIC_BATCHSIZE", "YES") + _param("ENABLE_BATCH_PADDING", "YES")
    write_openvino_model(tmp_path, "padded", config, mlp_model(DIMS))
    runner, _ = load_runner(tmp_path, "padded", 1)
    out = runner.adapter.execute({"INPUT0": X}, ["OUTPUT0"], {})["OUTPUT0"]
    assert out.shape == (3, 4)
    np.testing.assert_allclose(out, _expected(X), rtol=1e-4, atol=1e-5)


def test_reshape_io_layers_takes_the_configs_dims(tmp_path: Path) -> None:
    """A model exported for one fixed batch of 1 serves dynamic batches: the batch dimension
    becomes dynamic, and RESHAPE_IO_LAYERS gives the inputs the config's dims."""
    model = mlp_model(DIMS)
    for value in list(model.graph.input) + list(model.graph.output):
        value.type.tensor_type.shape.dim[0].ClearField("dim_param")
        value.type.tensor_type.shape.dim[0].dim_value = 1
    write_openvino_model(tmp_path, "static", CONFIG + _param("RESHAPE_IO_LAYERS", "YES"), model)
    runner, _ = load_runner(tmp_path, "static", 1)
    out = runner.adapter.execute({"INPUT0": X}, ["OUTPUT0"], {})["OUTPUT0"]
    np.testing.assert_allclose(out, _expected(X), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("change, message", [
    (("INPUT0", "FEATURES"), "unexpected inference input 'FEATURES', allowed inputs are: INPUT0"),
    (("TYPE_FP32", "TYPE_INT32"), "input 'INPUT0' is FP32 in the model but TYPE_INT32 in the config"),
])
def test_configs_that_do_not_fit_the_model(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    write_openvino_model(tmp_path, "bad", CONFIG.replace(*change, 1), mlp_model(DIMS))
    with pytest.raises(ModelConfigError, match=message):
        load_runner(tmp_path, "bad", 1)


@pytest.mark.parametrize("extra, message", [
    (_param("PERFORMANCE_HINT", "FAST"), "PERFORMANCE_HINT must be one of LATENCY, THROUGHPUT"),
    (_param("NUM_STREAMS", "lots"), "NUM_STREAMS must be a whole number of at least 1"),
])
def test_bad_parameters_name_the_key(tmp_path: Path, extra: str, message: str) -> None:
    write_openvino_model(tmp_path, "bad", CONFIG + extra, mlp_model(DIMS))
    with pytest.raises(ModelConfigError, match=message):
        load_runner(tmp_path, "bad", 1)


def test_a_corrupt_ir_file_names_the_file(tmp_path: Path) -> None:
    write_openvino_model(tmp_path, "junk", CONFIG, mlp_model(DIMS))
    (tmp_path / "junk" / "1" / "model.xml").write_text("<net><broken")
    with pytest.raises(ModelConfigError, match=r"failed to load OpenVINO model .*junk/1/model.xml"):
        load_runner(tmp_path, "junk", 1)


def test_gpu_instances_without_an_openvino_gpu_are_refused(tmp_path: Path) -> None:
    write_openvino_model(tmp_path, "gpu", CONFIG + "instance_group [ { kind: KIND_GPU } ]\n", mlp_model(DIMS))
    with pytest.raises(ModelConfigError, match="OpenVINO here has no GPU device"):
        load_runner(tmp_path, "gpu", 1, on_gpu=True)


def test_without_openvino_the_error_names_the_extra(tmp_path: Path, monkeypatch) -> None:
    write_openvino_model(tmp_path, "ir", CONFIG, mlp_model(DIMS))
    monkeypatch.setitem(__import__("sys").modules, "openvino", None)  # as on an install without it
    with pytest.raises(ModelConfigError, match=r"needs openvino: install rayinfer with the openvino extra"):
        load_runner(tmp_path, "ir", 1)
