"""The front's restricted API groups (--http-restricted-api, --grpc-restricted-protocol), with a
real HAProxy, tritonclient and raw sockets as clients; no Ray."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from front_stand_ins import TEST_FRONT_KEY, UNICODE_ERROR, Replica, free_port, get, http_exchange, infer, post, publish
from rayinfer.deployments.front import Front
from rayinfer.protocol.restricted_api import parse_restrictions


@pytest.fixture(scope="module")
def restricted_front(loop):
    """A front with --http-restricted-api and --grpc-restricted-protocol groups."""
    port, http_port = free_port(), free_port()
    replica = Replica(loop, "one", ingress=True)
    # The replica's listener stands in for Serve's HTTP ingress too: what the front does not
    # route is answered at once (a closed upstream port costs the front 3 s of retries).
    front = Front(("127.0.0.1", http_port, "127.0.0.1", replica.port),
                  ("127.0.0.1", port, "127.0.0.1", free_port()), "v2",
                  http_restricted=parse_restrictions(["inference,metadata:infer-key=secret",
                                                      "model-repository:admin=s3cr3t"], "--http-restricted-api"),
                  grpc_restricted=parse_restrictions(["inference:infer-key=secret"], "--grpc-restricted-protocol"),
                  direct=True, front_key=TEST_FRONT_KEY)
    # HAProxy checks the restrictions on every request: no connection goes straight to a replica.
    assert not front.direct and not front.grpc_direct
    front.http_port = http_port
    publish(loop, front, {"m/": [("127.0.0.1", replica.port)]})
    yield front, port
    front.stop()


def with_header(request: bytes, header: bytes) -> bytes:
    return request.replace(b"\r\n", b"\r\n" + header + b"\r\n", 1)


def keyed(request: bytes) -> bytes:
    """A request to a listener's port as the server's parts send it: with the front key."""
    return with_header(request, b"rayinfer-front-key: " + TEST_FRONT_KEY.encode())


def test_restricted_http_groups_need_their_header(restricted_front):
    frontend, _ = restricted_front
    port = frontend.http_port
    refused = {"inference": post("/v2/models/m/infer", b"{}"), "generate": post("/v2/models/m/generate", b"{}"),
               "generate_stream": post("/v2/models/m/versions/1/generate_stream", b"{}"), "metadata": get("/v2"),
               "model metadata": get("/v2/models/m/versions/1"), "repository": post("/v2/repository/index", b"{}")}
    for what, request in refused.items():
        reply = http_exchange(port, request)
        assert reply.startswith(b"HTTP/1.1 403") and b"content-type: application/json" in reply, what
        key = "admin" if what == "repository" else "infer-key"
        assert json.loads(reply.partition(b"\r\n\r\n")[2]) == {"error": f"This API is restricted, expecting header '{key}'"}
    # With the header (any case in its name) and its value, the request goes on to the replica.
    reply = http_exchange(port, with_header(post("/v2/models/m/infer", b"{}"), b"Infer-Key: secret"))
    assert reply.endswith(b"one POST /v2/models/m/infer 2")
    reply = http_exchange(port, with_header(post("/v2/models/m/generate_stream", b"{}"), b"infer-key: secret"))
    assert b"one POST /v2/models/m/generate_stream" in reply  # the generate extension is an inference too
    assert http_exchange(port, with_header(post("/v2/models/m/infer", b"{}"), b"infer-key: wrong")).startswith(
        b"HTTP/1.1 403")
    # The whole value counts, as at a replica's listener: not one of its comma-separated parts.
    assert http_exchange(port, with_header(post("/v2/models/m/infer", b"{}"), b"infer-key: secret, x")).startswith(
        b"HTTP/1.1 403")
    # Groups left open: health, statistics (/v2/models/stats is not a model's metadata), config.
    for path in ("/v2/health/live", "/v2/models/stats", "/v2/models/m/ready", "/v2/models/m/config"):
        assert http_exchange(port, get(path)).startswith(b"HTTP/1.1 200"), path


def test_restricted_groups_cover_the_openai_api(restricted_front):
    """As in Triton's OpenAI frontend: completions, chat and embeddings are inference, the model
    list is model-repository; refused with 401 and OpenAI's error shape."""
    frontend, _ = restricted_front
    port = frontend.http_port
    for path, key in (("/v1/chat/completions", "infer-key"), ("/v1/completions", "infer-key"),
                      ("/v1/embeddings/", "infer-key"), ("/v1/models", "admin"), ("/v1/models/m", "admin")):
        request = get(path) if path.startswith("/v1/models") else post(path, b"{}")
        reply = http_exchange(port, request)
        assert reply.startswith(b"HTTP/1.1 401") and b"content-type: application/json" in reply, path
        error = json.loads(reply.partition(b"\r\n\r\n")[2])["error"]
        assert error["type"] == "authentication_error" and key in error["message"], path
        header = b"infer-key: secret" if key == "infer-key" else b"admin: s3cr3t"
        passed = http_exchange(port, with_header(request, header))
        assert not passed.startswith(b"HTTP/1.1 401") and not passed.startswith(b"HTTP/1.1 403"), path


def test_restricted_grpc_groups_need_their_header(restricted_front):
    _, port = restricted_front
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    data = np.arange(3, dtype=np.float32).reshape(1, 3)
    with pytest.raises(InferenceServerException) as error:
        infer(client, "m", data)
    assert error.value.status() == "StatusCode.UNAVAILABLE"
    assert error.value.message() == "This protocol is restricted, expecting header 'triton-grpc-protocol-infer-key'"
    tensor = grpcclient.InferInput("X", [1, 3], "FP32")
    tensor.set_data_from_numpy(data)
    response = client.infer("m", [tensor], headers={"triton-grpc-protocol-infer-key": "secret"}).get_response()
    assert response.model_name == "one"
    with pytest.raises(InferenceServerException) as error:  # not restricted: the replica's own answer
        client.is_model_ready("m")
    assert error.value.message() == UNICODE_ERROR
    client.close()


@pytest.mark.parametrize("value,message", [
    ("inference", "--http-restricted-api option format is '<config name>:<setting>=<value>'. Got inference"),
    ("inference:key", "option format is"),
    ("inferences:k=v", "unknown restricted api 'inferences'"),
    ("inference:a b=c", "the header 'a b' and its value 'c' must be plain HTTP tokens"),
])
def test_restricted_api_values_are_checked(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_restrictions([value], "--http-restricted-api")
    with pytest.raises(ValueError, match="restricted protocol 'health' can not be specified in multiple config groups"):
        parse_restrictions(["health:a=b", "health,logging:c=d"], "--grpc-restricted-protocol")


def test_a_replicas_listener_checks_the_restrictions_itself(loop):
    """A request over a model replica's listener's port (with the front key: the front's, another
    replica's) gets the front's answers to a restricted group without its header: 403 over HTTP,
    UNAVAILABLE over gRPC."""
    replica = Replica(loop, "one")
    replica.listener.restrict(parse_restrictions(["inference,metadata:infer-key=secret"], "--http-restricted-api"),
                              parse_restrictions(["inference:infer-key=secret"], "--grpc-restricted-protocol"))
    reply = http_exchange(replica.port, keyed(post("/v2/models/m/infer", b"{}")))
    assert reply.startswith(b"HTTP/1.1 403") and json.loads(reply.partition(b"\r\n\r\n")[2]) == {
        "error": "This API is restricted, expecting header 'infer-key'"}
    assert http_exchange(replica.port, keyed(get("/v2/models/m/versions/1"))).startswith(b"HTTP/1.1 403")
    # Trailing slashes, which the routes ignore, do not take a request out of its group.
    assert http_exchange(replica.port, keyed(post("/v2/models/m/infer//", b"{}"))).startswith(b"HTTP/1.1 403")
    request = post("/v2/models/m/infer", b"{}")
    assert http_exchange(replica.port, keyed(with_header(request, b"Infer-Key: wrong"))).startswith(b"HTTP/1.1 403")
    assert http_exchange(replica.port, keyed(with_header(request, b"Infer-Key: secret"))).endswith(
        b"one POST /v2/models/m/infer 2")
    assert http_exchange(replica.port, keyed(get("/v2/models/m/ready"))).endswith(
        b"one GET /v2/models/m/ready 0")  # open
    # gRPC calls as the front relays them (HTTP/1.1): the header is triton-grpc-protocol-<key>.
    message = b"\0\0\0\0\3\x0a\x01m"  # ModelInferRequest(model_name="m"), framed
    call = post("/inference.GRPCInferenceService/ModelInfer", message, b"content-type: application/grpc\r\n")
    reply = http_exchange(replica.port, keyed(call))
    assert b"grpc-status: 14" in reply
    assert b"This protocol is restricted, expecting header 'triton-grpc-protocol-infer-key'" in reply
    reply = http_exchange(replica.port, keyed(with_header(call, b"triton-grpc-protocol-infer-key: secret")))
    assert b"grpc-status: 0" in reply
    replica.listener.restrict({}, {})
    assert http_exchange(replica.port, keyed(request)).endswith(b"one POST /v2/models/m/infer 2")
