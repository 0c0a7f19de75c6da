"""TorchScript adapter through the loader: Triton's I/O binding, dtypes, parameters, errors."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from rayinfer.adapters.base import create_adapter
from rayinfer.adapters.loader import load_runner
from rayinfer.protocol.errors import InvalidArgError, ModelConfigError
from rayinfer.protocol.types import InferInput, InferRequest

pytest.importorskip("torch", reason="needs PyTorch (the torch or test extra)")

from torchscript_models import ADD_SUB_CONFIG, NAMED_CONFIG, modules, write_torchscript_model  # noqa: E402

MODULES = modules()


def infer(runner, **arrays: tuple[str, np.ndarray]):
    request = InferRequest(model_name=runner.spec.name, inputs=[
        InferInput(name, datatype, array.shape, array) for name, (datatype, array) in arrays.items()
    ])
    result = runner.execute([runner.prepare(request)])[0]
    if isinstance(result, Exception):
        raise result
    return {out.name: out.data for out in result.outputs}


def test_registry_knows_pytorch() -> None:
    assert type(create_adapter("pytorch")).__name__ == "TorchScriptAdapter"


def test_inputs_and_outputs_by_index(tmp_path: Path) -> None:
    write_torchscript_model(tmp_path, "addsub", ADD_SUB_CONFIG, MODULES["add_sub"])
    runner, _ = load_runner(tmp_path, "addsub", 1)
    assert runner.spec.platform == "pytorch_libtorch"
    a = np.arange(32, dtype=np.float32).reshape(2, 16)
    b = np.ones((2, 16), dtype=np.float32)
    out = infer(runner, INPUT__1=("FP32", b), INPUT__0=("FP32", a))
    np.testing.assert_array_equal(out["OUTPUT__0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT__1"], a - b)


def test_indices_out_of_config_order(tmp_path: Path) -> None:
    config = ADD_SUB_CONFIG.replace('name: "OUTPUT__0"', 'name: "DIFF__1"', 1).replace(
        'name: "OUTPUT__1"', 'name: "SUM__0"', 1)
    write_torchscript_model(tmp_path, "swapped", config, MODULES["add_sub"])
    runner, _ = load_runner(tmp_path, "swapped", 1)
    a, b = np.full((1, 16), 5, np.float32), np.full((1, 16), 2, np.float32)
    out = infer(runner, INPUT__0=("FP32", a), INPUT__1=("FP32", b))
    assert out["SUM__0"][0, 0] == 7 and out["DIFF__1"][0, 0] == 3


def test_inputs_by_forward_argument_names_and_list_outputs(tmp_path: Path) -> None:
    write_torchscript_model(tmp_path, "named", NAMED_CONFIG, MODULES["named"])
    runner, _ = load_runner(tmp_path, "named", 1)
    values = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64)
    scale = np.array([[10], [100]], dtype=np.int64)
    out = infer(runner, values=("INT64", values), scale=("INT64", scale))
    np.testing.assert_array_equal(out["scaled"], values * scale)
    np.testing.assert_array_equal(out["total"], [[6], [15]])


def test_traced_module_binds_by_position(tmp_path: Path) -> None:
    config = ADD_SUB_CONFIG.replace("INPUT__0", "first").replace("INPUT__1", "second")
    write_torchscript_model(tmp_path, "traced", config, MODULES["traced"])
    runner, _ = load_runner(tmp_path, "traced", 1)
    a, b = np.full((1, 16), 5, np.float32), np.full((1, 16), 2, np.float32)
    out = infer(runner, second=("FP32", b), first=("FP32", a))
    assert out["OUTPUT__0"][0, 0] == 7 and out["OUTPUT__1"][0, 0] == 3


@pytest.mark.parametrize("datatype, dtype", [
    ("BOOL", np.bool_), ("UINT8", np.uint8), ("INT8", np.int8), ("INT16", np.int16), ("INT32", np.int32),
    ("INT64", np.int64), ("FP16", np.float16), ("FP32", np.float32), ("FP64", np.float64),
])
def test_every_numeric_datatype(tmp_path: Path, datatype: str, dtype) -> None:
    config = f"""platform: "pytorch_libtorch"
max_batch_size: 2
input [ {{ name: "INPUT__0" data_type: TYPE_{datatype} dims: [ 3 ] }} ]
output [ {{ name: "OUTPUT__0" data_type: TYPE_{datatype} dims: [ 3 ] }} ]
"""
    write_torchscript_model(tmp_path, "ident", config, MODULES["identity"])
    runner, _ = load_runner(tmp_path, "ident", 1)
    array = np.array([[1, 0, 1]], dtype=dtype)
    out = infer(runner, INPUT__0=(datatype, array))["OUTPUT__0"]
    assert out.dtype == dtype
    np.testing.assert_array_equal(out, array)


def test_bytes_tensors_are_refused_at_load(tmp_path: Path) -> None:
    config = ADD_SUB_CONFIG.replace("TYPE_FP32", "TYPE_STRING")
    write_torchscript_model(tmp_path, "strings", config, MODULES["add_sub"])
    with pytest.raises(ModelConfigError, match="tensor 'INPUT__0' has datatype BYTES"):
        load_runner(tmp_path, "strings", 1)


def test_input_count_unlike_forward_is_a_load_error(tmp_path: Path) -> None:
    config = ADD_SUB_CONFIG.replace(
        '  { name: "INPUT__1" data_type: TYPE_FP32 dims: [ 16 ] }\n', "").replace(
        '{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ 16 ] },', '{ name: "x" data_type: TYPE_FP32 dims: [ 16 ] }')
    write_torchscript_model(tmp_path, "short", config, MODULES["add_sub"])
    with pytest.raises(ModelConfigError, match=r"declares 1 inputs \['x'\] but forward\(\) takes 2 \['a', 'b'\]"):
        load_runner(tmp_path, "short", 1)


def test_execution_error_names_pytorch(tmp_path: Path) -> None:
    config = """platform: "pytorch_libtorch"
max_batch_size: 0
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""
    write_torchscript_model(tmp_path, "fails", config, MODULES["fails"])
    runner, _ = load_runner(tmp_path, "fails", 1)
    with pytest.raises(InvalidArgError, match="PyTorch execute failure: .*shape"):
        infer(runner, INPUT__0=("FP32", np.ones(4, np.float32)))


def test_output_beyond_the_returned_values(tmp_path: Path) -> None:
    config = ADD_SUB_CONFIG.replace('name: "OUTPUT__1"', 'name: "OUTPUT__2"')
    write_torchscript_model(tmp_path, "three", config, MODULES["add_sub"])
    runner, _ = load_runner(tmp_path, "three", 1)
    a = np.ones((1, 16), np.float32)
    result = runner.execute([runner.prepare(InferRequest(model_name="three", inputs=[
        InferInput("INPUT__0", "FP32", a.shape, a), InferInput("INPUT__1", "FP32", a.shape, a)]))])[0]
    assert "output 'OUTPUT__2' is position 2 of the model's outputs, but the model returned 2" in str(result)


def test_broken_file_names_the_file(tmp_path: Path) -> None:
    write_torchscript_model(tmp_path, "broken", ADD_SUB_CONFIG, MODULES["add_sub"])
    path = tmp_path / "broken" / "1" / "model.pt"
    path.write_bytes(b"not a torchscript archive")
    with pytest.raises(ModelConfigError, match=f"failed to load TorchScript model {path}"):
        load_runner(tmp_path, "broken", 1)


def test_bad_parameter_value(tmp_path: Path) -> None:
    config = ADD_SUB_CONFIG + 'parameters { key: "INFERENCE_MODE" value: { string_value: "maybe" } }\n'
    write_torchscript_model(tmp_path, "param", config, MODULES["add_sub"])
    with pytest.raises(ModelConfigError, match="INFERENCE_MODE must be true or false, got 'maybe'"):
        load_runner(tmp_path, "param", 1)


def test_without_torch_the_error_names_the_extra(tmp_path: Path, monkeypatch) -> None:
    write_torchscript_model(tmp_path, "addsub", ADD_SUB_CONFIG, MODULES["add_sub"])
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(ModelConfigError, match=r"needs PyTorch: install rayinfer with the torch extra"):
        load_runner(tmp_path, "addsub", 1)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs an NVIDIA GPU with CUDA")
def test_gpu_instances_run_on_cuda(tmp_path: Path) -> None:
    config = ADD_SUB_CONFIG + "instance_group [ { count: 1 kind: KIND_GPU } ]\n"
    write_torchscript_model(tmp_path, "addsub_gpu", config, MODULES["add_sub"])
    runner, _ = load_runner(tmp_path, "addsub_gpu", 1, on_gpu=True)
    assert runner.adapter._device == "cuda"
    a = np.arange(32, dtype=np.float32).reshape(2, 16)
    b = np.full((2, 16), 3, dtype=np.float32)
    out = infer(runner, INPUT__0=("FP32", a), INPUT__1=("FP32", b))
    np.testing.assert_array_equal(out["OUTPUT__0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT__1"], a - b)


def test_gpu_instances_without_cuda_name_the_reason(tmp_path: Path, monkeypatch) -> None:
    # A replica whose torch sees no CUDA device (a CPU build, or no GPU), on any machine.
    monkeypatch.setattr(__import__("torch").cuda, "is_available", lambda: False)
    config = ADD_SUB_CONFIG + "instance_group [ { count: 1 kind: KIND_GPU } ]\n"
    write_torchscript_model(tmp_path, "addsub_gpu", config, MODULES["add_sub"])
    with pytest.raises(ModelConfigError, match="has GPU instances, but torch sees no CUDA device"):
        load_runner(tmp_path, "addsub_gpu", 1, on_gpu=True)
