"""ModelRunner: request validation with Triton's messages, merged execution, statistics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from rayinfer.adapters.loader import load_runner
from rayinfer.adapters.model_runner import ModelRunner
from rayinfer.cluster.example_repository import (
    SIMPLE_CONFIG,
    SIMPLE_STRING_CONFIG,
    add_sub_model,
    write_model,
)
from rayinfer.protocol.errors import InvalidArgError, ServingError
from rayinfer.protocol.types import InferInput, InferRequest, InferResponse, RequestedOutput

VARDIM_CONFIG = """name: "vardim"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Z" data_type: TYPE_FP32 dims: [ -1 ] } ]
dynamic_batching { }
"""


def _vardim_model():
    shape = ["batch", "n"]
    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "Y"], ["Z"])], "vardim",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("X", "Y")],
        [helper.make_tensor_value_info("Z", TensorProto.FLOAT, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    write_model(root, "simple", SIMPLE_CONFIG, add_sub_model(TensorProto.INT32))
    write_model(root, "simple_string", SIMPLE_STRING_CONFIG, add_sub_model(TensorProto.STRING))
    write_model(root, "vardim", VARDIM_CONFIG, _vardim_model())
    return root


def _runner(repository: Path, name: str) -> ModelRunner:
    runner, _ = load_runner(repository, name, 1)
    return runner


@pytest.fixture
def simple(repository: Path) -> ModelRunner:
    return _runner(repository, "simple")


def _tensor(name: str, array: np.ndarray, datatype: str = "INT32") -> InferInput:
    return InferInput(name, datatype, tuple(array.shape), array)


def _simple_request(rows: int = 1, base: int = 0, outputs: list[str] | None = None, id: str | None = None) -> InferRequest:
    a = (np.arange(rows * 16, dtype=np.int32) + base).reshape(rows, 16)
    b = np.ones((rows, 16), dtype=np.int32)
    requested = [RequestedOutput(n) for n in outputs] if outputs is not None else None
    return InferRequest("simple", inputs=[_tensor("INPUT0", a), _tensor("INPUT1", b)], outputs=requested, id=id)


def _prepare_error(runner: ModelRunner, request: InferRequest) -> str:
    with pytest.raises(InvalidArgError) as info:
        runner.prepare(request)
    return info.value.message


def test_unknown_input(simple: ModelRunner) -> None:
    request = _simple_request()
    request.inputs.append(_tensor("INPUT9", np.zeros((1, 16), np.int32)))
    assert _prepare_error(simple, request) == "unexpected inference input 'INPUT9' for model 'simple'"


def test_missing_input(simple: ModelRunner) -> None:
    request = _simple_request()
    del request.inputs[1]
    assert _prepare_error(simple, request) == (
        "expected 2 inputs but got 1 inputs for model 'simple'. Got input(s) ['INPUT0'], but missing "
        "required input(s) ['INPUT1']. Please provide all required input(s)."
    )


def test_duplicate_input(simple: ModelRunner) -> None:
    request = _simple_request()
    request.inputs[1] = _tensor("INPUT0", np.zeros((1, 16), np.int32))
    assert "expected 2 inputs but got 2 inputs" in _prepare_error(simple, request)


def test_wrong_datatype(simple: ModelRunner) -> None:
    request = _simple_request()
    request.inputs[0] = _tensor("INPUT0", np.zeros((1, 16), np.float32), "FP32")
    assert _prepare_error(simple, request) == (
        "inference input 'INPUT0' data-type is 'FP32', but model 'simple' expects 'INT32'"
    )


@pytest.mark.parametrize("shape", [(1, 15), (16,), (1, 16, 1)])
def test_wrong_shape(simple: ModelRunner, shape: tuple[int, ...]) -> None:
    request = _simple_request()
    request.inputs[0] = _tensor("INPUT0", np.zeros(shape, np.int32))
    got = "[" + ",".join(map(str, shape)) + "]"
    assert _prepare_error(simple, request) == (
        f"unexpected shape for input 'INPUT0' for model 'simple'. Expected [-1,16], got {got}"
    )


def test_batch_larger_than_max(simple: ModelRunner) -> None:
    assert _prepare_error(simple, _simple_request(rows=9)) == (
        "inference request batch-size must be <= 8 for 'simple'"
    )


def test_empty_batch(simple: ModelRunner) -> None:
    assert "batch-size must be >= 1" in _prepare_error(simple, _simple_request(rows=0))


def test_inputs_with_different_batch_sizes(simple: ModelRunner) -> None:
    request = _simple_request(rows=2)
    request.inputs[1] = _tensor("INPUT1", np.zeros((3, 16), np.int32))
    assert "input 'INPUT1' batch size 3 does not match the batch size 2" in _prepare_error(simple, request)


def test_unknown_requested_output(simple: ModelRunner) -> None:
    request = _simple_request(outputs=["OUTPUT0", "OUTPUT7"])
    assert _prepare_error(simple, request) == "unexpected inference output 'OUTPUT7' for model 'simple'"


def test_prepare_counts_rows_and_outputs(simple: ModelRunner) -> None:
    prepared = simple.prepare(_simple_request(rows=3, outputs=["OUTPUT1"]))
    assert prepared.rows == 3
    assert prepared.output_names == ("OUTPUT1",)
    assert simple.prepare(_simple_request()).output_names == ("OUTPUT0", "OUTPUT1")


def _ok(result: InferResponse | ServingError) -> InferResponse:
    assert isinstance(result, InferResponse), result
    return result


def test_merged_execution_of_uneven_requests(simple: ModelRunner) -> None:
    requests = [_simple_request(rows=n, base=100 * i, id=f"r{i}") for i, n in enumerate((1, 3, 2))]
    results = simple.execute([simple.prepare(r) for r in requests])
    assert len(results) == 3
    for request, result in zip(requests, results):
        response = _ok(result)
        a, b = request.inputs[0].data, request.inputs[1].data
        assert (response.model_name, response.model_version, response.id) == ("simple", "1", request.id)
        out0, out1 = response.outputs
        assert (out0.name, out0.datatype, out0.shape) == ("OUTPUT0", "INT32", a.shape)
        np.testing.assert_array_equal(out0.data, a + b)
        np.testing.assert_array_equal(out1.data, a - b)
    snap = simple.stats.snapshot()
    assert snap["execution_count"] == 1  # one model execution for the three requests
    assert snap["inference_count"] == 6
    assert list(snap["batch_stats"]) == [6]
    assert snap["durations"]["success"][0] == 3
    assert snap["durations"]["compute_infer"][0] == 3


def test_requested_outputs_only(simple: ModelRunner) -> None:
    results = simple.execute([simple.prepare(_simple_request(outputs=["OUTPUT1"])),
                              simple.prepare(_simple_request(rows=2))])
    assert [o.name for o in _ok(results[0]).outputs] == ["OUTPUT1"]
    assert [o.name for o in _ok(results[1]).outputs] == ["OUTPUT0", "OUTPUT1"]
    assert simple.stats.snapshot()["execution_count"] == 2  # different outputs: not merged


def _vardim_request(rows: int, width: int, start: float) -> InferRequest:
    x = (np.arange(rows * width, dtype=np.float32) + start).reshape(rows, width)
    y = np.full((rows, width), 0.5, dtype=np.float32)
    return InferRequest("vardim", inputs=[_tensor("X", x, "FP32"), _tensor("Y", y, "FP32")])


def test_different_variable_dims_execute_separately(repository: Path) -> None:
    runner = _runner(repository, "vardim")
    requests = [_vardim_request(1, 4, 0), _vardim_request(2, 3, 10), _vardim_request(2, 4, 20)]
    results = runner.execute([runner.prepare(r) for r in requests])
    for request, result in zip(requests, results):
        (z,) = _ok(result).outputs
        assert z.shape == request.inputs[0].shape
        np.testing.assert_allclose(z.data, request.inputs[0].data + 0.5)
    snap = runner.stats.snapshot()
    assert snap["execution_count"] == 2  # width 4 requests merged (3 rows), width 3 alone (2 rows)
    assert sorted(snap["batch_stats"]) == [2, 3]


def test_string_model_returns_bytes_sums(repository: Path) -> None:
    runner = _runner(repository, "simple_string")
    a = np.array([[str(i).encode() for i in range(16)]] * 2, dtype=object)
    b = np.array([[b"2"] * 16] * 2, dtype=object)
    request = InferRequest("simple_string", inputs=[_tensor("INPUT0", a, "BYTES"), _tensor("INPUT1", b, "BYTES")])
    (result,) = runner.execute([runner.prepare(request)])
    out0, out1 = _ok(result).outputs
    assert out0.datatype == "BYTES" and out0.shape == (2, 16)
    assert out0.data[1].tolist() == [str(i + 2).encode() for i in range(16)]
    assert out1.data[0].tolist() == [str(i - 2).encode() for i in range(16)]


def test_execution_failure_is_reported_per_request(repository: Path) -> None:
    runner = _runner(repository, "simple_string")
    a = np.array([[b"not a number"] * 16], dtype=object)
    request = InferRequest("simple_string", inputs=[_tensor("INPUT0", a, "BYTES"), _tensor("INPUT1", a, "BYTES")])
    results = runner.execute([runner.prepare(request), runner.prepare(request)])
    assert all(isinstance(r, ServingError) for r in results)
    snap = runner.stats.snapshot()
    assert snap["durations"]["fail"][0] == 2
    assert snap["execution_count"] == 0



def test_non_batching_model_runs_each_request_alone(tmp_path: Path) -> None:
    write_model(tmp_path, "fixed", None, add_sub_model(TensorProto.INT32, batch=False))
    runner = _runner(tmp_path, "fixed")
    requests = [
        InferRequest("fixed", inputs=[_tensor("INPUT0", np.full(16, i, np.int32)), _tensor("INPUT1", np.ones(16, np.int32))])
        for i in range(2)
    ]
    assert "Expected [16], got [1,16]" in _prepare_error(runner, _simple_request())
    results = runner.execute([runner.prepare(r) for r in requests])
    for i, result in enumerate(results):
        out0 = _ok(result).outputs[0]
        assert out0.shape == (16,)
        np.testing.assert_array_equal(out0.data, np.full(16, i + 1))
    assert runner.stats.snapshot()["execution_count"] == 2


def test_reshape_between_config_and_model_shapes(tmp_path: Path) -> None:
    reshaped = SIMPLE_CONFIG.replace("dims: [ 16 ] }", "dims: [ 4, 4 ] reshape { shape: [ 16 ] } }")
    write_model(tmp_path, "simple", reshaped, add_sub_model(TensorProto.INT32))
    runner = _runner(tmp_path, "simple")
    a = np.arange(32, dtype=np.int32).reshape(2, 4, 4)
    request = InferRequest("simple", inputs=[_tensor("INPUT0", a), _tensor("INPUT1", a)])
    (result,) = runner.execute([runner.prepare(request)])
    out0, out1 = _ok(result).outputs
    assert out0.shape == (2, 4, 4)
    np.testing.assert_array_equal(out0.data, a * 2)
    np.testing.assert_array_equal(out1.data, np.zeros_like(a))
