"""FIL adapter through the loader: Triton's model types, file names and parameters, against the
frameworks' own predictions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rayinfer.adapters.fil import forest
from rayinfer.adapters.loader import load_runner
from rayinfer.cluster.example_backends import forest_data, lightgbm_forest, write_forest, xgboost_forest
from rayinfer.protocol.errors import ModelConfigError
from rayinfer.repository.model_config import config_to_json

xgboost = pytest.importorskip("xgboost", reason="needs the fil extra (xgboost)")
treelite = pytest.importorskip("treelite", reason="needs the fil extra (treelite)")

ROWS = forest_data(rows=64, seed=7)[0]


def _config(model_type: str, *, outputs: int = 1, extra: str = "", batch: int = 64, io: bool = True) -> str:
    params = "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n'
                     for k, v in [("model_type", model_type), ("cpu_nthread", "1")])
    tensors = (f'input [ {{ name: "input__0" data_type: TYPE_FP32 dims: [ 16 ] }} ]\n'
               f'output [ {{ name: "output__0" data_type: TYPE_FP32 dims: [ {outputs} ] }} ]\n') if io else ""
    return f'backend: "fil"\nmax_batch_size: {batch}\n{tensors}{params}{extra}'


def _param(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'


def _run(repo: Path, name: str, rows: np.ndarray = ROWS, output: str = "output__0") -> np.ndarray:
    runner, _ = load_runner(repo, name, 1)
    return runner.adapter.execute({"input__0": rows}, [output], {})[output]


@pytest.fixture(scope="module")
def binary():
    return xgboost_forest()


def test_each_xgboost_format_gives_xgboosts_own_probabilities(tmp_path: Path, binary) -> None:
    expected = binary.inplace_predict(ROWS)
    for model_type, filename in (("xgboost_json", "xgboost.json"), ("xgboost_ubj", "xgboost.ubj")):
        write_forest(tmp_path, model_type, _config(model_type), binary, filename)
        np.testing.assert_allclose(_run(tmp_path, model_type)[:, 0], expected, rtol=1e-5)


def test_small_batches_go_to_treelite_and_agree_with_xgboost(tmp_path: Path, binary) -> None:
    write_forest(tmp_path, "m", _config("xgboost_json"), binary, "xgboost.json")
    runner, _ = load_runner(tmp_path, "m", 1)
    loaded = runner.adapter._forest
    assert loaded.library == "xgboost" and loaded.predict_small is not None
    small = ROWS[: forest.SMALL_BATCH_ROWS - 1]
    np.testing.assert_allclose(loaded.predict(small), binary.inplace_predict(small), rtol=1e-5)


def test_output_class_thresholds_a_binary_classifier(tmp_path: Path, binary) -> None:
    p = binary.inplace_predict(ROWS)
    write_forest(tmp_path, "half", _config("xgboost_json", extra=_param("output_class", "true")), binary, "xgboost.json")
    np.testing.assert_array_equal(_run(tmp_path, "half")[:, 0], (p > 0.5).astype(np.float32))
    config = _config("xgboost_json", extra=_param("output_class", "true") + _param("threshold", "0.9"))
    write_forest(tmp_path, "strict", config, binary, "xgboost.json")
    np.testing.assert_array_equal(_run(tmp_path, "strict")[:, 0], (p > 0.9).astype(np.float32))


def test_predict_proba_of_a_binary_classifier_with_two_columns(tmp_path: Path, binary) -> None:
    p = binary.inplace_predict(ROWS)
    extra = _param("output_class", "true") + _param("predict_proba", "true")
    write_forest(tmp_path, "proba", _config("xgboost_ubj", outputs=2, extra=extra), binary, "xgboost.ubj")
    np.testing.assert_allclose(_run(tmp_path, "proba"), np.stack([1 - p, p], axis=1), rtol=1e-5, atol=1e-7)


def test_multiclass_argmax_and_probabilities(tmp_path: Path) -> None:
    model = xgboost_forest("multi:softprob", trees=10, classes=3)
    p = model.inplace_predict(ROWS)
    write_forest(tmp_path, "cls", _config("xgboost_json", extra=_param("output_class", "true")), model, "xgboost.json")
    np.testing.assert_array_equal(_run(tmp_path, "cls")[:, 0], np.argmax(p, axis=1))
    extra = _param("output_class", "true") + _param("predict_proba", "true")
    write_forest(tmp_path, "proba", _config("xgboost_json", outputs=3, extra=extra), model, "xgboost.json")
    np.testing.assert_allclose(_run(tmp_path, "proba"), p, rtol=1e-5)


def test_a_regressor_returns_its_values(tmp_path: Path) -> None:
    model = xgboost_forest("reg:squarederror", trees=20)
    write_forest(tmp_path, "reg", _config("xgboost_json"), model, "xgboost.json")
    np.testing.assert_allclose(_run(tmp_path, "reg")[:, 0], model.inplace_predict(ROWS), rtol=1e-5)


def test_lightgbm_and_treelite_checkpoint(tmp_path: Path) -> None:
    model = lightgbm_forest()
    write_forest(tmp_path, "lgb", _config("lightgbm"), model, "model.txt")
    np.testing.assert_allclose(_run(tmp_path, "lgb")[:, 0], model.predict(ROWS), rtol=1e-5)
    binary = xgboost_forest(trees=30)
    (tmp_path / "tl" / "1").mkdir(parents=True)
    (tmp_path / "tl" / "config.pbtxt").write_text(_config("treelite_checkpoint"))
    treelite.frontend.from_xgboost(binary).serialize(str(tmp_path / "tl" / "1" / "checkpoint.tl"))
    np.testing.assert_allclose(_run(tmp_path, "tl")[:, 0], binary.inplace_predict(ROWS), rtol=1e-5)


def test_treeshap_output_from_the_framework(tmp_path: Path, binary) -> None:
    extra = 'output [ { name: "treeshap_output" data_type: TYPE_FP32 dims: [ 17 ] } ]\n'
    write_forest(tmp_path, "shap", _config("xgboost_json", extra=extra), binary, "xgboost.json")
    shap = _run(tmp_path, "shap", output="treeshap_output")
    expected = binary.predict(xgboost.DMatrix(ROWS), pred_contribs=True)
    assert shap.shape == (len(ROWS), 17)
    np.testing.assert_allclose(shap, expected, rtol=1e-4, atol=1e-5)


def test_auto_complete_fills_triton_fil_names(tmp_path: Path) -> None:
    write_forest(tmp_path, "auto", _config("lightgbm", batch=0, io=False, extra=_param("output_class", "true")),
                 lightgbm_forest(trees=5), "model.txt")
    runner, entry = load_runner(tmp_path, "auto", 1)
    doc = config_to_json(entry.config)
    assert [(t["name"], t["data_type"], t["dims"]) for t in doc["input"]] == [("input__0", "TYPE_FP32", [16])]
    assert [(t["name"], t["dims"]) for t in doc["output"]] == [("output__0", [1])]
    assert doc["max_batch_size"] == 4 and "dynamic_batching" in doc


def test_default_model_filename_overrides_the_model_types(tmp_path: Path, binary) -> None:
    write_forest(tmp_path, "named", _config("xgboost_json", extra='default_model_filename: "trees.json"\n'),
                 binary, "trees.json")
    assert _run(tmp_path, "named").shape == (len(ROWS), 1)


@pytest.mark.parametrize("extra, message", [
    (_param("model_type", "sklearn"), "parameter model_type must be one of xgboost, xgboost_json"),
    (_param("output_class", "maybe"), "parameter output_class must be true or false"),
    (_param("threshold", "high"), "parameter threshold must be a number"),
    (_param("storage_type", "TINY"), "parameter storage_type must be one of AUTO, DENSE"),
])
def test_bad_parameters_are_refused_naming_the_key(tmp_path: Path, binary, extra: str, message: str) -> None:
    config = _config("xgboost_json").replace(_param("model_type", "xgboost_json"), "") + extra
    if "model_type" not in extra:
        config += _param("model_type", "xgboost_json")
    write_forest(tmp_path, "bad", config, binary, "xgboost.json")
    with pytest.raises(ModelConfigError, match=message):
        load_runner(tmp_path, "bad", 1)


def test_config_that_does_not_fit_the_forest_is_refused(tmp_path: Path, binary) -> None:
    write_forest(tmp_path, "wide", _config("xgboost_json").replace("dims: [ 16 ]", "dims: [ 20 ]"), binary, "xgboost.json")
    with pytest.raises(ModelConfigError, match=r"input__0 has 20 features in the config but the model in .*wide/1/xgboost.json takes 16"):
        load_runner(tmp_path, "wide", 1)
    write_forest(tmp_path, "fp64", _config("xgboost_json").replace("TYPE_FP32", "TYPE_FP64", 1), binary, "xgboost.json")
    with pytest.raises(ModelConfigError, match="input__0 must be TYPE_FP32 for the FIL backend, not TYPE_FP64"):
        load_runner(tmp_path, "fp64", 1)
    write_forest(tmp_path, "named", _config("xgboost_json").replace("input__0", "features"), binary, "xgboost.json")
    with pytest.raises(ModelConfigError, match="unexpected inference input 'features', allowed inputs are: input__0"):
        load_runner(tmp_path, "named", 1)


def test_missing_and_corrupt_files_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "gone" / "1").mkdir(parents=True)
    (tmp_path / "gone" / "config.pbtxt").write_text(_config("lightgbm"))
    with pytest.raises(ModelConfigError, match=r"model file not found: .*gone/1/model.txt"):
        load_runner(tmp_path, "gone", 1)
    (tmp_path / "junk" / "1").mkdir(parents=True)
    (tmp_path / "junk" / "config.pbtxt").write_text(_config("xgboost_ubj"))
    (tmp_path / "junk" / "1" / "xgboost.ubj").write_bytes(b"\x00\x01 not a forest")
    with pytest.raises(ModelConfigError, match=r"failed to load xgboost_ubj model .*junk/1/xgboost.ubj"):
        load_runner(tmp_path, "junk", 1)


def test_gpu_instances_of_a_lightgbm_forest_are_refused(tmp_path: Path) -> None:
    config = _config("lightgbm") + "instance_group [ { kind: KIND_GPU } ]\n"
    write_forest(tmp_path, "gpu", config, lightgbm_forest(trees=5), "model.txt")
    with pytest.raises(ModelConfigError, match="only XGBoost forests run on a GPU here"):
        load_runner(tmp_path, "gpu", 1, on_gpu=True)


def test_without_the_frameworks_the_error_names_the_extra(tmp_path: Path, binary, monkeypatch) -> None:
    write_forest(tmp_path, "m", _config("xgboost_json"), binary, "xgboost.json")
    write_forest(tmp_path, "lgb", _config("lightgbm"), lightgbm_forest(trees=5), "model.txt")
    for name in ("xgboost", "lightgbm", "treelite"):  # as on an install without the fil extra
        monkeypatch.setitem(__import__("sys").modules, name, None)
    for model, what in (("m", "XGBoost forest"), ("lgb", "LightGBM forest")):
        with pytest.raises(ModelConfigError, match=fr"is an? {what}.* install rayinfer with the fil extra"):
            load_runner(tmp_path, model, 1)


def test_without_xgboost_treelite_predicts_the_whole_forest(tmp_path: Path, binary, monkeypatch) -> None:
    write_forest(tmp_path, "m", _config("xgboost_json"), binary, "xgboost.json")
    monkeypatch.setitem(__import__("sys").modules, "xgboost", None)
    runner, _ = load_runner(tmp_path, "m", 1)
    assert runner.adapter._forest.library == "treelite"
    np.testing.assert_allclose(runner.adapter.execute({"input__0": ROWS}, ["output__0"], {})["output__0"][:, 0],
                               binary.inplace_predict(ROWS), rtol=1e-5)
