"""TensorFlow adapter through the loader: SavedModel signatures and auto-complete, frozen
GraphDefs, the platform told from the files, errors naming the model and file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rayinfer.adapters.loader import load_runner
from rayinfer.cluster.example_backends import mlp_reference, tf_mlp_module, write_tf_graphdef, write_tf_savedmodel
from rayinfer.protocol.errors import ModelConfigError
from rayinfer.repository.model_config import config_to_json

tf = pytest.importorskip("tensorflow", reason="needs the tensorflow extra")

X = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)


@pytest.fixture(scope="module")
def module():
    return tf_mlp_module()


def test_savedmodel_auto_complete_and_answers(tmp_path: Path, module) -> None:
    mlp, weights = module
    write_tf_savedmodel(tmp_path, "saved", 'platform: "tensorflow_savedmodel"\n', mlp)
    runner, entry = load_runner(tmp_path, "saved", 1)
    doc = config_to_json(entry.config)
    assert (doc["platform"], doc["backend"], doc["default_model_filename"]) == (
        "tensorflow_savedmodel", "tensorflow", "model.savedmodel")
    assert doc["max_batch_size"] == 4 and "dynamic_batching" in doc
    assert [(t["name"], t["data_type"], t["dims"]) for t in doc["input"]] == [("INPUT0", "TYPE_FP32", [8])]
    assert [(t["name"], t["dims"]) for t in doc["output"]] == [("OUTPUT0", [4])]
    out = runner.adapter.execute({"INPUT0": X}, ["OUTPUT0"], {})["OUTPUT0"]
    np.testing.assert_allclose(out, mlp_reference(weights, X), rtol=1e-5, atol=1e-6)


def test_no_platform_is_told_from_the_model_folder(tmp_path: Path, module) -> None:
    write_tf_savedmodel(tmp_path, "found", None, module[0])
    runner, _ = load_runner(tmp_path, "found", 1)
    assert (runner.spec.platform, runner.spec.backend) == ("tensorflow_savedmodel", "tensorflow")
    write_tf_graphdef(tmp_path, "frozen", 'backend: "tensorflow"\nmax_batch_size: 8\n'
                      'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 8 ] } ]\n'
                      'output [ { name: "Identity" data_type: TYPE_FP32 dims: [ 4 ] } ]\n', module[0])
    runner, _ = load_runner(tmp_path, "frozen", 1)
    assert runner.spec.platform == "tensorflow_graphdef"


def test_signature_selected_by_tf_signature_def(tmp_path: Path, module) -> None:
    mlp, weights = module

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32, name="x")])
    def doubled(x):
        return {"twice": 2.0 * mlp.serve(x)["OUTPUT0"]}

    config = ('platform: "tensorflow_savedmodel"\n'
              'parameters { key: "TF_SIGNATURE_DEF" value: { string_value: "doubled" } }\n')
    write_tf_savedmodel(tmp_path, "two", config, mlp, {"serving_default": mlp.serve, "doubled": doubled})
    runner, _ = load_runner(tmp_path, "two", 1)
    assert [t.name for t in runner.spec.inputs] == ["x"] and [t.name for t in runner.spec.outputs] == ["twice"]
    out = runner.adapter.execute({"x": X}, ["twice"], {})["twice"]
    np.testing.assert_allclose(out, 2 * mlp_reference(weights, X), rtol=1e-5, atol=1e-6)
    (tmp_path / "two" / "config.pbtxt").write_text(config.replace('"doubled"', '"tripled"'))
    with pytest.raises(ModelConfigError, match=r"has no signature 'tripled' \(it has: .*doubled.*\); set TF_SIGNATURE_DEF"):
        load_runner(tmp_path, "two", 1)


def test_graphdef_answers_by_tensor_name(tmp_path: Path, module) -> None:
    mlp, weights = module
    config = ('platform: "tensorflow_graphdef"\nmax_batch_size: 8\n'
              'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 8 ] } ]\n'
              'output [ { name: "Identity:0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n')
    write_tf_graphdef(tmp_path, "graph", config, mlp)
    runner, _ = load_runner(tmp_path, "graph", 1)
    out = runner.adapter.execute({"INPUT0": X}, ["Identity:0"], {})["Identity:0"]
    np.testing.assert_allclose(out, mlp_reference(weights, X), rtol=1e-5, atol=1e-6)
    (tmp_path / "graph" / "config.pbtxt").write_text(config.replace('"Identity:0"', '"logits"'))
    with pytest.raises(ModelConfigError, match="unexpected inference output 'logits': the graph in .*graph/1/model.graphdef"):
        load_runner(tmp_path, "graph", 1)


def test_configs_that_do_not_fit_the_signature(tmp_path: Path, module) -> None:
    config = ('platform: "tensorflow_savedmodel"\nmax_batch_size: 4\n'
              'input [ { name: "INPUT0" data_type: TYPE_INT64 dims: [ 8 ] } ]\n')
    write_tf_savedmodel(tmp_path, "int", config, module[0])
    with pytest.raises(ModelConfigError, match="input 'INPUT0' is FP32 in the model but TYPE_INT64 in the config"):
        load_runner(tmp_path, "int", 1)


def test_corrupt_files_name_the_file(tmp_path: Path) -> None:
    (tmp_path / "junk" / "1" / "model.savedmodel").mkdir(parents=True)
    (tmp_path / "junk" / "1" / "model.savedmodel" / "saved_model.pb").write_bytes(b"\x01 not a graph")
    (tmp_path / "junk" / "config.pbtxt").write_text('platform: "tensorflow_savedmodel"\n')
    with pytest.raises(ModelConfigError, match=r"failed to load SavedModel .*junk/1/model.savedmodel"):
        load_runner(tmp_path, "junk", 1)
    (tmp_path / "frozen" / "1").mkdir(parents=True)
    (tmp_path / "frozen" / "1" / "model.graphdef").write_bytes(b"\x01 not a graph")
    (tmp_path / "frozen" / "config.pbtxt").write_text(
        'platform: "tensorflow_graphdef"\ninput [ { name: "a" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "b" data_type: TYPE_FP32 dims: [ 1 ] } ]\n')
    with pytest.raises(ModelConfigError, match=r"failed to load GraphDef .*frozen/1/model.graphdef"):
        load_runner(tmp_path, "frozen", 1)


def test_without_tensorflow_the_error_names_the_extra(tmp_path: Path, module, monkeypatch) -> None:
    write_tf_savedmodel(tmp_path, "saved", 'platform: "tensorflow_savedmodel"\n', module[0])
    monkeypatch.setitem(__import__("sys").modules, "tensorflow", None)  # as on an install without it
    with pytest.raises(ModelConfigError, match=r"needs TensorFlow: install rayinfer with the tensorflow extra \(pip install 'rayinfer\[tensorflow\]'\)"):
        load_runner(tmp_path, "saved", 1)
