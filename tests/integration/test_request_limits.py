"""Requests too large or malformed to read whole, and raw binary requests, on the shared server.

A body over --http-max-input-size (64 MiB here) is refused with Triton's 400 and a JSON error
(a model load's with 500, as Triton's current release answers) while it arrives: by the front when its Content-Length says so (before any of it is read), by
whoever reads it when it comes in chunks, and after decompression for a compressed one. The
server keeps serving afterwards.
"""

from __future__ import annotations

import gzip
import json
import socket

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import HTTP_PORT, http, http_json

LIMIT = 64 * 1024 * 1024
TOO_LARGE = f"exceeds the maximum allowed value of {LIMIT} bytes. Use --http-max-input-size to increase the limit."
# A model load's body (its files inline) over the limit: Triton's current release answers 500,
# its message speaking of the "request JSON size" and the "maximum allowed input size".
LOAD_TOO_LARGE = (f"exceeds the maximum allowed input size. The limit is {LIMIT} bytes. Use --http-max-input-size to "
                  "increase the limit.")


def too_large(path: str, length: int | None) -> tuple[int, dict]:
    """The status and error of a body of ``length`` (None: in chunks) over the limit at ``path``."""
    size = "" if length is None else f" of {length} bytes"
    if path.endswith("/load"):
        return 500, {"error": f"Load request JSON size{size} {LOAD_TOO_LARGE}"}
    return 400, {"error": f"Request JSON size{size} {TOO_LARGE}"}
# Paths that read a body: a model's infer (the replica's listener) and the load API (the /v2
# application through Serve's ingress).
PATHS = ["/v2/models/simple/infer", "/v2/repository/models/simple/load"]


def exchange(head: bytes, body_parts, timeout_s: float = 30.0) -> tuple[int, dict | None]:
    """Send ``head`` then ``body_parts`` on one connection, stopping early if the server answers
    or closes; returns the status and the JSON error of the answer (None if not JSON)."""
    with socket.create_connection(("127.0.0.1", HTTP_PORT), timeout=timeout_s) as sock:
        sock.sendall(head)
        try:
            for part in body_parts:
                sock.sendall(part)
        except OSError:  # the server answered and closed while the body was still coming
            pass
        return _answer(sock)


def _answer(sock: socket.socket) -> tuple[int, dict | None]:
    """The status and JSON error (None if not JSON) of the next answer on ``sock``."""
    answer = b""
    while b"\r\n\r\n" not in answer or not _complete(answer):
        data = sock.recv(65536)
        if not data:
            break
        answer += data
    head_bytes, _, payload = answer.partition(b"\r\n\r\n")
    status = int(head_bytes.split(b" ", 2)[1])
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, None


def _complete(answer: bytes) -> bool:
    head, _, payload = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(payload) >= int(value)
    return False


def chunks(total: int, size: int = 1 << 20):
    for _ in range(total // size):
        yield b"%x\r\n%b\r\n" % (size, b"a" * size)
    yield b"0\r\n\r\n"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("length", [LIMIT + 1, 3_000_000_000, 10**20])
def test_a_content_length_over_the_limit_is_refused_before_the_body(server, path, length):
    # Only 1 KB of the announced body is ever sent: the answer cannot wait for the rest.
    head = b"POST %b HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (path.encode(), length)
    status, doc = exchange(head, [b"{" * 1024], timeout_s=10)
    if length < 2**63:
        assert (status, doc) == too_large(path, length)
    else:  # a length no 64-bit integer holds: the front's HTTP parser refuses the header itself
        assert status == 400  # (with HAProxy's own HTML page)


@pytest.mark.parametrize("path", PATHS)
def test_a_chunked_body_over_the_limit_is_refused_while_it_arrives(server, path):
    head = b"POST %b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" % path.encode()
    status, doc = exchange(head, chunks(LIMIT + (4 << 20)))
    assert (status, doc) == too_large(path, None)


def test_a_compressed_body_is_limited_once_inflated(server):
    bomb = gzip.compress(b"\0" * (LIMIT + 1))  # about 65 KB on the wire
    status, _, raw = http("POST", "/v2/models/simple/infer", bomb, {"Content-Encoding": "gzip"})
    assert status == 400
    assert json.loads(raw) == {"error": f"Decompressed request body size {TOO_LARGE}"}


def test_the_server_serves_on_after_oversized_requests(server):
    for path in PATHS:
        exchange(b"POST %b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" % path.encode(),
                 chunks(LIMIT + (1 << 20)))
        # A head over 16 KB, one large header or many: refused with a JSON 400, by the model's
        # replica as it reads the headers (5,000 are over 100 first) or by the front's acceptor
        # (the head does not end within its 16 KB look; README, "Request limits").
        too_large, too_many = "request headers too large (over 16384 bytes)", "too many request headers (over 100)"
        for headers, reason in ((b"x-big: %b\r\n" % (b"a" * 40_000), too_large),
                                (b"".join(b"x-%d: v\r\n" % i for i in range(5000)),
                                 too_many if "/v2/models/" in path else too_large)):
            status, doc = exchange(b"POST %b HTTP/1.1\r\nHost: x\r\n%bContent-Length: 2\r\n\r\n{}" % (
                path.encode(), headers), [])
            assert (status, doc) == (400, {"error": f"malformed HTTP request: {reason}"})
    for head, reason in ((b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n%b\r\n" % b"".join(
            b"x-%d: v\r\n" % i for i in range(150)), "too many request headers (over 100)"),
            (b"GARBAGE\r\n\r\n", "malformed request line")):
        assert exchange(head, []) == (400, {"error": f"malformed HTTP request: {reason}"})
    assert http("GET", "/v2/health/live")[0] == 200
    ones = [1] * 16
    status, doc = http_json("POST", "/v2/models/simple/infer", {"inputs": [
        {"name": n, "shape": [1, 16], "datatype": "INT32", "data": ones} for n in ("INPUT0", "INPUT1")]})
    assert status == 200 and doc["outputs"][0]["data"] == [2] * 16
    status, index = http_json("POST", "/v2/repository/index", {})
    assert status == 200 and any(row["name"] == "simple" for row in index)


def _answers_on_one_connection(heads: list[bytes]) -> list[tuple[int, dict | None]]:
    """Send ``heads`` one after another on one connection, each once the answer before it has
    come; their statuses and JSON errors (None for a body that is not JSON)."""
    answers = []
    with socket.create_connection(("127.0.0.1", HTTP_PORT), timeout=30) as sock:
        for head in heads:
            sock.sendall(head)
            answers.append(_answer(sock))
    return answers


@pytest.mark.parametrize("first", ["/v2/models/simple/ready", "/v2/health/live", "/v2/models/no_such_model/ready"],
                         ids=["a-replicas-own", "relayed-by-a-replica", "held-by-haproxy"])
def test_the_head_limits_hold_for_every_request_of_a_kept_connection(server, first):
    """Heads up to 16 KB and 100 headers are served on any connection, a larger one or over 100
    headers gets a JSON 400, whoever reads it: a model's replica (its own request, or one it
    relays, which HAProxy then takes with the two headers the relay adds) or the front's HAProxy
    (a connection the acceptor gave it: no replica serves its first request)."""
    def head(path: str, extra: bytes) -> bytes:
        return b"GET %b HTTP/1.1\r\nHost: x\r\n%b\r\n" % (path.encode(), extra)

    just_under = b"x-big: %b\r\n" % (b"a" * (16384 - 200))
    hundred = b"".join(b"x-%d: v\r\n" % i for i in range(99))  # with Host: the limit, exactly
    for path in ("/v2/models/simple/ready", "/v2/health/live"):
        answers = _answers_on_one_connection([head(first, b""), head(path, just_under), head(path, hundred),
                                              head(path, b"")])
        assert [status for status, _ in answers[1:]] == [200, 200, 200], (first, path, answers)
    for extra, reason in ((b"x-big: %b\r\n" % (b"a" * 20_000), "request headers too large (over 16384 bytes)"),
                          (b"".join(b"x-%d: v\r\n" % i for i in range(150)), "too many request headers (over 100)")):
        for path in ("/v2/models/simple/ready", "/v2/health/live"):
            answers = _answers_on_one_connection([head(first, b""), head(path, extra)])
            assert answers[1] == (400, {"error": f"malformed HTTP request: {reason}"}), (path, reason)


@pytest.mark.parametrize("body, status, error", [
    (b'{"ready": 1}', 500, "attempt to access JSON non-boolean as boolean"),
    (b'{"ready":', 500, "failed to parse the request JSON buffer: Invalid value. at 9"),
    (b"[" * 100_000 + b"]" * 100_000, 500, "failed to parse the request JSON buffer: the document is nested too deeply"),
    (b'"str"', 200, None), (b"null", 200, None), (b"[]", 200, None), (b'{"ready": false, "x": 1}', 200, None),
])
def test_the_repository_index_reads_its_body_as_triton_does(server, body, status, error):
    """Triton 2.51's answers (seen on the anchor): a body that is not an object asks for every
    model; 'ready' must be a boolean; a body that does not parse is a 500. Triton parses any
    depth; here a document nested past Python's parser gets that 500 too."""
    got, doc = http_json("POST", "/v2/repository/index", body)
    assert got == status
    if error is None:
        assert any(row["name"] == "simple" for row in doc)
    else:
        assert doc == {"error": error}


# ---- raw binary requests (Inference-Header-Content-Length: 0) ---------------------------------


def test_a_raw_binary_request_is_the_models_one_input(server):
    """mlp has one input, FP32 [256] with batching: the body is a batch of one row; every
    output comes back as binary data, as the JSON request's would."""
    row = np.linspace(-1, 1, 256, dtype=np.float32)
    status, headers, raw = http("POST", "/v2/models/mlp/infer", row.tobytes(), {"Inference-Header-Content-Length": "0"})
    assert status == 200
    header_length = int({k.lower(): v for k, v in headers.items()}["inference-header-content-length"])
    doc = json.loads(raw[:header_length])
    assert doc["outputs"][0]["name"] == "OUTPUT0" and doc["outputs"][0]["shape"] == [1, 10]
    assert doc["outputs"][0]["parameters"] == {"binary_data_size": 40}
    got = np.frombuffer(raw[header_length:], dtype=np.float32)
    client = httpclient.InferenceServerClient(server["url"])
    try:
        tensor = httpclient.InferInput("INPUT0", [1, 256], "FP32")
        tensor.set_data_from_numpy(row[None, :])
        expected = client.infer("mlp", [tensor]).as_numpy("OUTPUT0")
    finally:
        client.close()
    np.testing.assert_allclose(got, expected.reshape(-1), rtol=1e-6)


@pytest.mark.parametrize("model,body,message", [
    ("simple", b"\0" * 64,
     "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in 'simple' model configuration"),
    ("simple_identity", b"hello", "For BYTE datatype raw input 'INPUT0', the model must have input shape [1]"),
    ("mlp", b"\0" * 10, "input byte size mismatch for input 'INPUT0' for model 'mlp'. Expected 1024, got 10"),
], ids=["two-inputs", "bytes-not-shape-1", "wrong-size"])
def test_raw_binary_requests_the_model_cannot_take(server, model, body, message):
    status, _, raw = http("POST", f"/v2/models/{model}/infer", body, {"Inference-Header-Content-Length": "0"})
    assert status == 400
    assert json.loads(raw) == {"error": message}
