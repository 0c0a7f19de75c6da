"""model_warmup through the FIL, OpenVINO and TensorFlow adapters: each sample runs at load, and
the statistics start empty."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from rayinfer.adapters.loader import load_runner
from rayinfer.cluster import example_backends as models
from rayinfer.cluster.example_repository import mlp_model


def _warmup(name: str, features: int) -> str:
    return (f'model_warmup [ {{ name: "sample" batch_size: 4 count: 3\n'
            f'  inputs {{ key: "{name}" value: {{ data_type: TYPE_FP32 dims: [ {features} ] random_data: true }} }} }} ]\n')


def _fil(root: Path) -> None:
    models.write_forest(root, "m", models.FIL_FOREST_CONFIG.replace('name: "fil_forest"\n', "") + _warmup("input__0", 16),
                        models.xgboost_forest(trees=5), "xgboost.ubj")


def _openvino(root: Path) -> None:
    models.write_openvino_model(root, "m", models.MLP_OPENVINO_CONFIG.replace('name: "mlp_openvino"\n', "")
                                + _warmup("INPUT0", 256), mlp_model())


def _tensorflow(root: Path) -> None:
    config = ('platform: "tensorflow_savedmodel"\nmax_batch_size: 8\n'
              'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 8 ] } ]\n'
              'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]\n' + _warmup("INPUT0", 8))
    models.write_tf_savedmodel(root, "m", config, models.tf_mlp_module()[0])


@pytest.mark.parametrize("framework, write", [("xgboost", _fil), ("openvino", _openvino), ("tensorflow", _tensorflow)])
def test_warmup_samples_run_through_the_backend(tmp_path: Path, caplog, framework: str, write) -> None:
    pytest.importorskip(framework, reason=f"needs {framework} (its rayinfer extra)")
    write(tmp_path)
    with caplog.at_level(logging.INFO, logger="rayinfer.adapters.warmup"):
        runner, _ = load_runner(tmp_path, "m", 1)
    assert "model 'm': warmup sample 'sample' ran 3 time(s)" in caplog.text
    assert runner.stats.snapshot()["execution_count"] == 0
