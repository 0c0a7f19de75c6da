"""The front's acceptor (a real supervisor and HAProxy) giving gRPC connections (HTTP/2) to replica
listeners, which answer their model's calls and relay the others to HAProxy; tritonclient.grpc
as the client, the listeners of tests/front_stand_ins.py as replicas, and a grpcio server as
Serve's gRPC ingress behind the front."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import time
from concurrent import futures

import grpc
import hpack
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from front_stand_ins import TEST_FRONT_KEY, UNICODE_ERROR, Replica, free_port, infer, publish
from rayinfer.transport.replica_routes import ReplicaRoutes
from rayinfer.transport import replica_h2
from rayinfer.deployments.front import Front
from rayinfer.transport.request_heads import grpc_route_key
from rayinfer.transport.replica_h2 import H2Connection
from rayinfer.protocol.grpc_wire import DATA, END_HEADERS, END_STREAM, HEADERS, INCOMPLETE, PREFACE, frame, goaway, settings
from waiting import wait_until

_SERVICE = "inference.GRPCInferenceService"


def _serve_ingress() -> tuple[grpc.Server, int]:
    """Serve's gRPC ingress stand-in: ServerLive answers live, ModelInfer names "serve",
    ModelStreamInfer echoes each request's id and raw inputs (a request with id "fail" ends the
    stream with NOT_FOUND), RepositoryModelUnload succeeds."""

    def live(request: bytes, context) -> bytes:
        return pb.ServerLiveResponse(live=True).SerializeToString()

    def model_infer(request: bytes, context) -> bytes:
        return pb.ModelInferResponse(model_name="serve", id=pb.ModelInferRequest.FromString(request).id).SerializeToString()

    def unload(request: bytes, context) -> bytes:
        return pb.RepositoryModelUnloadResponse().SerializeToString()

    def stream(requests, context):
        for request in requests:
            infer_request = pb.ModelInferRequest.FromString(request)
            if infer_request.id == "fail":
                context.abort(grpc.StatusCode.NOT_FOUND, "Request for unknown model: 'fail' is not found")
            yield pb.ModelStreamInferResponse(
                infer_response=pb.ModelInferResponse(model_name="serve-stream", id=infer_request.id,
                                                     raw_output_contents=infer_request.raw_input_contents)
            ).SerializeToString()

    handlers = {
        "ServerLive": grpc.unary_unary_rpc_method_handler(live),
        "ModelInfer": grpc.unary_unary_rpc_method_handler(model_infer),
        "RepositoryModelUnload": grpc.unary_unary_rpc_method_handler(unload),
        "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(stream),
    }
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(_SERVICE, handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


@pytest.fixture(scope="module")
def acceptor(loop):
    ingress, ingress_port = _serve_ingress()
    port = free_port()
    front = Front(None, ("127.0.0.1", port, "127.0.0.1", ingress_port), "v2", direct=True, front_key=TEST_FRONT_KEY)
    assert front.grpc_direct
    yield front, port
    front.stop()
    ingress.stop(None)


def _h2_connections(replica: Replica) -> int:
    return sum(1 for connection in list(replica.listener._connections) if isinstance(connection, H2Connection))


def _serves_model(model: str) -> ReplicaRoutes:
    return ReplicaRoutes(model, "1")


def _replicas_of_m(loop, front: Front, *names: str, routed: int | None = None) -> list[Replica]:
    """Replicas of the model "m" named ``names``; the front routes m to the first ``routed``."""
    replicas = [Replica(loop, name) for name in names]
    for replica in replicas:
        replica.listener.routes = _serves_model("m")
    publish(loop, front, {"m/": [("127.0.0.1", replica.port) for replica in replicas[:routed]]})
    return replicas


def _first_call(path: str, message: bytes | None) -> bytes:
    """A client's first bytes: the preface, its settings, the call's headers and message."""
    block = hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", path),
                                    (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")])
    head = PREFACE + settings({}) + frame(HEADERS, END_HEADERS, 1, block)
    if message is None:
        return head
    return head + frame(DATA, END_STREAM, 1, b"\0" + len(message).to_bytes(4, "big") + message)


def test_route_keys_of_first_calls():
    infer_request = pb.ModelInferRequest(model_name="m\u00fc", model_version="3", id="x").SerializeToString()
    whole = _first_call("/inference.GRPCInferenceService/ModelInfer", infer_request)
    assert grpc_route_key(whole) == "m\u00fc/3"
    # Cut anywhere before the model's name and version have arrived: more is needed.
    for cut in (10, len(PREFACE) + 5, len(whole) - len(infer_request) - 3, len(whole) - len(infer_request) + 2):
        assert grpc_route_key(whole[:cut]) is INCOMPLETE, cut
    ready = pb.ModelReadyRequest(name="m").SerializeToString()
    assert grpc_route_key(_first_call("/inference.GRPCInferenceService/ModelReady", ready)) == "m/"
    assert grpc_route_key(_first_call("/inference.GRPCInferenceService/ServerLive", None)) == ""
    for path in ("/inference.GRPCInferenceService/RepositoryModelUnload", "/grpc.health.v1.Health/Check"):
        assert grpc_route_key(_first_call(path, None)) is None, path
    # A stream: placed by its first message's model; when that does not come in time, on any replica.
    stream = "/inference.GRPCInferenceService/ModelStreamInfer"
    assert grpc_route_key(_first_call(stream, infer_request)) == "m\u00fc/3"
    assert grpc_route_key(_first_call(stream, None)) is INCOMPLETE
    assert grpc_route_key(_first_call(stream, None), stream_message=False) == ""
    assert grpc_route_key(b"POST /v2/models/m/infer HTTP/1.1\r\n") is None


def test_a_models_connection_is_the_replicas_and_its_other_calls_are_relayed(loop, acceptor, monkeypatch):
    front, port = acceptor
    monkeypatch.setattr(replica_h2, "_RELAYED_MAX_AGE_S", 60.0)  # no turn during the test
    one, two = Replica(loop, "one"), Replica(loop, "two")
    one.listener.routes = _serves_model("m")
    publish(loop, front, {"m/": [("127.0.0.1", one.port)], "n/": [("127.0.0.1", two.port)]})
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    try:
        response = infer(client, "m", data, request_id="r1")
        assert (response.model_name, response.id) == ("one", "r1")
        assert _h2_connections(one) == 1
        # On the same connection: a server call (to Serve's ingress) and another model's (to its
        # replica) go through HAProxy; an error keeps Triton's status and message.
        assert client.is_server_live()
        assert infer(client, "n", data).model_name == "two"
        assert infer(client, "other", data).model_name == "serve"
        with pytest.raises(InferenceServerException) as failure:
            client.is_model_ready("m")
        assert failure.value.status() == "StatusCode.NOT_FOUND" and failure.value.message() == UNICODE_ERROR
        # 12 MB each way, beyond every initial flow-control window.
        big = np.random.default_rng(0).standard_normal((1, 3 * 1024 * 1024)).astype(np.float32)
        assert infer(client, "m", big).raw_output_contents[0] == big.tobytes()
        assert _h2_connections(one) == 1
    finally:
        client.close()
    wait_until(lambda: _h2_connections(one) == 0, "the replica sees the client close", 5)


def test_a_connection_opened_with_a_server_call_is_placed_by_a_later_one(loop, acceptor, monkeypatch):
    front, port = acceptor
    monkeypatch.setattr(replica_h2, "_RELAYED_MAX_AGE_S", 0.05)
    one, two = Replica(loop, "one"), Replica(loop, "two")
    one.listener.routes = _serves_model("m")
    two.listener.routes = _serves_model("n")
    publish(loop, front, {"n/": [("127.0.0.1", two.port)], "m/": [("127.0.0.1", one.port)]})
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    data = np.zeros((1, 2), np.float32)
    try:
        assert client.is_server_live()  # relayed by a replica here
        assert _h2_connections(one) + _h2_connections(two) == 1
        # It is rebalanced after the relayed call; the acceptor gives the new connection to m's replica.
        wait_until(lambda: infer(client, "m", data).model_name == "one" and _h2_connections(one) == 1
                   and _h2_connections(two) == 0, "m's calls on a connection of m's replica", 5)
    finally:
        client.close()


@contextlib.contextmanager
def _replicas_connection(loop, acceptor):
    """(replica, client, data): a client whose connection the acceptor gave m's one replica."""
    front, port = acceptor
    (one,) = _replicas_of_m(loop, front, "one")
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    data = np.zeros((1, 2), np.float32)
    try:
        assert infer(client, "m", data).model_name == "one"
        assert _h2_connections(one) == 1
        yield one, client, data
    finally:
        client.close()


def _tensor(data: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("X", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    return tensor


def _stream(client, *requests: tuple[str, np.ndarray], timeout_s: float = 10.0) -> list:
    """(response or None, error or None) of each request sent on a new stream, "m" the model."""
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for request_id, data in requests:
            client.async_stream_infer("m", [_tensor(data)], request_id=request_id)
        answers = []
        for _ in requests:
            result, error = results.get(timeout=timeout_s)
            answers.append((result.get_response() if result is not None else None, error))
            if error is not None:
                break
        return answers
    finally:
        client.stop_stream()


def test_a_replica_answers_a_stream_and_refuses_an_unload(loop, acceptor):
    with _replicas_connection(loop, acceptor) as (one, client, data):
        # The replica answers the stream on the client's connection, which stays the replica's:
        # three messages of 3 MB each way (gRPC's default limit is 4 MB), beyond every
        # flow-control window, then an error status that ends the stream.
        big = np.random.default_rng(0).standard_normal((1, 3 << 18)).astype(np.float32)
        answers = _stream(client, ("s1", data), *((f"big{k}", big) for k in range(3)), ("fail", data), ("s2", data))
        assert [(response.model_name, response.id) for response, _ in answers[:4]] == [
            ("one-stream", "s1"), ("one-stream", "big0"), ("one-stream", "big1"), ("one-stream", "big2")]
        assert all(response.raw_output_contents[0] == big.tobytes() for response, _ in answers[1:4])
        error = answers[4][1]
        assert len(answers) == 5 and answers[4][0] is None and error.status() == "StatusCode.NOT_FOUND"
        assert error.message() == "Request for unknown model: 'fail' is not found"
        assert _h2_connections(one) == 1
        assert infer(client, "m", data).model_name == "one"
        # An unload is not: the replica closes its connection to it; the client's library sends
        # it again on a new connection, which the acceptor gives HAProxy.
        client.unload_model("m")
        wait_until(lambda: _h2_connections(one) == 0, "the replica's connection closes", 5)
        assert infer(client, "m", data).model_name == "one"


def test_a_stream_the_client_cancels_is_cancelled(loop, acceptor):
    """A client that ends its stream while it is open: the replica cancels its handler, and its
    connection goes on serving."""
    with _replicas_connection(loop, acceptor) as (one, client, data):
        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("m", [_tensor(data)], request_id="c1")
        assert results.get(timeout=10)[1] is None and one.streams_open == 1
        client.stop_stream(cancel_requests=True)
        wait_until(lambda: one.streams_open == 0, "the replica to cancel the stream", 5)
        assert infer(client, "m", data).model_name == "one" and _h2_connections(one) == 1


def test_a_stream_holds_at_most_its_window_of_requests_not_taken(loop, acceptor):
    """A stream whose requests are not taken (its handler busy) gets no more window: the
    replica holds at most the stream's window of them (--grpc-stream-window) beside the one
    message that arrived whole, and answers all once the handler goes on."""
    with _replicas_connection(loop, acceptor) as (one, client, data):
        window = one.listener.limits.stream_window_bytes
        big = np.zeros((1, 1 << 18), np.float32)  # 1 MiB a message
        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        try:
            client.async_stream_infer("m", [_tensor(data)], request_id="hold")
            for k in range(8):
                client.async_stream_infer("m", [_tensor(big)], request_id=f"big{k}")
            assert one.slow_arrived.wait(10)
            # The client sends until the stream's window is used up.
            wait_until(lambda: _stream_windows_left(one) == [0], "the client to use up the stream's window", 10)
            assert one.listener.held_bytes <= window + big.nbytes + 1024  # the window, and one message taken in whole
            one.release_slow()
            answers = [results.get(timeout=10) for _ in range(9)]
            assert [error for _, error in answers] == [None] * 9
            assert [result.get_response().id for result, _ in answers] == ["hold"] + [f"big{k}" for k in range(8)]
        finally:
            client.stop_stream()
        wait_until(lambda: one.listener.held_bytes == 0, "the stream's bytes released", 5)


def test_a_refused_call_finds_the_connection_open_until_the_client_closes_it(loop, acceptor):
    """A replica that refuses a call (GOAWAY: an unload) ends the connection with FIN and reads
    on: the frames the client sent meanwhile (the call's message) are dropped, not answered with
    a reset, so the client reads the GOAWAY and sends the call again elsewhere (grpc failed it
    with "Stream removed (sendmsg: Broken pipe)" when its next write met a closed socket)."""
    import socket

    front, port = acceptor
    _replicas_of_m(loop, front, "one")
    request = pb.ModelInferRequest(model_name="m", id="r1").SerializeToString()
    unload = pb.RepositoryModelUnloadRequest(model_name="m").SerializeToString()
    with socket.create_connection(("127.0.0.1", port), 5) as sock:
        sock.sendall(_first_call(f"/{_SERVICE}/ModelInfer", request))
        received = b""
        while b"one" not in received:  # the replica's answer (the acceptor's preface and its own come first)
            chunk = sock.recv(65536)
            assert chunk, f"the connection closed before the replica answered: {received!r}"
            received += chunk
        call = hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"),
                                       (":path", f"/{_SERVICE}/RepositoryModelUnload"), (":authority", "x"),
                                       ("content-type", "application/grpc"), ("te", "trailers")])
        sock.sendall(frame(HEADERS, END_HEADERS, 3, call))
        sock.settimeout(5)
        while chunk := sock.recv(65536):  # up to the replica's FIN, after its GOAWAY
            received += chunk
        # The call's message, sent after that (as a client that has not read the GOAWAY yet
        # does), and more: none meets a reset.
        message = b"\0" + len(unload).to_bytes(4, "big") + unload
        for _ in range(5):
            sock.sendall(frame(DATA, 0, 3, message))
        assert sock.recv(65536) == b""
    # The GOAWAY names call 1 the last one taken, after its answer; nothing follows it (no reset,
    # no answer to the refused call), then FIN.
    assert received.endswith(goaway(1)) and received.index(goaway(1)) > received.index(b"one")


def test_a_stopping_replica_closes_its_connections_gracefully(loop, acceptor):
    front, port = acceptor
    one, two = _replicas_of_m(loop, front, "one", "two", routed=1)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    data = np.zeros((1, 2), np.float32)
    try:
        assert infer(client, "m", data).model_name == "one"
        publish(loop, front, {"m/": [("127.0.0.1", two.port)]})
        closing = asyncio.run_coroutine_threadsafe(one.listener.close(5.0), loop)
        # No call fails: the client goes on over a new connection, to the other replica.
        served = {infer(client, "m", data).model_name for _ in range(20)}
        closing.result(10)
        assert "two" in served and _h2_connections(one) == 0
    finally:
        client.close()


def test_connections_take_turns_over_the_replicas(loop, acceptor, monkeypatch):
    front, port = acceptor
    monkeypatch.setattr(replica_h2, "_MAX_CONNECTION_AGE_S", 0.05)
    one, two = _replicas_of_m(loop, front, "one", "two")
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    data = np.zeros((1, 2), np.float32)
    try:
        served: set[str] = set()

        def both_served() -> bool:  # calls until a turn has come (calls take well under a turn)
            served.add(infer(client, "m", data).model_name)
            return served == {"one", "two"}

        wait_until(both_served, "a connection to be rebalanced to the other replica", 10)
    finally:
        client.close()


def test_a_stream_started_on_a_replicas_connection_gets_every_message_answered(loop, acceptor, monkeypatch):
    """A stream started on a connection a replica holds, its messages sent a millisecond or so
    apart: every one is answered, in order. (Refused with GOAWAY, grpc's C core sends such a
    stream again on a new connection, and drops a message now and then when some were sent
    before the GOAWAY came and some after: the stream then waits forever for its answer.)"""
    import random

    front, port = acceptor
    (one,) = _replicas_of_m(loop, front, "one")
    data = np.zeros((1, 2), np.float32)
    tensor = _tensor(data)
    pace = random.Random(0)
    headers = H2Connection._headers

    def busy(connection: H2Connection, stream: int, flags: int, block: bytes) -> None:
        # The replica's event loop busy when the stream's headers come, as a loaded replica's
        # is: some of the stream's messages are sent before it reads them, some after.
        if stream == 3:
            time.sleep(pace.random() * 0.002)
        headers(connection, stream, flags, block)

    monkeypatch.setattr(H2Connection, "_headers", busy)
    for round_ in range(12):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")  # a new connection: the replica's
        try:
            assert infer(client, "m", data).model_name == "one"
            results: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: results.put((result, error)))
            for k in range(6):
                client.async_stream_infer("m", [tensor], request_id=f"{round_}.{k}")
                time.sleep(pace.random() * 0.001)
            answers = []
            for _ in range(6):
                try:
                    answers.append(results.get(timeout=5))
                except queue.Empty:
                    break
            client.stop_stream()
        finally:
            client.close()
        assert [error for _, error in answers] == [None] * len(answers)
        assert [result.get_response().id for result, _ in answers] == [f"{round_}.{k}" for k in range(6)]


def _stream_windows_left(replica: Replica) -> list[int]:
    """What the client may still send on each stream the replica's connections hold."""
    return [call.recv_window for connection in list(replica.listener._connections)
            if isinstance(connection, H2Connection) for call in list(connection._calls.values()) if call.stream]


@pytest.mark.parametrize("message_late", [False, True], ids=["at-once", "after-the-peek-wait"])
def test_a_connection_that_starts_with_a_stream_goes_to_a_replica(loop, acceptor, message_late):
    """A new connection whose first call is a stream goes to a replica of the model its first
    message names; one whose first message comes after the acceptor's peek wait (0.5 s) to any
    replica here: either way the replica answers it, not HAProxy's way to the /v2 replica."""
    front, port = acceptor
    (one,) = _replicas_of_m(loop, front, "one")
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    results: queue.Queue = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        if message_late:  # a client waiting for its user: the acceptor places the stream without its message
            wait_until(lambda: _h2_connections(one) == 1, "the acceptor to give the stream's connection a replica", 5)
        for k in range(2):
            client.async_stream_infer("m", [_tensor(np.zeros((1, 2), np.float32))], request_id=f"r{k}")
        answers = [results.get(timeout=10) for _ in range(2)]
        assert [(result.get_response().model_name, error) for result, error in answers] == [("one-stream", None)] * 2
        assert _h2_connections(one) == 1
        client.stop_stream()
    finally:
        client.close()
