"""The gRPC codec: ModelInferRequest/Response to and from the neutral types (no server)."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from rayinfer.protocol.errors import InvalidArgError
from rayinfer.protocol.grpc_codec import (
    index_to_grpc,
    metadata_to_grpc,
    parameters_from_grpc,
    parameters_to_grpc,
    request_from_grpc,
    response_to_grpc,
    statistics_to_grpc,
)
from rayinfer.protocol.types import InferOutput, InferResponse


def request_with_raw(arrays: dict[str, tuple[str, np.ndarray]]) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="m", model_version="2", id="r1")
    for name, (datatype, array) in arrays.items():
        message.inputs.add(name=name, datatype=datatype, shape=array.shape)
        message.raw_input_contents.append(array.tobytes())
    return message


def test_raw_inputs_decode_to_arrays_of_their_shape():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    request = request_from_grpc(request_with_raw({"X": ("FP32", x)}))
    assert (request.model_name, request.model_version, request.id) == ("m", "2", "r1")
    np.testing.assert_array_equal(request.inputs[0].data, x)
    assert request.outputs is None


def test_typed_contents_decode_for_each_datatype():
    message = pb.ModelInferRequest(model_name="m")
    message.inputs.add(name="I", datatype="INT16", shape=[2]).contents.int_contents.extend([-3, 7])
    message.inputs.add(name="B", datatype="BOOL", shape=[2]).contents.bool_contents.extend([True, False])
    message.inputs.add(name="S", datatype="BYTES", shape=[1]).contents.bytes_contents.extend([b"hi"])
    inputs = {t.name: t.data for t in request_from_grpc(message).inputs}
    assert inputs["I"].dtype == np.int16 and inputs["I"].tolist() == [-3, 7]
    assert inputs["B"].tolist() == [True, False]
    assert inputs["S"].tolist() == [b"hi"]


@pytest.mark.parametrize("mutate, message", [
    (lambda m: m.raw_input_contents.__setitem__(0, b"\0" * 5), "input byte size mismatch for input 'X' for model 'm'"),
    (lambda m: m.raw_input_contents.append(b"extra"), "expected 1 raw_input_contents"),
    (lambda m: m.inputs[0].contents.fp32_contents.append(1.0), "unexpected explicit tensor data for input tensor 'X'"),
    (lambda m: setattr(m.inputs[0], "datatype", "FP33"), "input 'X' has invalid datatype 'FP33'"),
])
def test_malformed_requests_name_the_input(mutate, message):
    request = request_with_raw({"X": ("FP32", np.zeros((1, 2), np.float32))})
    mutate(request)
    with pytest.raises(InvalidArgError, match=message):
        request_from_grpc(request)


def test_typed_contents_count_must_match_the_shape():
    message = pb.ModelInferRequest(model_name="m")
    message.inputs.add(name="X", datatype="FP32", shape=[3]).contents.fp32_contents.extend([1.0])
    with pytest.raises(InvalidArgError, match="expected 3 for shape \\[3\\], got 1"):
        request_from_grpc(message)
    message = pb.ModelInferRequest(model_name="m")
    message.inputs.add(name="H", datatype="FP16", shape=[1])
    with pytest.raises(InvalidArgError, match="FP16 data must be sent in raw_input_contents"):
        request_from_grpc(message)


def test_response_outputs_are_raw():
    out = np.array([[1, 2]], dtype=np.int64)
    words = np.array([b"a", b"bc"], dtype=object)
    message = response_to_grpc(InferResponse("m", "1", [InferOutput("Y", "INT64", (1, 2), out),
                                                        InferOutput("W", "BYTES", (2,), words)], id="r9"))
    assert (message.model_name, message.model_version, message.id) == ("m", "1", "r9")
    assert [(o.name, o.datatype, list(o.shape)) for o in message.outputs] == [("Y", "INT64", [1, 2]), ("W", "BYTES", [2])]
    assert np.frombuffer(message.raw_output_contents[0], np.int64).tolist() == [1, 2]
    assert message.raw_output_contents[1] == b"\x01\0\0\0a\x02\0\0\0bc"


def test_parameters_round_trip():
    message = pb.ModelInferRequest()
    parameters_to_grpc({"flag": True, "n": 3, "big": 2**64 - 1, "x": 0.5, "s": "v"}, message.parameters)
    assert parameters_from_grpc(message.parameters) == {"flag": True, "n": 3, "big": 2**64 - 1, "x": 0.5, "s": "v"}


def test_metadata_statistics_and_index_messages():
    meta = metadata_to_grpc({"name": "m", "versions": ["1"], "platform": "onnxruntime_onnx",
                             "inputs": [{"name": "X", "datatype": "FP32", "shape": [-1, 4]}], "outputs": []})
    assert meta.name == "m" and list(meta.inputs[0].shape) == [-1, 4]
    stats = statistics_to_grpc([{"name": "m", "version": "1", "inference_count": 5, "execution_count": 2,
                                 "inference_stats": {"success": {"count": 5, "ns": 100}}, "batch_stats": []}])
    assert stats.model_stats[0].inference_stats.success.count == 5
    index = index_to_grpc([{"name": "m", "version": "1", "state": "READY", "reason": ""},
                           {"name": "bad", "state": "UNAVAILABLE", "reason": "broken"}])
    assert [(m.name, m.version, m.state, m.reason) for m in index.models] == [
        ("m", "1", "READY", ""), ("bad", "", "UNAVAILABLE", "broken")]


def test_priority_and_timeout_follow_tritons_parameter_types():
    message = request_with_raw({"X": ("FP32", np.zeros((1, 2), np.float32))})
    message.parameters["priority"].uint64_param = 2
    message.parameters["timeout"].int64_param = 5000
    assert request_from_grpc(message).parameters == {"priority": 2, "timeout": 5000}
    message.parameters["timeout"].int64_param = -1  # no timeout of the request's own
    assert request_from_grpc(message).parameters["timeout"] == 0


@pytest.mark.parametrize("key, kind, value, message", [
    ("priority", "string_param", "high",
     "invalid value type for 'priority' parameter, expected int64_param or uint64_param."),
    ("priority", "int64_param", -1, "invalid value for 'priority', expected value >= 0."),
    ("timeout", "uint64_param", 5, "invalid value type for 'timeout' parameter, expected int64_param."),
])
def test_priority_and_timeout_of_the_wrong_type_are_refused(key, kind, value, message):
    request = request_with_raw({"X": ("FP32", np.zeros((1, 2), np.float32))})
    setattr(request.parameters[key], kind, value)
    with pytest.raises(InvalidArgError) as info:
        request_from_grpc(request)
    assert info.value.message == message


@pytest.mark.parametrize("key, kind, value, message", [
    ("sequence_id", "uint64_param", 5, "invalid value type for 'sequence_id' parameter, expected int64_param or string_param."),
    ("sequence_start", "int64_param", 1, "invalid value type for 'sequence_start' parameter, expected bool_param."),
    ("sequence_end", "string_param", "yes", "invalid value type for 'sequence_end' parameter, expected bool_param."),
])
def test_sequence_parameters_of_the_wrong_type_are_refused(key, kind, value, message):
    request = request_with_raw({"X": ("FP32", np.zeros((1, 2), np.float32))})
    setattr(request.parameters[key], kind, value)
    with pytest.raises(InvalidArgError) as info:
        request_from_grpc(request)
    assert info.value.message == message
    request = request_with_raw({"X": ("FP32", np.zeros((1, 2), np.float32))})
    request.parameters["sequence_id"].string_param = "abc"
    request.parameters["sequence_start"].bool_param = True
    assert request_from_grpc(request).parameters == {"sequence_id": "abc", "sequence_start": True}


@pytest.mark.parametrize("kind, value, message", [
    ("uint64_param", 3, "invalid value type for 'classification' parameter, expected int64_param"),
    ("int64_param", 0, "invalid value for 'classification' parameter, expected >= 1"),
])
def test_classification_must_be_a_positive_int64(kind, value, message):
    request = request_with_raw({"X": ("FP32", np.zeros((1, 2), np.float32))})
    output = request.outputs.add(name="Y")
    setattr(output.parameters["classification"], kind, value)
    with pytest.raises(InvalidArgError) as info:
        request_from_grpc(request)
    assert info.value.message == message
    output.parameters["classification"].int64_param = 3
    assert request_from_grpc(request).outputs[0].parameters == {"classification": 3}
