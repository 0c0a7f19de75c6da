"""Decoding KServe v2 HTTP infer requests: JSON tensors and the binary tensor extension."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from rayinfer.protocol.dtypes import serialize_bytes_tensor
from rayinfer.protocol.errors import Code, InvalidArgError, ServingError
from rayinfer.protocol.http_codec import repository_index_ready, request_from_http


def _json_body(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc).encode()


def _binary_body(doc: dict[str, Any], *chunks: bytes) -> tuple[bytes, int]:
    header = _json_body(doc)
    return header + b"".join(chunks), len(header)


def _one_input(**fields: Any) -> bytes:
    tensor = {"name": "INPUT0", "datatype": "INT32", "shape": [2], "data": [1, 2]}
    tensor.update(fields)
    return _json_body({"inputs": [tensor]})


def test_json_nested_and_flat_data_give_the_same_array() -> None:
    nested = _one_input(shape=[2, 3], data=[[1, 2, 3], [4, 5, 6]])
    flat = _one_input(shape=[2, 3], data=[1, 2, 3, 4, 5, 6])
    for body in (nested, flat):
        request = request_from_http(body, None, "simple", "1")
        (tensor,) = request.inputs
        assert request.model_name == "simple" and request.model_version == "1"
        assert tensor.name == "INPUT0" and tensor.datatype == "INT32" and tensor.shape == (2, 3)
        assert tensor.data.dtype == np.int32
        np.testing.assert_array_equal(tensor.data, [[1, 2, 3], [4, 5, 6]])


def test_json_bool_bytes_and_fp16() -> None:
    body = _json_body({
        "inputs": [
            {"name": "B", "datatype": "BOOL", "shape": [3], "data": [True, False, True]},
            {"name": "S", "datatype": "BYTES", "shape": [1, 2], "data": [["hello", "caf\u00e9"]]},
            {"name": "H", "datatype": "FP16", "shape": [2], "data": [0.5, -1.25]},
        ]
    })
    b, s, h = request_from_http(body, None, "m").inputs
    assert b.data.dtype == np.bool_ and b.data.tolist() == [True, False, True]
    assert s.data.dtype == object and s.data.shape == (1, 2)
    assert s.data.tolist() == [[b"hello", "caf\u00e9".encode()]]
    assert h.data.dtype == np.float16 and h.data.tolist() == [0.5, -1.25]


def test_id_parameters_and_requested_outputs_pass_through() -> None:
    body = _json_body({
        "id": "req-42",
        "parameters": {"binary_data_output": True, "priority": 3},
        "inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1], "data": [7]}],
        "outputs": [
            {"name": "OUTPUT0", "parameters": {"binary_data": False}},
            {"name": "OUTPUT1", "parameters": {"binary_data": True, "classification": 0}},
            {"name": "OUTPUT2"},
        ],
    })
    request = request_from_http(body, None, "m")
    assert request.id == "req-42"
    assert request.parameters == {"binary_data_output": True, "priority": 3}
    assert [(o.name, o.binary) for o in request.outputs] == [
        ("OUTPUT0", False), ("OUTPUT1", True), ("OUTPUT2", None)
    ]
    assert request.outputs[1].parameters == {"classification": 0}


def test_numeric_id_becomes_a_string_and_outputs_default_to_none() -> None:
    request = request_from_http(_json_body({"id": 5, "inputs": [
        {"name": "X", "datatype": "INT8", "shape": [1], "data": [1]}]}), None, "m")
    assert request.id == "5"
    assert request.outputs is None
    assert request.parameters == {}


def test_binary_inputs_are_read_in_order() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([10, -20], dtype=np.int64)
    text = np.array([b"ab", b"", b"xyz"], dtype=object)
    text_raw = serialize_bytes_tensor(text)
    doc = {
        "inputs": [
            {"name": "A", "datatype": "FP32", "shape": [2, 3], "parameters": {"binary_data_size": a.nbytes}},
            {"name": "J", "datatype": "INT32", "shape": [1], "data": [9]},
            {"name": "B", "datatype": "INT64", "shape": [2], "parameters": {"binary_data_size": b.nbytes}},
            {"name": "T", "datatype": "BYTES", "shape": [3], "parameters": {"binary_data_size": len(text_raw)}},
        ]
    }
    body, header_length = _binary_body(doc, a.tobytes(), b.tobytes(), text_raw)
    ta, tj, tb, tt = request_from_http(body, header_length, "m").inputs
    np.testing.assert_array_equal(ta.data, a)
    assert ta.data.dtype == np.float32
    assert "binary_data_size" not in ta.parameters
    np.testing.assert_array_equal(tj.data, [9])
    np.testing.assert_array_equal(tb.data, b)
    assert tt.data.tolist() == [b"ab", b"", b"xyz"]


def test_header_length_equal_to_body_means_json_only() -> None:
    body = _one_input()
    request = request_from_http(body, len(body), "m")
    np.testing.assert_array_equal(request.inputs[0].data, [1, 2])


def _error(body: bytes, header_length: int | None = None) -> str:
    with pytest.raises(InvalidArgError) as info:
        request_from_http(body, header_length, "m")
    return info.value.message


@pytest.mark.parametrize("body, reason", [
    (b'{"inputs": [', "Invalid value. at 12"),
    (b"", "The document is empty. at 0"),
    (b"A" * 1000, "Invalid value. at 0"),
    (b'{"inputs": [1 2]}', "Missing a comma or ']' after an array element. at 14"),
    (b'{"inputs": [], "id" "x"}', "Missing a colon after a name of object member. at 20"),
    (b'{"inputs": [{"name": "a]"} "x"]}', "Missing a comma or ']' after an array element. at 27"),
    (b'{"id": "x" "y"}', "Missing a comma or '}' after an object member. at 11"),
    (b"{1: 2}", "Missing a name for object member. at 1"),
    (b"{} {}", "The document root must not be followed by other values. at 3"),
    (b'{"id": "\\q"}', "Invalid escape character in string. at 8"),
    (b'{"id": "\xc3\xa9\\q"}', "Invalid escape character in string. at 10"),  # offsets count bytes
    (b'{"id": "\xff"}', "Invalid encoding in string. at 8"),
])
def test_a_body_that_does_not_parse_gets_tritons_words(body: bytes, reason: str) -> None:
    """rapidjson's message and byte offset, as Triton gives them (its tests look for
    'failed to parse the request JSON buffer: Invalid value. at 0')."""
    assert _error(body) == f"failed to parse the request JSON buffer: {reason}"


def test_non_object_json() -> None:
    assert "expected a JSON object" in _error(b"[1, 2]")


@pytest.mark.parametrize("doc, message", [
    ({}, "Unable to parse 'inputs': attempt to access non-existing object member 'inputs'"),
    ({"inputs": {"name": "X"}}, "Unable to parse 'inputs': attempt to access JSON non-array as array"),
])
def test_inputs_must_be_an_array(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ServingError) as info:  # Triton's INTERNAL, its words
        request_from_http(_json_body(doc), None, "m")
    assert info.value.code == Code.INTERNAL and info.value.message == message


def test_an_empty_inputs_array_is_for_the_model_to_judge() -> None:
    assert request_from_http(_json_body({"inputs": []}), None, "m").inputs == []


def test_bad_datatype_names_the_input() -> None:
    assert _error(_one_input(datatype="FLOAT32")) == "input 'INPUT0' has invalid datatype 'FLOAT32'"


@pytest.mark.parametrize("shape", ["2", None])
def test_bad_shape_names_the_input(shape: Any) -> None:
    assert _error(_one_input(shape=shape)).startswith("input 'INPUT0' has invalid shape")


@pytest.mark.parametrize("shape", [[-1, 2], [2, "3"]])
def test_a_dimension_that_is_not_an_unsigned_integer_gets_tritons_message(shape: Any) -> None:
    with pytest.raises(ServingError) as info:
        request_from_http(_one_input(shape=shape), None, "m")
    assert info.value.code == Code.INTERNAL
    assert info.value.message == "Unable to parse 'shape': attempt to access JSON non-unsigned-integer as unsigned-integer"


def test_element_count_mismatch_names_the_input() -> None:
    message = _error(_one_input(shape=[3], data=[1, 2]))
    assert message == "input 'INPUT0' has 2 elements in 'data', expected 3 for shape [3]"


@pytest.mark.parametrize(
    "datatype, data",
    [("INT32", ["a", "b"]), ("BOOL", [1, 0]), ("BYTES", [1, 2]), ("UINT8", [1, 300])],
)
def test_data_not_valid_for_datatype_names_the_input(datatype: str, data: list[Any]) -> None:
    message = _error(_one_input(datatype=datatype, data=data))
    assert message.startswith(f"input 'INPUT0': data is not valid {datatype}")


def test_missing_data_names_the_input() -> None:
    tensor = {"name": "INPUT0", "datatype": "INT32", "shape": [2]}
    assert "But no field is set for input 'INPUT0'" in _error(_json_body({"inputs": [tensor]}))


def test_binary_data_size_past_the_end_names_the_input() -> None:
    doc = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [4],
                       "parameters": {"binary_data_size": 16}}]}
    body, header_length = _binary_body(doc, b"\x00" * 8)
    message = _error(body, header_length)
    assert "input 'INPUT0'" in message and "binary_data_size 16" in message


def test_binary_size_not_matching_shape_names_the_input() -> None:
    doc = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [4],
                       "parameters": {"binary_data_size": 8}}]}
    body, header_length = _binary_body(doc, b"\x00" * 8)
    assert _error(body, header_length).startswith("input 'INPUT0' has 8 bytes of binary data, expected 16")


def test_binary_bytes_framing_error_names_the_input() -> None:
    raw = serialize_bytes_tensor(np.array([b"abc"], dtype=object))
    doc = {"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [2],
                       "parameters": {"binary_data_size": len(raw)}}]}
    body, header_length = _binary_body(doc, raw)
    assert "for input 'TEXT'" in _error(body, header_length)


def test_leftover_binary_bytes() -> None:
    doc = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1],
                       "parameters": {"binary_data_size": 4}}]}
    body, header_length = _binary_body(doc, b"\x01\x00\x00\x00", b"extra")
    assert "unexpected 5 bytes of binary data after the last input tensor" in _error(body, header_length)


@pytest.mark.parametrize("header_length", [-1, 10_000])
def test_header_length_out_of_range(header_length: int) -> None:
    message = _error(_one_input(), header_length)
    assert f"Inference-Header-Content-Length {header_length} is out of range" in message


def test_bf16_travels_as_binary_data_only() -> None:
    assert "receiving BF16 data via JSON is not supported" in _error(_one_input(datatype="BF16", data=[1.0, 2.0]))


def test_bad_outputs_and_parameters() -> None:
    tensor = {"name": "X", "datatype": "INT8", "shape": [1], "data": [1]}
    assert "'outputs' must be an array" in _error(_json_body({"inputs": [tensor], "outputs": {"name": "Y"}}))
    assert "with a 'name'" in _error(_json_body({"inputs": [tensor], "outputs": [{"nam": "Y"}]}))
    assert "'parameters' must be a JSON object" in _error(_json_body({"inputs": [tensor], "parameters": [1]}))


@pytest.mark.parametrize("datatype, data", [("INT32", ["1", "2"]), ("INT32", [1.5, 2.0]), ("FP32", [True, False])])
def test_json_numbers_must_match_the_datatype(datatype: str, data: list[Any]) -> None:
    assert "input 'INPUT0': data is not valid" in _error(_one_input(datatype=datatype, shape=[2], data=data))


def test_priority_and_timeout_pass_as_unsigned_integers() -> None:
    doc = json.loads(_one_input())
    doc["parameters"] = {"priority": 2, "timeout": 5000}
    assert request_from_http(_json_body(doc), None, "m").parameters == {"priority": 2, "timeout": 5000}


@pytest.mark.parametrize("key, value", [("priority", -1), ("priority", "high"), ("timeout", 1.5), ("timeout", True)])
def test_priority_and_timeout_must_be_unsigned_integers(key: str, value: Any) -> None:
    doc = json.loads(_one_input())
    doc["parameters"] = {key: value}
    with pytest.raises(ServingError) as info:
        request_from_http(_json_body(doc), None, "m")
    # Triton's message, and its code (INTERNAL, HTTP 500).
    assert info.value.code == Code.INTERNAL
    assert info.value.message == (
        f"Unable to parse '{key}': attempt to access JSON non-unsigned-integer as unsigned-integer")


@pytest.mark.parametrize("key, value, message", [
    ("sequence_id", -1, "Unable to parse 'sequence_id': attempt to access JSON non-string as string"),
    ("sequence_id", 1.5, "Unable to parse 'sequence_id': attempt to access JSON non-string as string"),
    ("sequence_start", 1, "Unable to parse 'sequence_start': attempt to access JSON non-boolean as boolean"),
    ("sequence_end", "true", "Unable to parse 'sequence_end': attempt to access JSON non-boolean as boolean"),
])
def test_sequence_parameters_follow_tritons_types(key: str, value: Any, message: str) -> None:
    doc = json.loads(_one_input())
    doc["parameters"] = {"sequence_id": 7, "sequence_start": True, "sequence_end": False}
    assert request_from_http(_json_body(doc), None, "m").parameters == doc["parameters"]
    doc["parameters"] = {key: value}
    with pytest.raises(ServingError) as info:
        request_from_http(_json_body(doc), None, "m")
    assert (info.value.code, info.value.message) == (Code.INTERNAL, message)


@pytest.mark.parametrize("value", [-1, 1.5, "3", True])
def test_classification_must_be_an_unsigned_integer(value: Any) -> None:
    doc = json.loads(_one_input())
    doc["outputs"] = [{"name": "Y", "parameters": {"classification": 3}}]
    assert request_from_http(_json_body(doc), None, "m").outputs[0].parameters == {"classification": 3}
    doc["outputs"] = [{"name": "Y", "parameters": {"classification": value}}]
    with pytest.raises(ServingError) as info:
        request_from_http(_json_body(doc), None, "m")
    assert (info.value.code, info.value.message) == (
        Code.INTERNAL, "Unable to set 'classification': attempt to access JSON non-unsigned-integer as unsigned-integer")


@pytest.mark.parametrize("body, ready", [(b"", False), (b"  ", False), (b"null", False), (b"[]", False), (b"5", False),
                                         (b'{"ready": true}', True), (b'{"ready": false}', False), (b'{"x": 1}', False)])
def test_the_repository_index_body_as_triton_reads_it(body: bytes, ready: bool) -> None:
    assert repository_index_ready(body) is ready


@pytest.mark.parametrize("body, message", [
    (b'{"ready": "yes"}', "attempt to access JSON non-boolean as boolean"),
    (b'{"ready":', "failed to parse the request JSON buffer: Invalid value. at 9"),
    (b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "failed to parse the request JSON buffer: the document is nested too "
                                                          "deeply"),
])
def test_a_repository_index_body_triton_refuses_is_its_500(body: bytes, message: str) -> None:
    with pytest.raises(ServingError) as raised:
        repository_index_ready(body)
    assert raised.value.code == Code.INTERNAL and raised.value.message.startswith(message)
