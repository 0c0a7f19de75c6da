"""pb_utils' rules, without a server: the response sender's, parameters', readiness checks'."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest

from rayinfer.adapters.python_backend import triton_python_backend_utils as pb_utils
from rayinfer.adapters.python_backend.readiness import ReadinessCheck
from waiting import wait_until

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _sender(decoupled: bool) -> tuple[pb_utils.InferenceResponseSender, list]:
    sent: list = []
    return pb_utils.InferenceResponseSender(lambda response, final: sent.append((response, final)),
                                            decoupled=decoupled), sent


def _raises(call, message: str) -> None:
    with pytest.raises(pb_utils.TritonModelException) as info:
        call()
    assert str(info.value) == message


def test_a_non_decoupled_sender_takes_one_response_and_the_final_flag() -> None:
    sender, sent = _sender(decoupled=False)
    _raises(lambda: sender.send(flags=FINAL), "Unable to send response. Non-decoupled model cannot send complete "
                                              "final before sending a response.")
    response = pb_utils.InferenceResponse([])
    sender.send(response)
    _raises(lambda: sender.send(pb_utils.InferenceResponse([])),
            "Unable to send response. Non-decoupled model cannot send more than one response.")
    sender.send(flags=FINAL)
    _raises(lambda: sender.send(flags=FINAL), "Unable to send response. Response sender has been closed.")
    assert sent == [(response, False), (None, True)]


def test_a_decoupled_sender_takes_many_until_the_final_flag() -> None:
    sender, sent = _sender(decoupled=True)
    for _ in range(3):
        sender.send(pb_utils.InferenceResponse([]))
    sender.send(pb_utils.InferenceResponse([]), flags=FINAL)
    _raises(lambda: sender.send(pb_utils.InferenceResponse([])),
            "Unable to send response. Response sender has been closed.")
    _raises(lambda: sender.send(), "Inference Response object must be provided when the response flags is set to "
                                   "zero.")
    _raises(lambda: sender.send(flags=4), "Unable to send response. Unsupported flag provided.")
    assert [final for _, final in sent] == [False, False, False, True]


@pytest.mark.parametrize("parameters, message", [
    ({"f": 1.5}, "Expect parameters values to have type bool/int/str, found type <class 'float'>"),
    ({"n": None}, "Expect parameters values to have type bool/int/str, found type <class 'NoneType'>"),
    ({"d": {"a": 1}}, "Expect parameters values to have type bool/int/str, found type <class 'dict'>"),
    ({2: "x"}, "Expect parameters keys to have type str, found type <class 'int'>"),
])
def test_parameters_take_str_keys_and_bool_int_or_str_values(parameters, message) -> None:
    _raises(lambda: pb_utils.InferenceResponse([], parameters=parameters), message)
    _raises(lambda: pb_utils.InferenceRequest(model_name="m", parameters=parameters), message)
    ok = pb_utils.InferenceResponse([], parameters={"s": "x", "i": 1, "b": False})
    assert ok.parameters() == '{"s": "x", "i": 1, "b": false}'


def test_logger_level_constants_are_on_the_logger() -> None:
    assert [pb_utils.Logger.INFO, pb_utils.Logger.WARNING, pb_utils.Logger.ERROR, pb_utils.Logger.VERBOSE] == \
        [pb_utils.Logger.LogLevel.INFO, pb_utils.Logger.LogLevel.WARNING, pb_utils.Logger.LogLevel.ERROR,
         pb_utils.Logger.LogLevel.VERBOSE]
    pb_utils.Logger.log("a line", pb_utils.Logger.WARNING)


def test_bf16_tensors_go_through_dlpack() -> None:
    torch = pytest.importorskip("torch", reason="BF16 travels through DLPack with torch (the test extra has it)")
    tensor = pb_utils.Tensor("X", np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16))
    assert tensor.triton_dtype() == 14
    _raises(tensor.as_numpy, "Tensor dtype is BF16 and cannot be converted to NumPy. Use to_dlpack() and "
                             "from_dlpack() instead.")
    doubled = torch.utils.dlpack.from_dlpack(tensor.to_dlpack()) * 2
    for source in (doubled, torch.utils.dlpack.to_dlpack(doubled)):
        back = pb_utils.Tensor.from_dlpack("Y", source)
        assert back._data.dtype == np.dtype(ml_dtypes.bfloat16) and back._data.astype(np.float32).tolist() == [3, -4]


def test_readiness_is_a_bool_answered_in_time() -> None:
    assert ReadinessCheck("m").ask(lambda: True) is True
    for answer in (lambda: False, lambda: "yes", lambda: 1 / 0):
        assert ReadinessCheck("m").ask(answer) is False
    release = threading.Event()
    calls = []

    def slow() -> bool:
        calls.append(1)
        release.wait(10)
        return True

    check = ReadinessCheck("m", timeout_s=0.05)
    assert check.ask(slow) is False and check.ask(slow) is False  # the second waits for the first
    release.set()
    assert len(calls) == 1
    wait_until(lambda: check.ask(slow), "the slow check's answer", timeout_s=10)
