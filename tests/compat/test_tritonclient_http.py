"""Unmodified ``tritonclient.http`` against a real rayinfer server (binary and JSON tensors)."""

from __future__ import annotations

import time

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import add_sub_inputs, http, http_json, submit_each


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server["url"], concurrency=64, network_timeout=120.0)
    yield c
    c.close()


def test_server_metadata_and_liveness(client):
    assert client.is_server_live()
    meta = client.get_server_metadata()
    assert meta["name"] == "triton"
    assert "binary_tensor_data" in meta["extensions"] and "statistics" in meta["extensions"]


def test_strict_readiness_reflects_broken_models(client):
    # The test repository holds broken models, so a strict server is live but not ready.
    assert client.is_server_live()
    assert not client.is_server_ready()


def test_model_readiness(client):
    assert client.is_model_ready("simple")
    assert client.is_model_ready("versioned", "1")
    assert not client.is_model_ready("broken_config")
    assert not client.is_model_ready("no_such_model")


def test_model_metadata_and_config(client):
    meta = client.get_model_metadata("simple")
    assert meta["name"] == "simple" and meta["versions"] == ["1"]
    assert meta["platform"] == "onnxruntime_onnx"
    assert {i["name"]: (i["datatype"], i["shape"]) for i in meta["inputs"]} == {
        "INPUT0": ("INT32", [-1, 16]), "INPUT1": ("INT32", [-1, 16])
    }
    config = client.get_model_config("simple")
    assert config["max_batch_size"] == 8
    assert [o["name"] for o in config["output"]] == ["OUTPUT0", "OUTPUT1"]
    assert config["input"][0]["dims"] == [16]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_simple(client, binary):
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=binary)]
    result = client.infer("simple", add_sub_inputs(a, b, binary), outputs=outputs, request_id="req-42")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    response = result.get_response()
    assert response["id"] == "req-42"
    assert response["model_name"] == "simple" and response["model_version"] == "1"


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_simple_string(client, binary):
    a = np.array([[str(i).encode() for i in range(16)]], dtype=object)
    b = np.array([[b"1"] * 16], dtype=object)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)]
    result = client.infer("simple_string", add_sub_inputs(a, b, binary, "BYTES"), outputs=outputs)
    assert [int(x) for x in result.as_numpy("OUTPUT0").reshape(-1)] == [i + 1 for i in range(16)]
    assert result.as_numpy("OUTPUT1") is None


def test_infer_without_requested_outputs_returns_all(client):
    a = np.ones((2, 16), dtype=np.int32)
    result = client.infer("simple", add_sub_inputs(a, a, True))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a * 0)


def test_model_without_batch_dimension(client):
    a = np.arange(16, dtype=np.int32)
    result = client.infer("nobatch", add_sub_inputs(a, a, True))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)


def test_auto_completed_config(client):
    config = client.get_model_config("autocomplete")
    assert config["max_batch_size"] == 4
    assert {i["name"] for i in config["input"]} == {"INPUT0", "INPUT1"}
    assert "dynamic_batching" in config
    a = np.ones((4, 16), dtype=np.int32)
    np.testing.assert_array_equal(client.infer("autocomplete", add_sub_inputs(a, a, True)).as_numpy("OUTPUT0"), a * 2)


def test_versions_are_routed(client):
    a = np.full((1, 16), 3, dtype=np.int32)
    b = np.full((1, 16), 4, dtype=np.int32)
    v1 = client.infer("versioned", add_sub_inputs(a, b, True), model_version="1").as_numpy("OUTPUT0")
    v2 = client.infer("versioned", add_sub_inputs(a, b, True), model_version="2").as_numpy("OUTPUT0")
    default = client.infer("versioned", add_sub_inputs(a, b, True)).as_numpy("OUTPUT0")
    assert v1[0, 0] == 7 and v2[0, 0] == 12 and default[0, 0] == 12
    assert client.get_model_metadata("versioned", "1")["versions"] == ["1", "2"]
    with pytest.raises(InferenceServerException, match="version 9 is not found"):
        client.get_model_metadata("versioned", "9")


def test_64_concurrent_requests_batch_and_stay_correct(client):
    before = client.get_inference_statistics("batched")["model_stats"][0]
    rng = np.random.default_rng(1)
    pairs = [(rng.integers(-1000, 1000, (1, 16), dtype=np.int32), rng.integers(-1000, 1000, (1, 16), dtype=np.int32))
             for _ in range(64)]
    pending = [client.async_infer("batched", add_sub_inputs(a, b, i % 2 == 0)) for i, (a, b) in enumerate(pairs)]
    for (a, b), request in zip(pairs, pending):
        result = request.get_result()
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    after = client.get_inference_statistics("batched")["model_stats"][0]
    assert after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] == 64
    assert after["inference_count"] - before["inference_count"] == 64
    assert after["execution_count"] - before["execution_count"] < 64
    assert max(int(b["batch_size"]) for b in after["batch_stats"]) > 1
    assert all(int(b["batch_size"]) <= 8 for b in after["batch_stats"])


def test_mlp_under_concurrency_matches_onnxruntime(client, model_repository):
    session = ort.InferenceSession(str(model_repository / "mlp" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(2)
    rows = [rng.standard_normal((1 + i % 3, 256), dtype=np.float32) for i in range(64)]
    pending = submit_each(client, "mlp", "INPUT0", "FP32", rows)
    for x, request in zip(rows, pending):
        expected = session.run(None, {"INPUT0": x})[0]
        np.testing.assert_allclose(request.get_result().as_numpy("OUTPUT0"), expected, rtol=1e-4, atol=1e-4)


def test_preferred_batch_size_dispatches_without_waiting_the_delay(client):
    a = np.ones((1, 16), dtype=np.int32)
    start = time.monotonic()
    pending = [client.async_infer("preferred", add_sub_inputs(a, a, True)) for _ in range(4)]
    for request in pending:
        np.testing.assert_array_equal(request.get_result().as_numpy("OUTPUT0"), a * 2)
    # The queue delay is 5 s; a preferred batch of 4 goes at once.
    assert time.monotonic() - start < 4.0
    stats = client.get_inference_statistics("preferred")["model_stats"][0]
    assert any(int(b["batch_size"]) == 4 for b in stats["batch_stats"])


def test_requests_with_different_variable_dims_are_not_merged(client):
    xs = [np.arange(n, dtype=np.float32).reshape(1, n) for n in (3, 5, 3, 5)]
    pending = submit_each(client, "vardims", "X", "FP32", xs)
    for x, request in zip(xs, pending):
        np.testing.assert_array_equal(request.get_result().as_numpy("Y"), x * 2)
    stats = client.get_inference_statistics("vardims")["model_stats"][0]
    # Equal shapes may merge (3 with 3, 5 with 5) but never 3 with 5: no batch exceeds 2 rows.
    assert stats["inference_count"] == 4
    assert all(int(b["batch_size"]) <= 2 for b in stats["batch_stats"])


def test_repository_index_reports_broken_models(client):
    index = {(m["name"], m.get("version", "")): m for m in client.get_model_repository_index()}
    assert index[("simple", "1")]["state"] == "READY"
    assert index[("versioned", "1")]["state"] == index[("versioned", "2")]["state"] == "READY"
    broken = index[("broken_config", "")]
    assert broken["state"] == "UNAVAILABLE" and "broken_config/config.pbtxt" in broken["reason"]
    assert index[("missing_file", "1")]["state"] == "UNAVAILABLE"
    assert "missing_file/1/model.onnx" in index[("missing_file", "1")]["reason"]
    assert index[("corrupt", "1")]["state"] == "UNAVAILABLE"
    assert "corrupt/1/model.onnx" in index[("corrupt", "1")]["reason"]
    plan = index[("plan_without_gpu", "1")]
    assert plan["state"] == "UNAVAILABLE"
    assert "'plan_without_gpu' is a TensorRT plan and needs a GPU, but its replica has none" in plan["reason"]


def test_repository_index_ready_filter(server):
    status, rows = http_json("POST", "/v2/repository/index", {"ready": True})
    assert status == 200
    assert rows and all(row["state"] == "READY" for row in rows)
    assert ("simple", "1") in {(row["name"], row["version"]) for row in rows}
    assert "broken_config" not in {row["name"] for row in rows}


def test_statistics_count_exactly(client):
    before = client.get_inference_statistics("simple", "1")["model_stats"][0]
    a = np.ones((1, 16), dtype=np.int32)
    for _ in range(5):
        client.infer("simple", add_sub_inputs(a, a, True))
    after = client.get_inference_statistics("simple", "1")["model_stats"][0]
    assert after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] == 5
    assert after["execution_count"] - before["execution_count"] == 5
    for key in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert after["inference_stats"][key]["count"] - before["inference_stats"][key]["count"] == 5
        assert after["inference_stats"][key]["ns"] > before["inference_stats"][key]["ns"]
    names = {(m["name"], m["version"]) for m in client.get_inference_statistics()["model_stats"]}
    assert ("simple", "1") in names and ("mlp", "1") in names


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests_and_responses(client, algorithm):
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    result = client.infer(
        "simple", add_sub_inputs(a, a, True),
        request_compression_algorithm=algorithm, response_compression_algorithm=algorithm,
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)


def test_response_is_compressed_only_when_accepted(server):
    import gzip
    import json

    body = json.dumps({"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [0] * 16}]}).encode()
    status, headers, raw = http("POST", "/v2/models/simple/infer", gzip.compress(body),
                                {"Content-Encoding": "gzip", "Accept-Encoding": "gzip"})
    assert status == 200 and headers.get("content-encoding") == "gzip"
    assert json.loads(gzip.decompress(raw))["outputs"][0]["data"] == list(range(16))
    status, headers, raw = http("POST", "/v2/models/simple/infer", body)
    assert status == 200 and "content-encoding" not in {k.lower() for k in headers}
    status, _, raw = http("POST", "/v2/models/simple/infer", b"not gzip", {"Content-Encoding": "gzip"})
    assert status == 400 and b"failed to decompress the gzip request body" in raw


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_bytes_identity_keeps_every_byte(client, binary):
    data = np.array([[b"hello", b"wor\x00ld", b"\x00\x01\x02\x03", b""]], dtype=object)
    inp = httpclient.InferInput("INPUT0", [1, 4], "BYTES")
    inp.set_data_from_numpy(data, binary_data=binary)
    out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)
    result = client.infer("simple_identity", [inp], outputs=[out])
    assert result.as_numpy("OUTPUT0").tolist() == data.tolist()
