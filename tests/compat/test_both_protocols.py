"""The same behaviour over both protocols: one test body, run with tritonclient.http and with
tritonclient.grpc against the same server."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.full((1, 16), 3, dtype=np.int32)


@pytest.fixture(scope="module", params=["http", "grpc"])
def proto(request, server):
    """(client module, client) for each protocol."""
    module = httpclient if request.param == "http" else grpcclient
    client = module.InferenceServerClient(server["url"] if request.param == "http" else server["grpc_url"])
    yield module, client
    client.close()


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


@pytest.mark.parametrize("model, make, message", [
    ("no_such_model", lambda: (A, B), "Request for unknown model: 'no_such_model' is not found"),
    ("simple", lambda: (A[:, :8], B[:, :8]), "unexpected shape for input 'INPUT0' for model 'simple'"),
    ("simple", lambda: (np.zeros((9, 16), np.int32), np.zeros((9, 16), np.int32)),
     "inference request batch-size must be <= 8 for 'simple'"),
], ids=["unknown-model", "shape", "batch"])
def test_errors_name_the_problem(proto, model, make, message):
    module, client = proto
    with pytest.raises(InferenceServerException, match=message.replace("[", "\\[")):
        client.infer(model, inputs(module, *make()))


def test_statistics_count_exactly(proto):
    module, client = proto
    kwargs = {"as_json": True} if module is grpcclient else {}

    def success() -> int:
        stats = client.get_inference_statistics("preferred", "1", **kwargs)["model_stats"][0]
        return int(stats["inference_stats"]["success"].get("count", 0))

    before = success()
    for _ in range(4):
        client.infer("preferred", inputs(module, A, B))
    assert success() - before == 4
