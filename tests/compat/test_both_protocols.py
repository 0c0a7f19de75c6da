"""The same behaviour over both protocols: one test body, run with tritonclient.http and with
tritonclient.grpc against the same server."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import tensor
from rayinfer.protocol.errors import Code, grpc_status_name, http_status

A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)


def inputs(module, a: np.ndarray, b: np.ndarray) -> list:
    tensors = [module.InferInput("INPUT0", list(a.shape), "INT32"), module.InferInput("INPUT1", list(b.shape), "INT32")]
    tensors[0].set_data_from_numpy(a)
    tensors[1].set_data_from_numpy(b)
    return tensors


def test_health_and_model_readiness(proto):
    _, client = proto
    assert client.is_server_live() and not client.is_server_ready()  # broken models: strict readiness
    assert client.is_model_ready("simple") and client.is_model_ready("versioned", "1")
    assert not client.is_model_ready("broken_config") and not client.is_model_ready("no_such_model")


def test_metadata(proto):
    module, client = proto
    kwargs = {"as_json": True} if module is grpcclient else {}
    meta = client.get_model_metadata("versioned", "2", **kwargs)
    assert meta["name"] == "versioned" and meta["versions"] == ["1", "2"]
    assert [int(d) for d in meta["inputs"][0]["shape"]] == [-1, 16]


def test_infer_every_version(proto):
    module, client = proto
    for version, expected in (("1", A + B), ("2", A * B), ("", A * B)):
        result = client.infer("versioned", inputs(module, A, B), model_version=version, request_id=f"v{version}")
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), expected)


def test_an_output_requested_twice_is_refused(proto, server):
    """As Triton's current release does (qa/L0_http/http_test.py test_duplicate_output_names):
    400 / INVALID_ARGUMENT naming the output, and the server goes on (2.51 answered it once)."""
    module, client = proto
    outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT0")]
    with pytest.raises(InferenceServerException) as info:
        client.infer("simple", inputs(module, A, B), outputs=outputs)
    assert "Duplicate output name 'OUTPUT0' is not allowed in a request" in info.value.message()
    assert info.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    assert client.is_server_live()
    result = client.infer("simple", inputs(module, A, B), outputs=[module.InferRequestedOutput("OUTPUT0")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)


def bf16_inputs(module) -> list:
    try:  # tritonclient takes BF16 arrays as ml_dtypes.bfloat16 (older releases: FP32, truncated)
        from ml_dtypes import bfloat16 as dtype
    except ImportError:
        dtype = np.float32
    tensors = [module.InferInput(name, [1, 16], "BF16") for name in ("INPUT0", "INPUT1")]
    for tensor in tensors:
        tensor.set_data_from_numpy(np.ones((1, 16), dtype))
    return tensors


# Every code the session server answers a request with, through both front-ends: the status each
# protocol reports is the one protocol/errors.py's tables give. Not here: UNAVAILABLE (the load
# API in poll mode, tests/integration/test_poll_mode.py); ALREADY_EXISTS, CANCELLED and UNKNOWN,
# which the server never raises.
@pytest.mark.parametrize("call, code, message", [
    (lambda m, c: c.infer("no_such_model", inputs(m, A, B)), Code.NOT_FOUND,
     "Request for unknown model: 'no_such_model' is not found"),
    (lambda m, c: c.infer("simple", inputs(m, A[:, :8], B[:, :8])), Code.INVALID_ARG,
     "unexpected shape for input 'INPUT0' for model 'simple'"),
    (lambda m, c: c.infer("simple", inputs(m, np.zeros((9, 16), np.int32), np.zeros((9, 16), np.int32))),
     Code.INVALID_ARG, "inference request batch-size must be <= 8 for 'simple'"),
    (lambda m, c: c.infer("simple", bf16_inputs(m)), Code.INVALID_ARG,
     "inference input 'INPUT0' data-type is 'BF16', but model 'simple' expects 'INT32'"),
    (lambda m, c: c.infer("py_repeat", [tensor(m, "IN", np.array([1], np.int32), "INT32")]), Code.UNSUPPORTED,
     "doesn't support models with decoupled transaction policy"),
    (lambda m, c: c.load_model("no_such_model"), Code.INTERNAL,
     "failed to load 'no_such_model', failed to poll from model repository"),
], ids=["unknown-model", "shape", "batch", "bf16", "decoupled-unary", "load-unknown-model"])
def test_errors_name_the_problem(proto, call, code, message):
    module, client = proto
    with pytest.raises(InferenceServerException) as info:
        call(module, client)
    assert message in info.value.message()
    expected = str(http_status(code)) if module is httpclient else f"StatusCode.{grpc_status_name(code)}"
    assert info.value.status() == expected


def test_statistics_count_exactly(proto, server):
    module, client = proto
    kwargs = {"as_json": True} if module is grpcclient else {}
    url = server["url"] if module is httpclient else server["grpc_url"]

    def success() -> int:
        stats = client.get_inference_statistics("preferred", "1", **kwargs)["model_stats"][0]
        return int(stats["inference_stats"]["success"].get("count", 0))

    def one(_: int) -> None:  # a client each: together they make the model's preferred batch of 4
        caller = module.InferenceServerClient(url)
        caller.infer("preferred", inputs(module, A, B))
        caller.close()

    before = success()
    with ThreadPoolExecutor(4) as pool:  # one at a time, each would wait out the 5 s queue delay
        list(pool.map(one, range(4)))
    assert success() - before == 4
