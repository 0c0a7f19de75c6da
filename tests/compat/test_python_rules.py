"""Rules of Triton's Python backend that real models rely on, through unmodified tritonclient:
models without inputs, readiness from the model, the response sender of a non-decoupled model,
response parameters, BF16 tensors, a decoupled model's async executions overlapping, the empty
final response, BLS cancellation and models loaded from a request's files
(tests/python_rules_models.py)."""

from __future__ import annotations

import json
import queue
import threading

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import http_json, tensor
from waiting import wait_until


def _words(result) -> list[str]:
    return [w.decode() for w in result.as_numpy("OUT")]


def _mode(proto, mode: str, model: str = "py_rules"):
    module, client = proto
    return client.infer(model, [], parameters={"mode": mode})


def _stream(server: dict, requests: list[tuple[list, dict]], count: int, model: str = "py_rules_decoupled",
            empty_final: bool = False) -> list:
    """``count`` (result, error) answers of one stream carrying ``requests`` ((inputs, parameters) each)."""
    client = grpcclient.InferenceServerClient(server["grpc_url"])
    received: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    try:
        for inputs, parameters in requests:
            client.async_stream_infer(model, inputs, parameters=parameters, enable_empty_final_response=empty_final)
        answers = [received.get(timeout=60) for _ in range(count)]
    finally:
        client.stop_stream()
        client.close()
    assert received.empty(), f"more than the {count} answers {answers}: {received.get()}"
    return answers


def _errors(server: dict) -> list[str]:
    ((result, error),) = _stream(server, [([], {"mode": "errors"})], 1)
    assert error is None
    return _words(result)


def test_a_model_without_inputs_serves_requests_without_inputs(proto):
    module, client = proto
    metadata = client.get_model_metadata("py_rules")
    assert (metadata["inputs"] if module is httpclient else list(metadata.inputs)) == []
    assert _words(_mode(proto, "")) == ["no inputs", "0"]


def test_a_model_using_the_logger_level_constants_loads(proto):
    """py_rules' initialize checks Logger.INFO ... Logger.VERBOSE and logs with one."""
    module, client = proto
    assert client.is_model_ready("py_rules")


def test_a_request_without_inputs_reaches_a_model_whose_inputs_are_all_optional(server):
    ((result, error),) = _stream(server, [([], {})], 1)
    assert error is None and _words(result) == ["inputs", "0"]


def test_readiness_follows_the_models_is_ready(proto, model_repository):
    """True: ready; False, an exception or a value that is not a bool: not ready, while
    inference goes on; sync and async is_ready alike."""
    module, client = proto
    answer = model_repository / "py_rules" / "ready_answer"
    try:
        for text, ready in (("true", True), ("false", False), ("raise", False), ("maybe", False), ("true", True)):
            answer.write_text(text)
            assert client.is_model_ready("py_rules") is ready, text
            assert _words(_mode(proto, "")) == ["no inputs", "0"]
    finally:
        answer.unlink(missing_ok=True)
    marker = model_repository / "py_ready_async" / "not_ready"
    assert client.is_model_ready("py_ready_async")
    marker.write_text("")
    try:
        assert not client.is_model_ready("py_ready_async")
        x = np.array([3], dtype=np.int32)
        assert client.infer("py_ready_async", [tensor(module, "IN", x, "INT32")]).as_numpy("OUT").tolist() == [3]
    finally:
        marker.unlink()
    assert client.is_model_ready("py_ready_async")


def test_a_readiness_check_over_its_time_is_not_ready(server, model_repository):
    """is_ready taking 8 s: not ready after Triton's 5 s; inference is not held up meanwhile."""
    client = httpclient.InferenceServerClient(server["url"], network_timeout=60.0)
    answer = model_repository / "py_rules" / "ready_answer"
    answer.write_text("slow")
    try:
        assert not client.is_model_ready("py_rules")
        assert _words(client.infer("py_rules", [])) == ["no inputs", "0"]
    finally:
        answer.unlink()
    wait_until(lambda: client.is_model_ready("py_rules"), "py_rules to be ready again", timeout_s=30)


def test_a_non_decoupled_model_may_answer_through_its_response_sender(proto, server):
    assert _words(_mode(proto, "sender_one")) == ["sent"]
    assert _words(_mode(proto, "sender_later")) == ["sent later"]
    assert _words(_mode(proto, "sender_then_return")) == ["sent, then returned"]
    assert _words(_mode(proto, "sender_two")) == ["first"]  # the second send raised in the model
    with pytest.raises(InferenceServerException) as info:
        _mode(proto, "sender_final_first")
    assert "Unable to send response. Non-decoupled model cannot send complete final before sending a response." \
        in info.value.message()
    assert _words(_mode(proto, "errors")) == [
        "Unable to send response. Non-decoupled model cannot send more than one response."]


def test_response_parameters_take_str_int_and_bool_only(proto):
    module, client = proto
    result = _mode(proto, "parameters")
    if module is httpclient:
        assert result.get_response()["parameters"] == {"s": "x", "i": 3, "b": True}
    else:
        parameters = result.get_response().parameters
        assert (parameters["s"].string_param, parameters["i"].int64_param, parameters["b"].bool_param) == ("x", 3, True)
        assert set(parameters) == {"s", "i", "b"}
    expected = []
    for kind in ("<class 'float'>", "<class 'dict'>", "<class 'NoneType'>"):
        expected += [f"Expect parameters values to have type bool/int/str, found type {kind}"] * 2
    expected += ["Expect parameters keys to have type str, found type <class 'int'>"] * 2
    assert _words(_mode(proto, "errors")) == expected


def test_a_response_with_outputs_and_an_error_is_the_error(proto):
    with pytest.raises(InferenceServerException, match="an error beside outputs"):
        _mode(proto, "error_and_outputs")


def test_bf16_tensors_reach_the_model_through_dlpack_and_come_back(server):
    values = np.array([1.5, -2.0, 0.25], dtype=ml_dtypes.bfloat16)
    inputs = [tensor(grpcclient, "IN", values, "BF16")]
    ((result, error),) = _stream(server, [(inputs, {"mode": "bf16"})], 1)
    assert error is None and _words(result) == ["14"]  # Triton's number for BF16
    out = result.as_numpy("BF16_OUT")
    assert out.dtype == np.dtype(ml_dtypes.bfloat16) and out.astype(np.float32).tolist() == [3.0, -4.0, 0.5]
    assert _errors(server) == ["Tensor dtype is BF16 and cannot be converted to NumPy. Use to_dlpack() and "
                               "from_dlpack() instead."]


def test_bf16_over_http_travels_as_binary_data(server):
    """Over HTTP BF16 data is read in binary form (here it reaches the model's checks), and the
    JSON form is refused with Triton's message."""
    body = {"inputs": [{"name": "IN", "datatype": "BF16", "shape": [1], "data": [1.0]}]}
    assert http_json("POST", "/v2/models/py_rules/infer", body) == (400, {
        "error": "receiving BF16 data via JSON is not supported. Please use the binary data format for input"})
    x = httpclient.InferInput("IN", [2], "BF16")
    x.set_data_from_numpy(np.array([1, 2], dtype=ml_dtypes.bfloat16), binary_data=True)
    with pytest.raises(InferenceServerException, match="unexpected inference input 'IN' for model 'py_rules'"):
        httpclient.InferenceServerClient(server["url"]).infer("py_rules", [x])


def test_a_decoupled_models_async_executions_overlap(server):
    """The first request waits until the second releases it: both are answered only when the
    second runs while the first awaits, on the model's one instance (a decoupled model's
    responses are written as they come, as in Triton: the two in either order)."""
    answers = _stream(server, [([], {"mode": "wait"}), ([], {"mode": "release"})], 2)
    assert sorted((_words(r), e) for r, e in answers) == [(["released"], None), (["releasing"], None)]


def test_an_async_executes_exception_ends_its_stream_and_reaches_the_log(server):
    ((result, error),) = _stream(server, [([], {"mode": "raise"})], 1)
    assert result is None and error is not None, (result, error)
    assert "Failed to process the request(s) for model 'py_rules_decoupled', message: RuntimeError: async execute " \
        "failed on purpose" in error.message(), error.message()
    log = server["log"]
    wait_until(lambda: all(line in log.read_text() for line in (
        "Traceback (most recent call last)", "RuntimeError: async execute failed on purpose")),
        "the traceback in the server's log", timeout_s=30)


def test_a_decoupled_execute_that_returns_a_value_fails_with_tritons_message(server):
    ((result, error),) = _stream(server, [([], {"mode": "return_value"})], 1)
    assert error.message() == ("Failed to process the request(s) for model 'py_rules_decoupled_0_0', message: "
                               "Python model 'py_rules_decoupled_0_0' is using the decoupled mode and the execute "
                               "function must return None.")


def test_sending_after_the_final_flag_raises_in_the_model(server):
    assert len(_stream(server, [([], {"mode": "count", "n": 1})], 1)) == 1
    assert _errors(server) == ["Unable to send response. Response sender has been closed."]


def _final(result) -> bool | None:
    parameters = result.get_response().parameters
    return parameters["triton_final_response"].bool_param if "triton_final_response" in parameters else None


def test_enable_empty_final_response_ends_a_stream_with_an_empty_final_response(server):
    """Every response of a stream says whether it is the last (as Triton's stream does); with
    tritonclient's enable_empty_final_response, a final flag sent alone becomes an empty
    response saying so."""
    answers = _stream(server, [([], {"mode": "count", "n": 4})], 5, empty_final=True)
    assert [e for _, e in answers] == [None] * 5
    assert [_final(r) for r, _ in answers] == [False, False, False, False, True]
    assert [_words(r) for r, _ in answers[:4]] == [["0"], ["1"], ["2"], ["3"]]
    assert list(answers[4][0].get_response().outputs) == []
    answers = _stream(server, [([], {"mode": "count_final_with_last", "n": 2})], 2, empty_final=True)
    assert [_final(r) for r, _ in answers] == [False, True]
    answers = _stream(server, [([], {"mode": "count", "n": 2})], 2)
    assert [_final(r) for r, _ in answers] == [False, False]  # the final flag came alone, after them
    _errors(server)  # the "after final" attempts the count modes make


def test_a_decoupled_bls_call_is_cancelled_by_its_iterator(proto, server):
    """cancel() after the first response: the callee sees request.is_cancelled() and the
    iteration ends; cancel() again, and after the end, does nothing."""
    first, rest = _words(_mode(proto, "bls_cancel"))
    assert first == "response 0" and int(rest) < 150
    seen: list[str] = []
    wait_until(lambda: seen.extend(w for w in _errors(server) if w.startswith("cancelled after")) or seen,
               "the callee to see the cancellation", timeout_s=30)


_NEW_MODEL = '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy() + 1)]) for r in requests]
'''


def test_a_model_the_repository_does_not_have_loads_from_the_requests_files(proto):
    module, client = proto
    name = f"py_from_files_{'http' if module is httpclient else 'grpc'}"
    config = json.dumps({"name": name, "backend": "python",
                         "input": [{"name": "IN", "data_type": "TYPE_INT32", "dims": [1]}],
                         "output": [{"name": "OUT", "data_type": "TYPE_INT32", "dims": [1]}]})
    code = _NEW_MODEL.encode()
    client.load_model(name, config=config, files={"file:1/model.py": code})  # each client encodes it
    try:
        assert client.is_model_ready(name)
        x = np.array([41], dtype=np.int32)
        assert client.infer(name, [tensor(module, "IN", x, "INT32")]).as_numpy("OUT").tolist() == [42]
        index = client.get_model_repository_index()
        names = [m["name"] for m in index] if module is httpclient else [m.name for m in index.models]
        assert name in names
    finally:
        client.unload_model(name)
    for bad, message in (("a..b", "invalid model name 'a..b', model name must not contain path traversal characters"),
                         (" ", "model name must not contain only whitespace characters")):
        with pytest.raises(InferenceServerException) as info:
            client.load_model(bad, config=config, files={"file:1/model.py": code})
        assert message in info.value.message()


def test_with_triton_grpc_error_an_error_ends_the_stream_with_its_status(server):
    """The triton_grpc_error header: the first error ends the stream with its gRPC status (the
    requests after it unanswered), and the client's stop_stream returns at once."""
    client = grpcclient.InferenceServerClient(server["grpc_url"])
    received: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)),
                        headers={"triton_grpc_error": "true"})
    try:
        # A decoupled model's answers are written as they come, so an error of a later request
        # may pass them (as in Triton): the error is sent once the first answer is in.
        client.async_stream_infer("py_rules_decoupled", [])
        first = received.get(timeout=60)
        for model in ("no_such_model", "py_rules_decoupled"):
            client.async_stream_infer(model, [])
        second = received.get(timeout=60)
    finally:
        stopping = threading.Thread(target=client.stop_stream)
        stopping.start()
        stopping.join(30)
        client.close()
    assert not stopping.is_alive()
    assert first[1] is None and _words(first[0]) == ["inputs", "0"]
    assert second[0] is None and second[1].status() == "StatusCode.NOT_FOUND"
    assert "Request for unknown model: 'no_such_model' is not found" in second[1].message()
    assert received.empty()


def test_a_stream_the_client_half_closes_ends_once_its_requests_are_answered(server):
    client = grpcclient.InferenceServerClient(server["grpc_url"])
    received: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    for model in ("py_rules_decoupled", "no_such_model", "py_rules_decoupled"):
        client.async_stream_infer(model, [])
    stopping = threading.Thread(target=client.stop_stream)  # half-closes, then waits for the stream's end
    stopping.start()
    stopping.join(60)
    client.close()
    assert not stopping.is_alive()
    answers = [received.get_nowait() for _ in range(3)]
    assert sorted(e is None for _, e in answers) == [False, True, True]  # a decoupled model's come as they come
