"""Encoding infer responses for HTTP: JSON data, binary data, and the header length."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from rayinfer.protocol.dtypes import deserialize_bytes_tensor, serialize_bytes_tensor
from rayinfer.protocol.http_codec import error_body, response_to_http
from rayinfer.protocol.types import InferOutput, InferRequest, InferResponse, RequestedOutput

INT_OUT = np.arange(4, dtype=np.int32).reshape(1, 4)
FLOAT_OUT = np.array([[0.5, -2.0]], dtype=np.float32)


def _response(*outputs: InferOutput, id: str | None = None) -> InferResponse:
    return InferResponse(model_name="simple", model_version="1", outputs=list(outputs), id=id)


def _request(outputs: list[RequestedOutput] | None = None, **parameters: Any) -> InferRequest:
    return InferRequest(model_name="simple", outputs=outputs, parameters=parameters)


def _split(body: bytes, header_length: int | None) -> tuple[dict[str, Any], bytes]:
    if header_length is None:
        return json.loads(body), b""
    return json.loads(body[:header_length]), body[header_length:]


def test_json_output() -> None:
    out = InferOutput("OUTPUT0", "INT32", (1, 4), INT_OUT)
    body, header_length = response_to_http(_response(out), _request())
    assert header_length is None
    assert json.loads(body) == {
        "model_name": "simple",
        "model_version": "1",
        "outputs": [{"name": "OUTPUT0", "datatype": "INT32", "shape": [1, 4], "data": [0, 1, 2, 3]}],
    }


def test_id_is_echoed_and_absent_when_none() -> None:
    out = InferOutput("OUTPUT0", "INT32", (1, 4), INT_OUT)
    body, _ = response_to_http(_response(out, id="req-7"), _request())
    assert json.loads(body)["id"] == "req-7"
    body, _ = response_to_http(_response(out), _request())
    assert "id" not in json.loads(body)


def test_binary_output_has_header_length_and_raw_bytes() -> None:
    outs = [InferOutput("OUTPUT0", "INT32", (1, 4), INT_OUT), InferOutput("OUTPUT1", "FP32", (1, 2), FLOAT_OUT)]
    request = _request([RequestedOutput("OUTPUT0", binary=True), RequestedOutput("OUTPUT1", binary=True)])
    body, header_length = response_to_http(_response(*outs), request)
    assert header_length is not None
    head, raw = _split(body, header_length)
    assert [o["parameters"]["binary_data_size"] for o in head["outputs"]] == [16, 8]
    assert all("data" not in o for o in head["outputs"])
    assert raw == INT_OUT.tobytes() + FLOAT_OUT.tobytes()
    np.testing.assert_array_equal(np.frombuffer(raw[16:], dtype=np.float32), [0.5, -2.0])


def test_mixed_binary_and_json_outputs() -> None:
    outs = [InferOutput("OUTPUT0", "INT32", (1, 4), INT_OUT), InferOutput("OUTPUT1", "FP32", (1, 2), FLOAT_OUT)]
    request = _request([RequestedOutput("OUTPUT0", binary=False), RequestedOutput("OUTPUT1", binary=True)])
    head, raw = _split(*response_to_http(_response(*outs), request))
    assert head["outputs"][0]["data"] == [0, 1, 2, 3]
    assert "parameters" not in head["outputs"][0]
    assert head["outputs"][1]["parameters"] == {"binary_data_size": 8}
    assert raw == FLOAT_OUT.tobytes()


def test_binary_data_output_parameter_is_the_default() -> None:
    outs = [InferOutput("OUTPUT0", "INT32", (1, 4), INT_OUT), InferOutput("OUTPUT1", "FP32", (1, 2), FLOAT_OUT)]
    # No outputs requested: every output follows binary_data_output.
    head, raw = _split(*response_to_http(_response(*outs), _request(binary_data_output=True)))
    assert [o["parameters"]["binary_data_size"] for o in head["outputs"]] == [16, 8]
    assert len(raw) == 24
    # An output's own binary_data flag wins over the default; one without a flag follows it.
    request = _request([RequestedOutput("OUTPUT0", binary=False), RequestedOutput("OUTPUT1")], binary_data_output=True)
    head, raw = _split(*response_to_http(_response(*outs), request))
    assert head["outputs"][0]["data"] == [0, 1, 2, 3]
    assert head["outputs"][1]["parameters"]["binary_data_size"] == 8
    assert raw == FLOAT_OUT.tobytes()


def test_bytes_output_in_binary() -> None:
    data = np.array([[b"12", b"", b"abc"]], dtype=object)
    out = InferOutput("TEXT", "BYTES", (1, 3), data)
    body, header_length = response_to_http(_response(out), _request([RequestedOutput("TEXT", binary=True)]))
    head, raw = _split(body, header_length)
    assert head["outputs"][0]["parameters"]["binary_data_size"] == len(raw)
    assert raw == serialize_bytes_tensor(data)
    assert deserialize_bytes_tensor(raw, 3, "TEXT").tolist() == [b"12", b"", b"abc"]


def test_bytes_output_in_json() -> None:
    data = np.array([b"12", "caf\u00e9".encode()], dtype=object)
    out = InferOutput("TEXT", "BYTES", (2,), data)
    head, raw = _split(*response_to_http(_response(out), _request()))
    assert raw == b""
    assert head["outputs"][0]["data"] == ["12", "caf\u00e9"]


def test_bool_and_fp16_json_outputs() -> None:
    outs = [
        InferOutput("B", "BOOL", (2,), np.array([True, False])),
        InferOutput("H", "FP16", (2,), np.array([1.5, -0.25], dtype=np.float16)),
    ]
    head, _ = _split(*response_to_http(_response(*outs), _request()))
    assert head["outputs"][0]["data"] == [True, False]
    assert head["outputs"][1]["data"] == [1.5, -0.25]


def test_response_parameters_are_included() -> None:
    response = _response(InferOutput("OUTPUT0", "INT32", (1, 4), INT_OUT))
    response.parameters = {"sequence_end": True}
    head, _ = _split(*response_to_http(response, _request()))
    assert head["parameters"] == {"sequence_end": True}


def test_error_body() -> None:
    assert json.loads(error_body("model 'x' not found")) == {"error": "model 'x' not found"}
