"""The generate extension's mapping of a flat JSON object to an infer request and of a response
back, by Triton's rules."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rayinfer.protocol.errors import InvalidArgError
from rayinfer.protocol.generate_codec import error_event, event, generate_answer, generate_request
from rayinfer.protocol.types import InferOutput, InferResponse

INPUTS = [("text_input", "BYTES", [1]), ("max_tokens", "INT32", [1]), ("ids", "INT64", [-1]), ("grid", "FP32", [2, -1])]


def _request(doc, batched=True, inputs=INPUTS):
    return generate_request(json.dumps(doc).encode(), "llm", "", inputs, batched)


def test_members_named_after_inputs_are_tensors_shaped_by_the_inputs_dims():
    request = _request({"text_input": "hi", "max_tokens": 8, "ids": [1, 2, 3], "grid": [1, 2, 3, 4]})
    tensors = {t.name: t for t in request.inputs}
    assert tensors["text_input"].shape == (1, 1) and tensors["text_input"].data.tolist() == [[b"hi"]]
    assert tensors["max_tokens"].shape == (1, 1) and tensors["max_tokens"].data.dtype == np.int32
    assert tensors["ids"].shape == (1, 3)  # the batch dimension 1, the variable one the rest
    assert tensors["grid"].shape == (1, 2, 2) and tensors["grid"].data.tolist() == [[[1, 2], [3, 4]]]
    # Without a batch dimension the dims are the shape.
    request = _request({"ids": [5, 6]}, batched=False)
    assert request.inputs[0].shape == (2,)


def test_other_members_and_those_of_parameters_are_request_parameters():
    request = _request({"text_input": "x", "stream": False, "id": "r1",
                        "parameters": {"temperature": 0.5, "max_tokens": 4, "tag": "a"}})
    assert request.id == "r1"
    assert request.parameters == {"stream": False, "temperature": 0.5, "tag": "a"}
    assert {t.name for t in request.inputs} == {"text_input", "max_tokens"}  # max_tokens: an input by name


@pytest.mark.parametrize("doc,message", [
    ({"grid": [1, 2, 3]}, "The schema can not convert input 'grid' to tensor with proper shape"),
    ({"max_tokens": "eight"}, "input 'max_tokens'"),
    ({"extra": {"a": 1}}, "parameter 'extra' has invalid type"),
    ({"parameters": [1]}, "Expected JSON object for keyword: 'parameters'"),
    ({"parameters": {"bad": [1]}}, "Converting keyword: 'parameters': parameter 'bad' has invalid type"),
    ({"id": 3}, "Unable to parse 'id'"),
])
def test_members_that_do_not_map_are_refused_naming_them(doc, message):
    with pytest.raises(InvalidArgError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _request(doc)


def test_an_input_named_parameters_is_refused_and_a_member_given_twice_too():
    with pytest.raises(InvalidArgError, match="Keyword 'parameters' for nested schema also given as input tensor name"):
        _request({}, inputs=[("parameters", "INT32", [1])])
    with pytest.raises(InvalidArgError, match="input 'max_tokens' already exists in request"):
        _request({"max_tokens": 1, "parameters": {"max_tokens": 2}})


def test_an_answer_is_one_flat_object_and_an_event_its_sse_frame():
    response = InferResponse("llm", "2", [
        InferOutput("text_output", "BYTES", (1, 1), np.array([[b"hello"]], dtype=object)),
        InferOutput("logprobs", "FP32", (1, 2), np.array([[0.5, 0.25]], dtype=np.float32)),
    ], id="r1", parameters={"finish_reason": "stop", "triton_final_response": True})
    answer = generate_answer(response)
    assert answer == {"text_output": "hello", "logprobs": [0.5, 0.25], "finish_reason": "stop",
                      "model_name": "llm", "model_version": "2", "id": "r1"}
    assert event({"a": 1}) == b'data: {"a":1}\n\n'
    assert error_event("boom") == b'data: {"error":"boom"}\n\n'
    empty = InferResponse("llm", "1", [InferOutput("x", "INT32", (0,), np.zeros(0, np.int32))])
    with pytest.raises(InvalidArgError, match="output 'x' has no element"):
        generate_answer(empty)
