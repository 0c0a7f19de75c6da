"""Python models calling models (BLS), calling themselves, controlling models, and seeing the
client cancel (the models are in tests/python_bls_models.py and tests/python_models.py)."""

from __future__ import annotations

import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import metric_value, tensor
from model_factory import on_demand
from stream_answers import stream_answers
from waiting import wait_until


def bls_inputs(module, a: np.ndarray, b: np.ndarray, model: str) -> list:
    return [tensor(module, "INPUT0", a, "INT32"), tensor(module, "INPUT1", b, "INT32"),
            tensor(module, "MODEL_NAME", np.array([model.encode()], dtype=object), "BYTES")]


def test_bls_calls_another_model_and_carries_its_errors(proto):
    """exec() reaches an ONNX model through its own batcher; an unknown model and a request the
    target refuses come back as errors in the response, naming what was wrong."""
    module, client = proto
    a, b = np.arange(16, dtype=np.int32), np.full(16, 3, dtype=np.int32)
    kwargs = {"as_json": True} if module is grpcclient else {}

    def count() -> int:
        stats = client.get_inference_statistics("nobatch", **kwargs)["model_stats"][0]
        return int(stats.get("inference_count", 0))

    before = count()
    result = client.infer("py_bls", bls_inputs(module, a, b, "nobatch"))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert count() == before + 1  # the target counted the BLS request as its own
    with pytest.raises(InferenceServerException, match="nope"):
        client.infer("py_bls", bls_inputs(module, a, b, "nope"))
    with pytest.raises(InferenceServerException, match="py_add_sub"):  # INT32 [16] for FP32 [4]
        client.infer("py_bls", bls_inputs(module, a, b, "py_add_sub"))


def test_async_exec_sends_two_requests_at_once(proto):
    module, client = proto
    a = np.array([1, 2, 3, 4], dtype=np.float32)
    b = np.array([10, 20, 30, 40], dtype=np.float32)
    result = client.infer("py_bls_async", [tensor(module, "INPUT0", a, "FP32"), tensor(module, "INPUT1", b, "FP32")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), b - a)


@pytest.mark.parametrize("use_async", [False, True], ids=["exec", "async_exec"])
def test_bls_streams_a_decoupled_model(proto, use_async):
    module, client = proto
    values = np.array([4, 2, 7], dtype=np.int32)
    parameters = {"async": True} if use_async else None
    result = client.infer("py_bls_stream", [tensor(module, "IN", values, "INT32")], parameters=parameters)
    assert int(result.as_numpy("SUM")[0]) == 13 and int(result.as_numpy("COUNT")[0]) == 3


def test_a_model_calling_itself_does_not_deadlock(server):
    """Each level is a BLS call to the same model, which has one replica and dynamic batching;
    concurrent requests share executions."""
    client = httpclient.InferenceServerClient(server["url"], concurrency=4, network_timeout=60.0)
    depths = [0, 1, 3, 5]
    pending = [client.async_infer("py_bls_self", [tensor(httpclient, "DEPTH", np.array([[d]], dtype=np.int32),
                                                          "INT32")]) for d in depths]
    totals = [int(p.get_result(timeout=60).as_numpy("TOTAL")[0, 0]) for p in pending]
    assert totals == [d * (d + 1) // 2 for d in depths]


def control(client, action: str, model: str) -> bool:
    result = client.infer("py_control", [
        tensor(httpclient, "ACTION", np.array([action.encode()], dtype=object), "BYTES"),
        tensor(httpclient, "MODEL", np.array([model.encode()], dtype=object), "BYTES"),
    ])
    return bool(result.as_numpy("READY")[0])


def test_a_model_loads_and_unloads_models(server):
    client = httpclient.InferenceServerClient(server["url"], network_timeout=300.0)
    model = on_demand("bls_control")
    assert control(client, "ready", model) is False
    try:
        assert control(client, "load", model) is True
        # Serve's HTTP routes may take a moment longer than the model's own readiness.
        wait_until(lambda: client.is_model_ready(model), f"'{model}' to be ready over HTTP", timeout_s=15)
        assert control(client, "unload", model) is False
        wait_until(lambda: not client.is_model_ready(model), f"'{model}' to be unready over HTTP", timeout_s=15)
    finally:
        client.unload_model(model)
    with pytest.raises(InferenceServerException, match="no_such_model"):
        control(client, "load", "no_such_model")


def test_client_cancellation_reaches_is_cancelled(server):
    """The client cancels a decoupled request mid-stream; the model sees is_cancelled() and
    counts it in its own metric."""
    counter = 'py_cancel_cancelled{model="py_cancel"}'
    before = metric_value(server, counter)  # other tests of the session cancel py_cancel's requests too
    client = grpcclient.InferenceServerClient(server["grpc_url"])
    received: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    try:
        client.async_stream_infer("py_cancel", [tensor(grpcclient, "IN", np.array([1], dtype=np.int32), "INT32")])
        ((first, error),) = stream_answers(received, 1, server)
        assert error is None and int(first.as_numpy("OUT")[0]) == 1
    finally:
        client.stop_stream(cancel_requests=True)

    wait_until(lambda: metric_value(server, counter) >= before + 1, "py_cancel to count one more cancelled request", timeout_s=30)


def test_many_clients_through_bls_at_once(server):
    """BLS under concurrent load: every answer is its own request's."""
    client = httpclient.InferenceServerClient(server["url"], concurrency=8)
    arrays = [np.full(16, i, dtype=np.int32) for i in range(24)]
    pending = [client.async_infer("py_bls", bls_inputs(httpclient, x, x, "nobatch")) for x in arrays]
    results = [p.get_result(timeout=60) for p in pending]
    for x, result in zip(arrays, results):
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x + x)
