"""Triton's Python backend: unmodified model.py files served to tritonclient over both protocols
(the models are in tests/python_models.py)."""

from __future__ import annotations

import json
import queue
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import tensor
from python_models import ANCHOR_MODELS
from stream_answers import stream_answers
from waiting import wait_until

needs_anchors = pytest.mark.skipif(not ANCHOR_MODELS.is_dir(), reason="needs ../shared/anchors beside the checkout")


def test_add_sub_with_a_helper_module(proto):
    module, client = proto
    a = np.array([1, 2, 3, 4], dtype=np.float32)
    b = np.array([1, 1, 1, 1], dtype=np.float32)
    result = client.infer("py_add_sub", [tensor(module, "INPUT0", a, "FP32"), tensor(module, "INPUT1", b, "FP32")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    params = result.get_response()["parameters"] if module is httpclient else \
        {k: v.string_param for k, v in result.get_response().parameters.items()}
    assert params == {"instance": "py_add_sub_0_0"}  # initialize's args reached the model


def test_auto_complete_config_completes_the_config(proto):
    module, client = proto
    kwargs = {"as_json": True} if module is grpcclient else {}
    config = client.get_model_config("py_auto_complete", **kwargs)
    config = config["config"] if module is grpcclient else config
    assert int(config["max_batch_size"]) == 8 and "dynamic_batching" in config
    assert [t["name"] for t in config["input"]] == ["INPUT0"]
    x = np.ones((3, 4), dtype=np.float32)
    np.testing.assert_array_equal(client.infer("py_auto_complete", [tensor(module, "INPUT0", x, "FP32")])
                                  .as_numpy("OUTPUT0"), x * 2)


def test_an_error_response_fails_only_its_request_and_an_exception_its_batch(server):
    """Concurrent requests share one execution (200 ms queue delay): the error response answers
    only its request, an exception in execute fails every request of its execution, and the
    model keeps serving."""
    client = httpclient.InferenceServerClient(server["url"], concurrency=4)
    values = [5, -1, 7]

    def submit(v):
        return client.async_infer("py_errors", [tensor(httpclient, "INPUT0", np.array([[v]], dtype=np.int32), "INT32")])

    pending = [submit(v) for v in values]
    good, bad, other = pending
    assert good.get_result().as_numpy("OUTPUT0")[0, 0] == 5
    with pytest.raises(InferenceServerException, match="negative input") as error:
        bad.get_result()
    assert error.value.status() == "400"
    assert other.get_result().as_numpy("OUTPUT0")[0, 0] == 7
    for request in [submit(v) for v in (0, 3)]:  # one execution: both fail with the exception
        with pytest.raises(InferenceServerException, match="zero is not allowed"):
            request.get_result()
    assert submit(9).get_result().as_numpy("OUTPUT0")[0, 0] == 9  # still serving


def test_initialize_failing_makes_the_model_unavailable_with_its_message(server):
    client = httpclient.InferenceServerClient(server["url"], network_timeout=300.0)
    try:
        with pytest.raises(InferenceServerException, match="the weights are missing"):
            client.load_model("py_init_fail")
        row = next(r for r in client.get_model_repository_index() if r["name"] == "py_init_fail")
        assert row["state"] == "UNAVAILABLE" and "the weights are missing" in row["reason"]
        assert not client.is_model_ready("py_init_fail")
    finally:
        client.unload_model("py_init_fail")


def test_bytes_parameters_model_dir_and_async_execute(proto):
    module, client = proto
    text = np.array([[b"hello", b"w\xc3\xb6rld"]], dtype=object)
    result = client.infer("py_strings", [tensor(module, "TEXT", text, "BYTES")], parameters={"tone": "loud"})
    assert result.as_numpy("UPPER").tolist() == [[b"HELLO!", "WÖRLD!".encode()]]
    seen = json.loads(result.as_numpy("SEEN")[0, 0])
    assert seen["parameters"] == {"tone": "loud"}
    assert seen["model_dir"] == "py_strings"
    assert sorted(seen["outputs"]) == ["SEEN", "UPPER"]


def test_wrong_input_is_refused_before_the_model(proto):
    module, client = proto
    with pytest.raises(InferenceServerException, match="py_add_sub"):
        client.infer("py_add_sub", [tensor(module, "INPUT0", np.ones(4, dtype=np.int32), "INT32"),
                                    tensor(module, "INPUT1", np.ones(4, dtype=np.float32), "FP32")])


def test_a_decoupled_model_streams_zero_to_many_responses_over_grpc(server):
    """Triton's repeat example: one response per element, in order; a decoupled model's
    responses are written as they come, so the non-decoupled model answering on the same stream
    may come between them; unary calls are refused."""
    client = grpcclient.InferenceServerClient(server["grpc_url"])
    received: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    try:
        for values in ([4, 2, 7], [], [9]):
            client.async_stream_infer("py_repeat", [tensor(grpcclient, "IN", np.array(values, dtype=np.int32), "INT32")])
        x = np.ones((1, 4), dtype=np.float32)
        client.async_stream_infer("py_auto_complete", [tensor(grpcclient, "INPUT0", x, "FP32")])
        answers = stream_answers(received, 5, server)
    finally:
        client.stop_stream()
    assert [error for _, error in answers] == [None] * 5
    repeats = [(int(r.as_numpy("OUT")[0]), int(r.as_numpy("IDX")[0])) for r, _ in answers if r.as_numpy("OUT") is not None]
    assert sorted(repeats) == [(2, 1), (4, 0), (7, 2), (9, 0)]
    assert [value for value, _ in repeats if value != 9] == [4, 2, 7]  # one request's, in order
    (doubled,) = [r for r, _ in answers if r.as_numpy("OUTPUT0") is not None]
    np.testing.assert_array_equal(doubled.as_numpy("OUTPUT0"), x * 2)
    assert received.empty()
    with pytest.raises(InferenceServerException, match="doesn't support models with decoupled transaction policy"):
        client.infer("py_repeat", [tensor(grpcclient, "IN", np.array([1], dtype=np.int32), "INT32")])
    http_client = httpclient.InferenceServerClient(server["url"])
    with pytest.raises(InferenceServerException, match="HTTP end point doesn't support models with decoupled"):
        http_client.infer("py_repeat", [tensor(httpclient, "IN", np.array([1], dtype=np.int32), "INT32")])


def test_custom_metrics_reach_the_metrics_port(server):
    client = httpclient.InferenceServerClient(server["url"])
    for value in (0.5, 4.0, 20.0):
        client.infer("py_metrics", [tensor(httpclient, "INPUT0", np.array([[value]], dtype=np.float32), "FP32")])
    labels = '{model="py_metrics",version="1"}'

    def scraped() -> str | None:
        with urllib.request.urlopen(server["metrics_url"], timeout=10) as response:
            text = response.read().decode()
        return text if f"py_metrics_requests{labels} 3" in text.splitlines() else None

    lines = wait_until(scraped, "py_metrics_requests to reach 3 on the metrics port", timeout_s=30).splitlines()
    assert "# TYPE py_metrics_requests counter" in lines
    assert f"py_metrics_last_input{labels} 20" in lines
    assert 'py_metrics_inputs_bucket{model="py_metrics",version="1",le="10"} 2' in lines
    assert f"py_metrics_inputs_count{labels} 3" in lines
    assert any(line.startswith('nv_inference_count{model="py_metrics"') for line in lines)


@needs_anchors
def test_the_anchor_models_serve_unmodified(proto):
    module, client = proto
    x = np.random.default_rng(0).random((3, 16), dtype=np.float32)
    np.testing.assert_array_equal(client.infer("identity_fp32", [tensor(module, "INPUT0", x, "FP32")])
                                  .as_numpy("OUTPUT0"), x)
    y = client.infer("mlp_onnx", [tensor(module, "INPUT0", np.ones((2, 256), dtype=np.float32), "FP32")])
    assert y.as_numpy("OUTPUT0").shape == (2, 10)


def test_a_models_own_packages_from_requirements_txt_and_execution_env_path(proto):
    """py_env_pip imports a wheel its requirements.txt names (its replica runs in a Ray pip
    environment), py_env_tarball a module from its EXECUTION_ENV_PATH tarball."""
    module, client = proto
    for model, value in (("py_env_pip", 7), ("py_env_tarball", 5)):
        result = client.infer(model, [tensor(module, "IN", np.array([1], dtype=np.int32), "INT32")])
        assert int(result.as_numpy("OUT")[0]) == 1 + value


def test_the_models_is_ready_answers_model_readiness(proto, model_repository):
    module, client = proto
    marker = model_repository / "py_ready" / "not_ready"
    assert client.is_model_ready("py_ready")
    marker.write_text("")
    try:
        assert not client.is_model_ready("py_ready")
    finally:
        marker.unlink()
    assert client.is_model_ready("py_ready")


def test_a_requirement_pip_cannot_install_fails_only_its_model(server):
    """The model's Ray environment cannot be built: the load fails with pip's reason, and the
    other models keep serving."""
    client = httpclient.InferenceServerClient(server["url"], network_timeout=600.0)
    try:
        with pytest.raises(InferenceServerException) as failure:
            client.load_model("py_env_broken")
        reason = "pip could not install the model's requirements: No matching distribution found for " \
                 "rayinfer-no-such-package==9.9"
        assert "failed to load 'py_env_broken'" in str(failure.value) and reason in str(failure.value)
        row = next(r for r in client.get_model_repository_index() if r["name"] == "py_env_broken")
        assert row["state"] == "UNAVAILABLE" and row["reason"] == reason
    finally:
        client.unload_model("py_env_broken")
    x = np.ones(4, dtype=np.float32)
    assert client.infer("py_add_sub", [tensor(httpclient, "INPUT0", x, "FP32"), tensor(httpclient, "INPUT1", x, "FP32")])
