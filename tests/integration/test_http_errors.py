"""Every error path of the HTTP front-end: Triton's status code and a message naming the problem."""

from __future__ import annotations

import http.client as http_client
import json

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import http, http_json

ONES = [1] * 16


def tensor(name="INPUT0", shape=(1, 16), datatype="INT32", data=ONES):
    return {"name": name, "shape": list(shape), "datatype": datatype, "data": data}


GOOD = {"inputs": [tensor("INPUT0"), tensor("INPUT1")]}

ERRORS = [
    # (id, path, body, status, message fragment)
    ("unknown-model", "/v2/models/nope/infer", GOOD, 404, "Request for unknown model: 'nope' is not found"),
    ("unknown-version", "/v2/models/simple/versions/7/infer", GOOD, 404,
     "Request for unknown model: 'simple' version 7 is not found"),
    ("failed-model", "/v2/models/corrupt/infer", GOOD, 404, "'corrupt' has no available versions"),
    ("wrong-input-name", "/v2/models/simple/infer", {"inputs": [tensor("INPUT0"), tensor("BOGUS")]}, 400,
     "unexpected inference input 'BOGUS' for model 'simple'"),
    ("missing-input", "/v2/models/simple/infer", {"inputs": [tensor("INPUT0")]}, 400,
     "missing required input(s) ['INPUT1']"),
    ("wrong-datatype", "/v2/models/simple/infer",
     {"inputs": [tensor("INPUT0", datatype="FP32"), tensor("INPUT1")]}, 400,
     "inference input 'INPUT0' data-type is 'FP32', but model 'simple' expects 'INT32'"),
    ("wrong-shape", "/v2/models/simple/infer",
     {"inputs": [tensor("INPUT0", shape=(1, 8), data=[1] * 8), tensor("INPUT1")]}, 400,
     "unexpected shape for input 'INPUT0' for model 'simple'. Expected [-1,16], got [1,8]"),
    ("batch-too-large", "/v2/models/simple/infer",
     {"inputs": [tensor("INPUT0", shape=(9, 16), data=[1] * 144), tensor("INPUT1", shape=(9, 16), data=[1] * 144)]},
     400, "inference request batch-size must be <= 8 for 'simple'"),
    ("element-count", "/v2/models/simple/infer",
     {"inputs": [tensor("INPUT0", data=[1] * 15), tensor("INPUT1")]}, 400, "input 'INPUT0' has 15 elements"),
    ("bad-datatype-name", "/v2/models/simple/infer",
     {"inputs": [tensor("INPUT0", datatype="INT33"), tensor("INPUT1")]}, 400, "invalid datatype 'INT33'"),
    ("unknown-output", "/v2/models/simple/infer", {**GOOD, "outputs": [{"name": "NOPE"}]}, 400,
     "unexpected inference output 'NOPE' for model 'simple'"),
    ("malformed-json", "/v2/models/simple/infer", b'{"inputs": [', 400, "failed to parse the request JSON"),
    ("empty-body", "/v2/models/simple/infer", b"", 400, "failed to parse the request JSON"),
    ("no-inputs", "/v2/models/simple/infer", {"inputs": []}, 400,
     "expected 2 inputs but got 0 inputs for model 'simple'. Got input(s) [], but missing required input(s) "
     "['INPUT0', 'INPUT1']"),
    ("inputs-missing", "/v2/models/simple/infer", {}, 500,
     "Unable to parse 'inputs': attempt to access non-existing object member 'inputs'"),
    ("data-nested-too-deep", "/v2/models/simple/infer",
     {"inputs": [tensor("INPUT0", data=json.loads("[" * 99 + json.dumps(ONES) + "]" * 99)), tensor("INPUT1")]}, 400,
     "Unable to parse 'data': JSON nesting depth exceeds maximum allowed limit (100)"),
    ("negative-dimension", "/v2/models/simple/infer", {"inputs": [tensor("INPUT0", shape=(-1, 16)), tensor("INPUT1")]},
     500, "Unable to parse 'shape': attempt to access JSON non-unsigned-integer as unsigned-integer"),
    ("json-nested-too-deep", "/v2/models/simple/infer", b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     400, "failed to parse the request JSON buffer: the document is nested too deeply"),
    ("element-count-overflow", "/v2/models/simple/infer",
     {"inputs": [tensor("INPUT0", shape=(4294967296, 4294967296)), tensor("INPUT1")]}, 400,
     "invalid shape for input 'INPUT0': shape [4294967296,4294967296] causes total element count to exceed maximum "
     "size of 9223372036854775807"),
    ("byte-size-overflow", "/v2/models/simple/infer",
     {"inputs": [tensor("INPUT0", shape=(4, 2**60 + 2)), tensor("INPUT1")]}, 400,
     "byte size overflow for input 'INPUT0': element count (4611686018427387912) * data type size (4) exceeds "
     "maximum allowed size (9223372036854775807)"),
]


@pytest.mark.parametrize("path,body,status,fragment", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_error_table(server, path, body, status, fragment):
    got_status, doc = http_json("POST", path, body)
    assert got_status == status
    assert set(doc) == {"error"}
    assert fragment in doc["error"]


def test_data_nested_deeper_than_its_shape_is_flattened_as_triton_does(server):
    status, doc = http_json("POST", "/v2/models/simple/infer", {"inputs": [
        tensor("INPUT0", data=[[[[1] * 8], [[1] * 8]]]), tensor("INPUT1", data=[[1] * 4, [[1] * 4, [1] * 8]])]})
    assert status == 200 and doc["outputs"][0]["data"] == [2] * 16


def test_a_raw_binary_request_may_come_chunked(server):
    """Inference-Header-Content-Length: 0 with Transfer-Encoding: chunked: the whole de-chunked
    body is the model's one input, as Triton reads it."""
    host, port = server["url"].split(":")
    connection = http_client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("POST", "/v2/models/py_ready/infer", body=iter([b"\x07\x00", b"\x00\x00"]),
                           headers={"Inference-Header-Content-Length": "0"}, encode_chunked=True)
        response = connection.getresponse()
        body = response.read()
    finally:
        connection.close()
    assert response.status == 200
    length = int(response.getheader("Inference-Header-Content-Length"))
    assert json.loads(body[:length])["outputs"][0]["parameters"] == {"binary_data_size": 4}
    assert np.frombuffer(body[length:], np.int32).tolist() == [7]


@pytest.mark.parametrize("path, error", [
    ("/v2/models/simple/infer",
     "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in 'simple' model configuration"),
    *[(path, "failed to parse the request JSON buffer: Invalid value. at 0") for path in (
        "/v2/repository/index", "/v2/repository/models/simple/load", "/v2/repository/models/simple/unload",
        "/v2/models/simple/trace/setting", "/v2/logging", "/v2/systemsharedmemory/region/r/register",
        "/v2/models/simple/generate")],
])
def test_a_body_of_many_small_chunks_gets_tritons_answer(server, path, error):
    """Triton's many-chunks test: 10,000 one-byte chunks ('A') to each endpoint that reads a
    body; each answers the de-chunked body as Triton does."""
    host, port = server["url"].split(":")
    connection = http_client.HTTPConnection(host, int(port), timeout=60)
    try:
        connection.request("POST", path, body=iter([b"A"] * 10_000), encode_chunked=True,
                           headers={"Inference-Header-Content-Length": "0", "Content-Type": "application/octet-stream"})
        response = connection.getresponse()
        doc = json.loads(response.read())
    finally:
        connection.close()
    assert response.status in (400, 500) and doc == {"error": error}


def _binary_request(header_doc: dict, binary: bytes, header_length: int | None = None) -> tuple[int, dict]:
    head = json.dumps(header_doc).encode()
    length = len(head) if header_length is None else header_length
    status, _, raw = http("POST", "/v2/models/simple/infer", head + binary,
                          {"Inference-Header-Content-Length": str(length)})
    return status, json.loads(raw)


def _binary_inputs(size0: int = 64, size1: int = 64) -> dict:
    return {"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": size0}},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": size1}},
    ]}


@pytest.mark.parametrize("doc,binary,header_length,fragment", [
    (_binary_inputs(), b"\0" * 100, None, "binary_data_size 64 exceeds"),
    (_binary_inputs(), b"\0" * 140, None, "unexpected 12 bytes of binary data"),
    (_binary_inputs(60, 68), b"\0" * 128, None, "input 'INPUT0' has 60 bytes of binary data, expected 64"),
    (_binary_inputs(), b"\0" * 128, 10_000, "Inference-Header-Content-Length 10000 is out of range"),
], ids=["truncated", "trailing-bytes", "wrong-size", "header-length"])
def test_binary_framing_errors(server, doc, binary, header_length, fragment):
    status, body = _binary_request(doc, binary, header_length)
    assert status == 400
    assert fragment in body["error"]


def test_tritonclient_surfaces_errors_with_status(server):
    client = httpclient.InferenceServerClient(server["url"])
    try:
        inp = httpclient.InferInput("INPUT0", [1, 8], "INT32")
        inp.set_data_from_numpy(np.zeros((1, 8), dtype=np.int32))
        other = httpclient.InferInput("INPUT1", [1, 16], "INT32")
        other.set_data_from_numpy(np.zeros((1, 16), dtype=np.int32))
        with pytest.raises(InferenceServerException) as info:
            client.infer("simple", [inp, other])
        assert info.value.status() == "400"
        assert "unexpected shape for input 'INPUT0'" in info.value.message()
        with pytest.raises(InferenceServerException, match="Request for unknown model: 'nope' is not found"):
            client.get_model_metadata("nope")
    finally:
        client.close()


def test_server_keeps_serving_after_bad_requests(server):
    for _, path, body, _, _ in ERRORS:
        http_json("POST", path, body)
    status, _, _ = http("GET", "/v2/health/live")
    assert status == 200
    status, doc = http_json("POST", "/v2/models/simple/infer", GOOD)
    assert status == 200
    assert doc["outputs"][0]["data"] == [2] * 16


def test_unknown_routes_are_404(server):
    assert http("GET", "/v2/nothing/here")[0] == 404
    assert http("GET", "/v2/models/simple/bogus")[0] == 404


def test_rejected_requests_are_not_counted_as_failures(server):
    """As in Triton, a request the front-end rejects never reaches the model's statistics."""
    def counts():
        status, doc = http_json("GET", "/v2/models/simple/versions/1/stats")
        assert status == 200
        stats = doc["model_stats"][0]["inference_stats"]
        return stats["success"]["count"], stats["fail"]["count"]

    before = counts()
    for _, path, body, _, _ in ERRORS:
        if path == "/v2/models/simple/infer":
            http_json("POST", path, body)
    assert counts() == before


@pytest.mark.parametrize("suffix", ["", "/ready", "/config", "/stats", "/versions/1", "/versions/1/ready"])
def test_the_v2_application_answers_a_model_get_as_its_replica_does(server, suffix):
    # The front sends a model GET with no registered replica to the /v2 application under
    # /v2/unrouted (a model loading, or one whose replicas are not registered with the front
    # yet); for a served model that answers, through a deployment handle, what the replica does.
    status, direct = http_json("GET", f"/v2/models/simple{suffix}")
    status_v2, via_v2 = http_json("GET", f"/v2/unrouted/v2/models/simple{suffix}")
    assert status == status_v2 == 200
    if suffix == "/stats":  # from the statistics replicas report every half second
        assert [(m["name"], m["version"]) for m in via_v2["model_stats"]] == \
            [(m["name"], m["version"]) for m in direct["model_stats"]]
        return
    assert via_v2 == direct
    if suffix == "":
        assert direct["name"] == "simple" and direct["inputs"][0]["shape"] == [-1, 16]


def test_the_v2_application_says_an_unknown_model_is_not_ready(server):
    assert http("GET", "/v2/unrouted/v2/models/nope/ready")[0] == 400
    status, doc = http_json("GET", "/v2/unrouted/v2/models/corrupt")
    assert status == 404 and "'corrupt' has no available versions" in doc["error"]
