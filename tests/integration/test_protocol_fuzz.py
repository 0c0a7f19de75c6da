"""Fuzzing what the OpenAPI fuzzer does not reach, on the shared test server: the binary tensor
extension's framing (header lengths, ``binary_data_size``, BYTES element framing, truncated and
padded bodies) and gRPC messages (mutated ModelInfer messages sent as raw bytes). Every answer
is a success or Triton's error (a JSON body over HTTP; INVALID_ARGUMENT, NOT_FOUND or
UNAVAILABLE over gRPC; INTERNAL "Unable to parse request" for a message that does not parse), none hangs, and the models
serve afterwards.

Bounded for CI (RAYINFER_FUZZ_EXAMPLES examples per test, 12 by default, derandomized).
"""

from __future__ import annotations

import http.client
import json
import os
import struct

import grpc
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

from conftest import HTTP_PORT, add_sub_inputs

EXAMPLES = int(os.environ.get("RAYINFER_FUZZ_EXAMPLES", "12"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
INPUTS = ("INPUT0", "INPUT1")


def post(path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    """One request on its own connection, with an exact Content-Length and a 30 s bound."""
    connection = http.client.HTTPConnection("127.0.0.1", HTTP_PORT, timeout=30)
    try:
        connection.request("POST", path, body=body, headers={"Content-Length": str(len(body)), **headers})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def assert_triton_answer(status: int, body: bytes) -> None:
    if status == 200:
        return
    assert status in (400, 404, 503), (status, body[:200])
    doc = json.loads(body)
    assert isinstance(doc.get("error"), str) and doc["error"], body[:200]


@st.composite
def binary_requests(draw) -> tuple[bytes, dict[str, str]]:
    """A binary-extension infer request for ``batched`` whose framing may be wrong anywhere."""
    rows = draw(st.integers(0, 3))
    payloads, tensors = [], []
    for name in INPUTS:
        data = np.arange(16 * rows, dtype=np.int32).tobytes()
        size = draw(st.one_of(st.just(len(data)), st.integers(-8, len(data) + 64), st.sampled_from([2**63, 2**64 + 4])))
        tensors.append({"name": name, "shape": [rows, 16], "datatype": draw(st.sampled_from(["INT32", "INT32", "FP32", "BYTES"])),
                        "parameters": {"binary_data_size": size}})
        payloads.append(draw(st.one_of(st.just(data), st.binary(max_size=96))))
    header = json.dumps({"inputs": tensors, "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}).encode()
    body = header + b"".join(payloads) + draw(st.binary(max_size=16))
    cut = draw(st.one_of(st.none(), st.integers(0, len(body))))
    body = body if cut is None else body[:cut]
    length = draw(st.one_of(st.just(str(len(header))), st.integers(-2, len(body) + 8).map(str),
                            st.sampled_from(["", "abc", "99999999999999999999", " 4"])))
    return body, {"Inference-Header-Content-Length": length, "Content-Type": "application/octet-stream"}


@FUZZ
@given(binary_requests())
def test_binary_framing_fuzz(server, request):
    body, headers = request
    assert_triton_answer(*post("/v2/models/batched/infer", body, headers))


@st.composite
def bytes_tensors(draw) -> bytes:
    """BYTES elements framed as 4-byte little-endian lengths then bytes, with lengths that may lie."""
    parts = []
    for _ in range(draw(st.integers(0, 20))):
        element = draw(st.binary(max_size=8))
        length = draw(st.one_of(st.just(len(element)), st.integers(0, 2**32 - 1)))
        parts.append(struct.pack("<I", length) + element)
    return b"".join(parts)[: draw(st.integers(0, 400))]


@FUZZ
@given(bytes_tensors(), bytes_tensors(), st.integers(0, 20))
def test_bytes_element_framing_fuzz(server, first, second, count):
    tensors = [{"name": name, "shape": [1, count], "datatype": "BYTES", "parameters": {"binary_data_size": len(data)}}
               for name, data in zip(INPUTS, (first, second))]
    header = json.dumps({"inputs": tensors}).encode()
    status, body = post("/v2/models/simple_string/infer", header + first + second,
                        {"Inference-Header-Content-Length": str(len(header))})
    assert_triton_answer(status, body)


def model_infer_message() -> bytes:
    request = pb.ModelInferRequest(model_name="batched", id="fuzz")
    for name in INPUTS:
        request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        request.raw_input_contents.append(np.arange(16, dtype=np.int32).tobytes())
    request.outputs.add(name="OUTPUT0")
    return request.SerializeToString()


@st.composite
def mutated_messages(draw) -> bytes:
    """A valid ModelInfer message with bytes flipped, cut, inserted or appended."""
    message = bytearray(model_infer_message())
    for _ in range(draw(st.integers(1, 6))):
        where = draw(st.integers(0, len(message)))
        action = draw(st.sampled_from(["flip", "cut", "insert", "truncate"]))
        if action == "flip" and where < len(message):
            message[where] ^= draw(st.integers(1, 255))
        elif action == "cut":
            del message[where:where + draw(st.integers(1, 8))]
        elif action == "insert":
            message[where:where] = draw(st.binary(min_size=1, max_size=8))
        else:
            message = message[:where]
    return bytes(message)


ALLOWED_GRPC = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                grpc.StatusCode.UNAVAILABLE}
# A message that does not parse: Triton's INTERNAL "Unable to parse request", whether the front
# routed it to a model replica or sent it to Serve's gRPC server (no readable model name).
UNPARSABLE = "Unable to parse request"


@FUZZ
@given(st.one_of(mutated_messages(), st.binary(max_size=300)))
def test_grpc_model_infer_fuzz(server, message):
    with grpc.insecure_channel(server["grpc_url"]) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # raw bytes both ways
        try:
            call(message, timeout=30)
        except grpc.RpcError as error:
            assert error.code() in ALLOWED_GRPC or (error.code() == grpc.StatusCode.INTERNAL
                                                    and error.details() == UNPARSABLE), (error.code(), error.details())
            assert error.details(), error.code()


def test_the_models_serve_after_protocol_fuzzing(server):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    with httpclient.InferenceServerClient(server["url"]) as client:
        np.testing.assert_array_equal(client.infer("batched", add_sub_inputs(a, a)).as_numpy("OUTPUT0"), a * 2)
    client = grpcclient.InferenceServerClient(server["grpc_url"])
    try:
        inputs = [grpcclient.InferInput(name, [1, 16], "INT32") for name in INPUTS]
        for tensor in inputs:
            tensor.set_data_from_numpy(a)
        np.testing.assert_array_equal(client.infer("batched", inputs).as_numpy("OUTPUT0"), a * 2)
    finally:
        client.close()
