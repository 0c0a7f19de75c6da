"""ONNX Runtime adapter through the loader: auto-complete, config checks, broken files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto

from rayinfer.adapters.base import create_adapter
from rayinfer.adapters.loader import load_runner
from rayinfer.adapters.onnxruntime.adapter import OnnxRuntimeAdapter
from rayinfer.cluster.example_repository import SIMPLE_CONFIG, add_sub_model, mlp_model, write_model
from rayinfer.protocol.errors import ModelConfigError, UnsupportedError
from rayinfer.repository.model_config import BatchingSpec, TensorSpec, config_to_json


def test_registry_creates_onnxruntime_adapter() -> None:
    assert isinstance(create_adapter("onnxruntime"), OnnxRuntimeAdapter)
    with pytest.raises(UnsupportedError, match="backend 'nope' is not supported"):
        create_adapter("nope")


def test_auto_complete_without_config(tmp_path: Path) -> None:
    write_model(tmp_path, "addsub", None, add_sub_model(TensorProto.FLOAT))
    runner, entry = load_runner(tmp_path, "addsub", 1)
    spec = runner.spec
    assert (spec.name, spec.platform, spec.backend) == ("addsub", "onnxruntime_onnx", "onnxruntime")
    assert spec.max_batch_size == 4
    assert spec.dynamic_batching == BatchingSpec()
    assert spec.inputs == (TensorSpec("INPUT0", "FP32", (16,)), TensorSpec("INPUT1", "FP32", (16,)))
    assert spec.outputs == (TensorSpec("OUTPUT0", "FP32", (16,)), TensorSpec("OUTPUT1", "FP32", (16,)))
    doc = config_to_json(entry.config)  # the completed config is what the server reports
    assert doc["max_batch_size"] == 4 and "dynamic_batching" in doc
    assert [(t["name"], t["data_type"], t["dims"]) for t in doc["input"]] == [
        ("INPUT0", "TYPE_FP32", [16]), ("INPUT1", "TYPE_FP32", [16])
    ]


def test_auto_complete_of_non_batching_model(tmp_path: Path) -> None:
    write_model(tmp_path, "fixed", None, add_sub_model(TensorProto.INT32, batch=False))
    runner, _ = load_runner(tmp_path, "fixed", 1)
    assert runner.spec.max_batch_size == 0
    assert runner.spec.dynamic_batching is None
    assert runner.spec.inputs[0] == TensorSpec("INPUT0", "INT32", (16,))


def test_auto_complete_keeps_declared_batch_size(tmp_path: Path) -> None:
    write_model(tmp_path, "mlp", 'backend: "onnxruntime" max_batch_size: 32', mlp_model((8, 4, 3)))
    runner, _ = load_runner(tmp_path, "mlp", 1)
    assert runner.spec.max_batch_size == 32
    assert runner.spec.inputs == (TensorSpec("INPUT0", "FP32", (8,)),)
    assert runner.spec.outputs == (TensorSpec("OUTPUT0", "FP32", (3,)),)


def test_without_auto_complete_an_empty_config_fails(tmp_path: Path) -> None:
    write_model(tmp_path, "addsub", None, add_sub_model(TensorProto.FLOAT))
    with pytest.raises(ModelConfigError, match="at least one output"):
        load_runner(tmp_path, "addsub", 1, auto_complete=False)


def test_full_config_loads_without_auto_complete(tmp_path: Path) -> None:
    write_model(tmp_path, "simple", SIMPLE_CONFIG, add_sub_model(TensorProto.INT32))
    runner, _ = load_runner(tmp_path, "simple", 1, auto_complete=False)
    assert runner.spec.max_batch_size == 8 and runner.version == "1"


def test_config_input_missing_from_model(tmp_path: Path) -> None:
    config = SIMPLE_CONFIG.replace('name: "INPUT1"', 'name: "INPUT9"')
    write_model(tmp_path, "simple", config, add_sub_model(TensorProto.INT32))
    with pytest.raises(ModelConfigError) as info:
        load_runner(tmp_path, "simple", 1)
    assert "unexpected inference input 'INPUT9'" in info.value.message
    assert "INPUT0, INPUT1" in info.value.message


def test_config_datatype_differs_from_model(tmp_path: Path) -> None:
    write_model(tmp_path, "simple", SIMPLE_CONFIG, add_sub_model(TensorProto.FLOAT))
    with pytest.raises(ModelConfigError, match="input .INPUT0. is tensor\\(float\\) in the model but TYPE_INT32"):
        load_runner(tmp_path, "simple", 1)


def test_missing_model_file_names_the_path(tmp_path: Path) -> None:
    model_dir = write_model(tmp_path, "simple", SIMPLE_CONFIG, add_sub_model(TensorProto.INT32))
    (model_dir / "1" / "model.onnx").unlink()
    with pytest.raises(ModelConfigError) as info:
        load_runner(tmp_path, "simple", 1)
    assert str(model_dir / "1" / "model.onnx") in info.value.message


def test_corrupt_model_file(tmp_path: Path) -> None:
    model_dir = write_model(tmp_path, "simple", SIMPLE_CONFIG, add_sub_model(TensorProto.INT32))
    (model_dir / "1" / "model.onnx").write_bytes(b"this is not an onnx model")
    with pytest.raises(ModelConfigError) as info:
        load_runner(tmp_path, "simple", 1)
    assert info.value.message.startswith(f"failed to load ONNX model {model_dir / '1' / 'model.onnx'}")


def test_broken_config_and_unserved_version(tmp_path: Path) -> None:
    write_model(tmp_path, "simple", SIMPLE_CONFIG, add_sub_model(TensorProto.INT32), version=2)
    with pytest.raises(ModelConfigError, match="version 1 is not served by the version policy"):
        load_runner(tmp_path, "simple", 1)
    (tmp_path / "simple" / "config.pbtxt").write_text("max_batch_size: {")
    with pytest.raises(ModelConfigError, match="config.pbtxt: failed to parse"):
        load_runner(tmp_path, "simple", 2)


def test_invalid_thread_count_parameter(tmp_path: Path) -> None:
    config = SIMPLE_CONFIG + 'parameters { key: "intra_op_thread_count" value: { string_value: "many" } }\n'
    write_model(tmp_path, "simple", config, add_sub_model(TensorProto.INT32))
    with pytest.raises(ModelConfigError, match="invalid thread count parameter"):
        load_runner(tmp_path, "simple", 1)


def test_adapter_execute_converts_strings(tmp_path: Path) -> None:
    write_model(tmp_path, "s", None, add_sub_model(TensorProto.STRING))
    runner, _ = load_runner(tmp_path, "s", 1)
    a = np.array([[str(i).encode() for i in range(16)]], dtype=object)
    b = np.array([[b"1"] * 16], dtype=object)
    out = runner.adapter.execute({"INPUT0": a, "INPUT1": b}, ["OUTPUT1"], {})
    assert list(out) == ["OUTPUT1"]
    assert out["OUTPUT1"].dtype == object
    assert out["OUTPUT1"][0].tolist() == [str(i - 1).encode() for i in range(16)]


WARMUP_CONFIG = """platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
model_warmup [ {
  name: "sample" batch_size: 2 count: 3
  inputs { key: "INPUT0" value: { data_type: TYPE_INT32 dims: [ 16 ] zero_data: true } }
  inputs { key: "INPUT1" value: { data_type: TYPE_INT32 dims: [ 16 ] random_data: true } }
} ]
"""


def test_model_warmup_runs_and_leaves_statistics_empty(tmp_path) -> None:
    from onnx import TensorProto

    from rayinfer.adapters.loader import load_runner
    from rayinfer.cluster.example_repository import add_sub_model, write_model

    write_model(tmp_path, "warm", WARMUP_CONFIG, add_sub_model(TensorProto.INT32))
    runner, _ = load_runner(tmp_path, "warm", 1)
    assert runner.stats.snapshot()["execution_count"] == 0


def test_broken_model_warmup_fails_the_load_naming_the_sample(tmp_path) -> None:
    from onnx import TensorProto

    from rayinfer.adapters.loader import load_runner
    from rayinfer.cluster.example_repository import add_sub_model, write_model
    from rayinfer.protocol.errors import ModelConfigError

    write_model(tmp_path, "warm", WARMUP_CONFIG.replace("dims: [ 16 ] zero_data", "dims: [ 8 ] zero_data"),
                add_sub_model(TensorProto.INT32))
    with pytest.raises(ModelConfigError, match="model_warmup 'sample' of model 'warm' failed"):
        load_runner(tmp_path, "warm", 1)


def test_execution_providers_follow_the_instance_kind() -> None:
    from google.protobuf import text_format

    from rayinfer.adapters.onnxruntime.adapter import execution_providers
    from rayinfer.repository.model_config import ModelConfig

    def config(text: str) -> ModelConfig:
        return text_format.Parse('name: "m" ' + text, ModelConfig())

    cpu = config("instance_group [ { kind: KIND_CPU } ]")
    assert execution_providers(cpu, ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    gpu = config("instance_group [ { kind: KIND_GPU } ]")
    with_cuda = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    assert execution_providers(gpu, with_cuda) == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    with pytest.raises(ModelConfigError, match=r"no CUDA execution provider .*install the gpu extra"):
        execution_providers(gpu, ["CPUExecutionProvider"])
    trt = config("instance_group [ { kind: KIND_GPU } ] optimization { execution_accelerators { "
                 'gpu_execution_accelerator: [ { name: "tensorrt" } ] } }')
    assert execution_providers(trt, with_cuda)[0] == "TensorrtExecutionProvider"
    with pytest.raises(ModelConfigError, match="asks for the tensorrt execution accelerator"):
        execution_providers(trt, ["CUDAExecutionProvider", "CPUExecutionProvider"])
