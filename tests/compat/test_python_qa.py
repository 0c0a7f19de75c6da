"""Python models written as Triton's own test models are (tests/python_qa_models.py), through
unmodified tritonclient: a unittest run inside execute (pb_utils misuse, custom metrics, BLS to
models that reschedule, a large BLS tensor), a model that calls sys.exit, a batch whose
requests fail one by one, a decoupled async execute's overlapping requests on one stream, and a
decoupled BLS call its caller cancels."""

from __future__ import annotations

import concurrent.futures
import queue
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import LOAD_TIMEOUT_S
from python_qa_models import QA_MODELS
from waiting import wait_until


@pytest.fixture(scope="module")
def qa_models(server):
    """The QA models, loaded for this module and unloaded after it (all at once: the server runs
    loads and unloads of different models together)."""

    def each(action: str) -> None:
        def run(name: str) -> None:
            with httpclient.InferenceServerClient(server["url"], network_timeout=LOAD_TIMEOUT_S) as client:
                getattr(client, action)(name)

        with concurrent.futures.ThreadPoolExecutor(len(QA_MODELS)) as pool:
            list(pool.map(run, QA_MODELS))

    each("load_model")
    yield server
    each("unload_model")


def _unittest(server, tests: str = "") -> tuple[bool, str]:
    """Call qa_unittest over gRPC with no inputs (as Triton's python_unittest does)."""
    client = grpcclient.InferenceServerClient(server["grpc_url"])
    try:
        result = client.infer("qa_unittest", [], parameters={"tests": tests} if tests else None,
                              client_timeout=240)
    finally:
        client.close()
    return bool(result.as_numpy("OUTPUT0")[0]), result.as_numpy("REPORT")[0].decode()


def test_pb_utils_arguments_are_checked_as_tritons_bindings_check_them(qa_models):
    passed, report = _unittest(qa_models, "ArgumentValidation")
    assert passed, report


def test_custom_metrics_follow_tritons_rules_and_reach_the_metrics_port(qa_models):
    passed, report = _unittest(qa_models, "CustomMetrics")
    assert passed, report

    def shown() -> bool:  # a replica reports its model's metrics every half second
        with urllib.request.urlopen(qa_models["metrics_url"], timeout=10) as response:
            text = response.read().decode()
        return all(line in text for line in (
            'qa_metric_0{example1="label1"} 2023', 'qa_metric_1{example1="label1"} 999.9',
            'qa_histogram_count{example1="label1"} 3', 'qa_histogram_bucket{example1="label1",le="2.5"} 2',
            "# HELP qa_same_name first description", 'qa_same_name{k="v"} 8.5'))

    wait_until(shown, "the model's metrics on the metrics port", timeout_s=10)


def test_bls_to_models_that_reschedule_and_with_a_large_tensor(qa_models):
    passed, report = _unittest(qa_models, "BlsCalls")
    assert passed, report


def test_a_model_calling_sys_exit_gets_an_error_and_its_replica_serves_on(qa_models):
    client = grpcclient.InferenceServerClient(qa_models["grpc_url"])
    try:
        with pytest.raises(InferenceServerException) as caught:
            client.infer("qa_unittest", [], parameters={"exit": 3}, client_timeout=60)
        assert "SystemExit: 3" in caught.value.message()
        result = client.infer("qa_unittest", [], parameters={"tests": "ArgumentValidation.test_log_args"},
                              client_timeout=60)
        assert result.as_numpy("OUTPUT0")[0] == 1
    finally:
        client.close()


def _stream(server, model: str, requests: list[tuple[list, str]], count: int, timeout_s: float = 60) -> list:
    """(seconds since the first request, result, error) of ``count`` answers of one stream."""
    client = grpcclient.InferenceServerClient(server["grpc_url"])
    received: queue.Queue = queue.Queue()
    start = time.monotonic()
    client.start_stream(callback=lambda result, error: received.put((time.monotonic() - start, result, error)))
    try:
        for inputs, request_id in requests:
            if inputs is None:  # a pause between requests: the scenario itself (Triton's async_execute
                time.sleep(float(request_id))  # test sends its short request 2 s after the long one)
                continue
            client.async_stream_infer(model, inputs, request_id=request_id)
        return [received.get(timeout=timeout_s) for _ in range(count)]
    finally:
        client.stop_stream()
        client.close()


def _input(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def test_each_request_of_a_batch_gets_its_own_answer(qa_models):
    """Requests 0 and 2 of the batch fail; request 1 gets its output (Triton's test_batch_error)."""
    requests = [([_input("IN", np.full((1, 2), i, np.float32), "FP32")], str(i)) for i in range(3)]
    answers = _stream(qa_models, "qa_batch_error", requests, 3)
    errors = [str(error) for _, _, error in answers if error is not None]
    results = [result for _, result, error in answers if error is None]
    assert len(errors) == 2 and all("An error occurred during execution" in e for e in errors)
    assert len(results) == 1 and results[0].as_numpy("OUT").shape == (1, 2)


def test_an_async_decoupled_execute_answers_a_short_request_before_a_long_one(qa_models):
    """One stream: a 10 s request, then 2 s later a 2 s one; the short one's answer comes first
    (its execution overlaps the long one's, and a decoupled model's answers are written as they
    come), as in Triton's async_execute test."""
    requests = [([_input("WAIT_SECONDS", np.array([[10]], np.float32), "FP32")], "long"), (None, "2"),
                ([_input("WAIT_SECONDS", np.array([[2], [2]], np.float32), "FP32")], "short")]
    answers = _stream(qa_models, "qa_async_decoupled", requests, 2)
    assert [error for _, _, error in answers] == [None, None]
    (first_at, first, _), (second_at, second, _) = answers
    assert first.as_numpy("DUMMY_OUT").shape[0] == 2 and first_at < 8, answers
    assert second.as_numpy("DUMMY_OUT").shape[0] == 1 and second_at >= 10


def _bls_cancel(server, max_sum: int, ignore_cancel: bool) -> tuple[int, bool]:
    client = httpclient.InferenceServerClient(server["url"], network_timeout=60)
    try:
        inputs = [httpclient.InferInput("MAX_SUM", [1], "INT32"), httpclient.InferInput("IGNORE_CANCEL", [1], "BOOL")]
        inputs[0].set_data_from_numpy(np.array([max_sum], np.int32))
        inputs[1].set_data_from_numpy(np.array([ignore_cancel]))
        result = client.infer("qa_bls_cancel", inputs)
    finally:
        client.close()
    return int(result.as_numpy("SUM")[0]), bool(result.as_numpy("IS_CANCELLED")[0])


def test_a_cancelled_decoupled_bls_call_ends_with_a_cancelled_response(qa_models):
    """cancel() once the sum reaches 10: the iteration's next response is CANCELLED and nothing
    more comes (also when the callee ignores the cancellation: rayinfer cancels the call itself,
    docs/migrating.md); cancel() after the end, or when the call completed, does nothing."""
    assert _bls_cancel(qa_models, 10, False) == (10, True)
    assert _bls_cancel(qa_models, 10, True) == (10, True)
    assert _bls_cancel(qa_models, 200, False) == (20, False)  # completed: the sum never reached 200


def test_async_decoupled_bls_calls_overlap_and_end_with_the_final_response(qa_models):
    """Four 2 s requests on one stream, each a decoupled BLS call whose model sends its response
    with the final flag: the four run together (Triton's concurrent BLS test), and each call's
    iteration gives that one response (no empty one after it)."""
    requests = [([_input("WAIT_SECONDS", np.array([[2]], np.float32), "FP32")], str(i)) for i in range(4)]
    answers = _stream(qa_models, "qa_async_decoupled_bls", requests, 4)
    assert [error for _, _, error in answers] == [None] * 4
    assert [result.as_numpy("DUMMY_OUT").tolist() for _, result, _ in answers] == [[[1.0]]] * 4
    assert max(at for at, _, _ in answers) < 6, answers  # one after another would take 8 s


def test_a_model_whose_is_model_ready_says_false_is_known_and_not_ready(qa_models):
    for client in (httpclient.InferenceServerClient(qa_models["url"]),
                   grpcclient.InferenceServerClient(qa_models["grpc_url"])):
        try:
            assert client.is_model_ready("qa_is_model_ready") is False
            metadata = client.get_model_metadata("qa_is_model_ready")
            assert (metadata["name"] if isinstance(metadata, dict) else metadata.name) == "qa_is_model_ready"
            module = httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient
            x = np.arange(8, dtype=np.float32).reshape(1, 8)
            tensor = module.InferInput("INPUT0", [1, 8], "FP32")
            tensor.set_data_from_numpy(x)
            assert client.infer("qa_is_model_ready", [tensor]).as_numpy("OUTPUT0").tolist() == x.tolist()
        finally:
            client.close()
