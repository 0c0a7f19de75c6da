"""TorchScript models (platform pytorch_libtorch) through tritonclient, HTTP and gRPC."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import tensor


def test_metadata_and_config(proto):
    module, client = proto
    kwargs = {"as_json": True} if module is grpcclient else {}
    meta = client.get_model_metadata("ts_add_sub", **kwargs)
    assert meta["platform"] == "pytorch_libtorch"
    assert [i["name"] for i in meta["inputs"]] == ["INPUT__0", "INPUT__1"]
    config = client.get_model_config("ts_named", **kwargs)
    config = config.get("config", config)
    assert config["backend"] == "pytorch" and config["platform"] == "pytorch_libtorch"


def test_positional_inputs_and_tuple_outputs(proto):
    module, client = proto
    a = np.arange(32, dtype=np.float32).reshape(2, 16)
    b = np.full((2, 16), 0.5, dtype=np.float32)
    result = client.infer("ts_add_sub", [tensor(module, "INPUT__0", a, "FP32"), tensor(module, "INPUT__1", b, "FP32")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT__1"), a - b)


def test_named_inputs_and_list_outputs(proto):
    module, client = proto
    values = np.array([[1, 2, 3, 4]], dtype=np.int64)
    scale = np.array([[7]], dtype=np.int64)
    outputs = [module.InferRequestedOutput("total")]
    result = client.infer("ts_named", [tensor(module, "values", values, "INT64"), tensor(module, "scale", scale, "INT64")],
                          outputs=outputs)
    np.testing.assert_array_equal(result.as_numpy("total"), [[10]])
    assert result.as_numpy("scaled") is None  # only the requested output comes back


def test_concurrent_requests_are_batched_and_each_gets_its_rows(proto, server):
    module, client = proto
    before = client.get_inference_statistics("ts_add_sub", **({"as_json": True} if module is grpcclient else {}))
    url = server["grpc_url"] if module is grpcclient else server["url"]

    def one(i: int):  # a client per thread: tritonclient.http's connection pool is not thread-safe
        a = np.full((1, 16), i, dtype=np.float32)
        with module.InferenceServerClient(url) as own:
            result = own.infer("ts_add_sub", [tensor(module, "INPUT__0", a, "FP32"), tensor(module, "INPUT__1", a, "FP32")])
        return i, result.as_numpy("OUTPUT__0")

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for i, out in pool.map(one, range(24)):
            np.testing.assert_array_equal(out, np.full((1, 16), 2 * i, dtype=np.float32))
    after = client.get_inference_statistics("ts_add_sub", **({"as_json": True} if module is grpcclient else {}))

    def counts(stats) -> tuple[int, int]:
        model = stats["model_stats"][0]
        return int(model["inference_count"]), int(model["execution_count"])

    inferences = counts(after)[0] - counts(before)[0]
    executions = counts(after)[1] - counts(before)[1]
    assert inferences == 24 and executions < 24  # 20 ms queue delay: concurrent requests share executions


def test_wrong_datatype_names_the_input(proto):
    module, client = proto
    a = np.ones((1, 16), dtype=np.float64)
    with pytest.raises(InferenceServerException, match="inference input 'INPUT__0' data-type is 'FP64'"):
        client.infer("ts_add_sub", [tensor(module, "INPUT__0", a, "FP64"), tensor(module, "INPUT__1", a, "FP64")])


def test_a_sequence_models_controls_and_state_are_bound_by_position(proto):
    """ts_sequence: START__1, READY__2 and the implicit state ACC_IN__3 / ACC_OUT__1 reach the
    module by position, as Triton's PyTorch backend binds them; two sequences keep their sums."""
    module, client = proto
    base = 9500 if module.__name__.endswith("http") else 9600
    sums = {base: [], base + 1: []}
    for step in range(3):
        for k, sequence_id in enumerate(sums):
            inp = module.InferInput("INPUT__0", [1, 1], "INT32")
            inp.set_data_from_numpy(np.full((1, 1), 10 * k + step + 1, np.int32))
            result = client.infer("ts_sequence", [inp], sequence_id=sequence_id, sequence_start=step == 0,
                                  sequence_end=step == 2)
            sums[sequence_id].append(int(result.as_numpy("OUTPUT__0")[0][0]))
    assert sums == {base: [1, 3, 6], base + 1: [11, 23, 36]}
