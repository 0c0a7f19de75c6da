"""The GPU variants of the FIL, OpenVINO and TensorFlow backends: KIND_GPU instances on a
machine that has the device, answering as the CPU does. Each skips without its device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rayinfer.adapters.loader import load_runner
from rayinfer.cluster import example_backends as models
from rayinfer.cluster.example_repository import mlp_model

pytestmark = pytest.mark.gpu
GPU_GROUP = "instance_group [ { count: 1 kind: KIND_GPU } ]"
CPU_GROUP = "instance_group [ { count: 1 kind: KIND_CPU } ]"


def _both(root: Path, write, config: str) -> tuple:
    write(root / "cpu", config)
    write(root / "gpu", config.replace(CPU_GROUP, GPU_GROUP))
    return load_runner(root / "cpu", "m", 1)[0], load_runner(root / "gpu", "m", 1, on_gpu=True)[0]


def test_an_xgboost_forest_on_xgboosts_cuda_predictor(tmp_path: Path) -> None:
    xgboost = pytest.importorskip("xgboost", reason="needs the fil extra")
    if not xgboost.build_info().get("USE_CUDA"):
        pytest.skip("needs a GPU and xgboost with CUDA (the xgboost package, not xgboost-cpu)")
    forest = models.xgboost_forest(trees=20)
    config = models.FIL_FOREST_CONFIG.replace('name: "fil_forest"\n', "")
    cpu, gpu = _both(tmp_path, lambda root, c: models.write_forest(root, "m", c, forest, "xgboost.ubj"), config)
    x = models.forest_data(rows=64, seed=9)[0]
    np.testing.assert_allclose(gpu.adapter.execute({"input__0": x}, ["output__0"], {})["output__0"],
                               cpu.adapter.execute({"input__0": x}, ["output__0"], {})["output__0"], rtol=1e-4, atol=1e-6)


def test_an_openvino_model_on_openvinos_gpu_plugin(tmp_path: Path) -> None:
    openvino = pytest.importorskip("openvino", reason="needs the openvino extra")
    if "GPU" not in openvino.Core().available_devices:
        pytest.skip("needs a GPU that OpenVINO's GPU plugin drives (an Intel GPU)")
    config = models.MLP_OPENVINO_CONFIG.replace('name: "mlp_openvino"\n', "")
    cpu, gpu = _both(tmp_path, lambda root, c: models.write_openvino_model(root, "m", c, mlp_model()), config)
    x = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    np.testing.assert_allclose(gpu.adapter.execute({"INPUT0": x}, ["OUTPUT0"], {})["OUTPUT0"],
                               cpu.adapter.execute({"INPUT0": x}, ["OUTPUT0"], {})["OUTPUT0"], rtol=1e-2, atol=1e-2)


def test_a_savedmodel_on_the_gpu(tmp_path: Path) -> None:
    tf = pytest.importorskip("tensorflow", reason="needs the tensorflow extra")
    if not tf.config.list_physical_devices("GPU"):
        pytest.skip("needs a GPU and a GPU build of TensorFlow")
    config = models.TF_MLP_CONFIG.replace('name: "tf_mlp"\n', "")
    module = models.tf_mlp_module()[0]
    cpu, gpu = _both(tmp_path, lambda root, c: models.write_tf_savedmodel(root, "m", c, module), config)
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_allclose(gpu.adapter.execute({"INPUT0": x}, ["OUTPUT0"], {})["OUTPUT0"],
                               cpu.adapter.execute({"INPUT0": x}, ["OUTPUT0"], {})["OUTPUT0"], rtol=1e-4, atol=1e-5)
