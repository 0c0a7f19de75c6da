"""The front (a real HAProxy) relaying unmodified gRPC calls and v2 HTTP infer requests to
replica listeners over HTTP/1.1, with tritonclient and raw sockets as clients; no Ray: the
listeners answer from plain handlers."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections import Counter

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc
from tritonclient.utils import InferenceServerException

from front_stand_ins import (
    TEST_FRONT_KEY,
    UNICODE_ERROR,
    Replica,
    free_port,
    get,
    http_exchange,
    infer,
    post,
    publish,
    refuses_connections,
)
from rayinfer.deployments import grpc_service
from rayinfer.deployments.front import Front
from rayinfer.transport.front_config import EVENTS_RING
from rayinfer.transport.front_supervisor import stop_fronts
from rayinfer.protocol.grpc_wire import grpc_message_header, unframe
from rayinfer.serving.sequence_routing import SLOTS, slot_of
from conftest import front_command
from waiting import wait_until


@pytest.fixture(scope="module")
def front(loop):
    port, http_port = free_port(), free_port()
    # Nothing listens upstream: what the front does not route fails with UNAVAILABLE (503).
    front = Front(("127.0.0.1", http_port, "127.0.0.1", free_port()),
                  ("127.0.0.1", port, "127.0.0.1", free_port()), "v2", front_key=TEST_FRONT_KEY)
    front.http_port = http_port
    yield front, port
    front.stop()


def test_routed_calls_reach_the_listeners_and_balance(loop, front):
    frontend, port = front
    one, two = Replica(loop, "one"), Replica(loop, "two")
    publish(loop, frontend, {"m/": [("127.0.0.1", one.port)], "pair/": [("127.0.0.1", one.port), ("127.0.0.1", two.port)]})
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    data = np.arange(6, dtype=np.float32).reshape(2, 3)
    response = infer(client, "m", data, request_id="req-7")
    assert (response.model_name, response.id) == ("one", "req-7")
    assert np.frombuffer(response.raw_output_contents[0], np.float32).tolist() == data.ravel().tolist()
    served = Counter(infer(client, "pair", data).model_name for _ in range(60))
    assert set(served) == {"one", "two"} and min(served.values()) >= 10, served
    # 12 MB each way through HAProxy's HTTP/2 -> HTTP/1.1 relay.
    big = np.random.default_rng(0).standard_normal((1, 3 * 1024 * 1024)).astype(np.float32)
    assert infer(client, "m", big).raw_output_contents[0] == big.tobytes()
    client.close()


def test_calls_go_to_the_replica_with_fewer_calls_in_flight(loop, front):
    """Two replicas of a version, a call held in flight on one of them: every further call goes
    to the other (the front draws two different replicas and takes the less busy one)."""
    frontend, port = front
    one, two = Replica(loop, "one"), Replica(loop, "two")
    two.release_slow()  # 'two' answers at once; 'one' holds its calls until released
    publish(loop, frontend, {"slow/": [("127.0.0.1", one.port), ("127.0.0.1", two.port)]})
    clients = [grpcclient.InferenceServerClient(f"127.0.0.1:{port}") for _ in range(2)]
    data = np.zeros((1, 1), np.float32)
    tensor = grpcclient.InferInput("X", [1, 1], "FP32")
    tensor.set_data_from_numpy(data)
    threads: list[threading.Thread] = []
    try:
        while one.slow_calls == 0:  # while both are idle a call lands on either: until one is held
            threads.append(threading.Thread(target=infer, args=(clients[0], "slow", data)))
            threads[-1].start()
            wait_until(lambda: one.slow_calls == 1 or not threads[-1].is_alive(), "the call to be answered or held",
                       timeout_s=10)
        # A call the front sent to 'one' would be held: it fails after 10 s instead.
        answered = Counter(clients[1].infer("slow", [tensor], client_timeout=10).get_response().model_name
                           for _ in range(20))
        assert answered == {"two": 20}
    finally:
        one.release_slow()
        for thread in threads:
            thread.join(10)
    # Idle again: both replicas get calls.
    assert set(infer(clients[1], "slow", data).model_name for _ in range(40)) == {"one", "two"}
    for client in clients:
        client.close()


def test_errors_keep_their_status_and_message(loop, front):
    frontend, port = front
    one = Replica(loop, "one")
    publish(loop, frontend, {"m/": [("127.0.0.1", one.port)]})
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    with pytest.raises(InferenceServerException) as error:
        client.is_model_ready("m")
    assert error.value.status() == "StatusCode.NOT_FOUND" and error.value.message() == UNICODE_ERROR
    with pytest.raises(InferenceServerException) as error:
        client.get_model_config("m")
    assert error.value.status() == "StatusCode.INTERNAL" and "no ModelConfig here" in error.value.message()
    client.close()


def test_withdrawn_routes_are_not_used_and_calls_in_flight_finish(loop, front):
    frontend, port = front
    one = Replica(loop, "one")
    publish(loop, frontend, {"slow/": [("127.0.0.1", one.port)]})
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    results: list = []
    slow = threading.Thread(target=lambda: results.append(infer(client, "slow", np.zeros((1, 1), np.float32))))
    slow.start()
    try:
        assert one.slow_arrived.wait(10), "the slow call did not reach the replica's handler"
        publish(loop, frontend, {})
        # The listener stops accepting at once and waits (up to its grace period, far longer than
        # this test takes) for the call in flight, which answers when released.
        closing = asyncio.run_coroutine_threadsafe(one.listener.close(30.0), loop)
        wait_until(lambda: refuses_connections(one.port), "the closing listener to stop accepting", timeout_s=10)
        assert not closing.done() and not results
    finally:  # the held call answers even when an assertion above fails
        one.release_slow()
    closing.result(10)
    slow.join(10)
    assert results and results[0].model_name == "one"
    # No route any more: the call goes to the (absent) /v2 upstream instead of the closed listener.
    with pytest.raises(InferenceServerException) as error:
        infer(client, "slow", np.zeros((1, 1), np.float32))
    assert error.value.status() == "StatusCode.UNAVAILABLE"
    client.close()


def test_http_infer_requests_are_routed_by_path(loop, front):
    frontend, _ = front
    one, two = Replica(loop, "one"), Replica(loop, "two")
    publish(loop, frontend, {"m/": [("127.0.0.1", one.port)], "m\u00fc/2": [("127.0.0.1", two.port)]})
    port = frontend.http_port
    assert http_exchange(port, post("/v2/models/m/infer", b"{}")).endswith(b"one POST /v2/models/m/infer 2")
    # The version from the path, the model name %-decoded; query strings do not matter.
    reply = http_exchange(port, post("/v2/models/m%C3%BC/versions/2/infer?a=1", b"12345"))
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"two POST /v2/models/m%C3%BC/versions/2/infer 5")
    # Errors keep Triton's status and body.
    reply = http_exchange(port, post("/v2/models/m/infer", b"x-fail"))
    assert reply.startswith(b"HTTP/1.1 404") and b"content-type: application/json" in reply
    assert json.loads(reply.partition(b"\r\n\r\n")[2]) == {"error": "Request for unknown model: 'x' is not found"}
    # A client that waits for "100 Continue" gets it from the listener before sending the body.
    with socket.create_connection(("127.0.0.1", port), 5) as sock:
        sock.sendall(b"POST /v2/models/m/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n"
                     b"expect: 100-continue\r\nconnection: close\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 100")
        sock.sendall(b"abc")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.endswith(b"one POST /v2/models/m/infer 3")
    # Not an infer request, an unrouted version, or a GET of infer: Serve's ingress (absent here: 503).
    for request in (post("/v2/models/m/versions/7/infer", b"{}"), post("/v2/models/m", b"{}"),
                    get("/v2/models/m/infer")):
        assert http_exchange(port, request).startswith(b"HTTP/1.1 503"), request
    # A GET of a routed model's metadata, readiness, config or statistics: its replica.
    for path in ("/v2/models/m", "/v2/models/m/ready", "/v2/models/m/config", "/v2/models/m/stats/"):
        assert http_exchange(port, get(path)).endswith(b"one GET " + path.encode() + b" 0"), path
    assert http_exchange(port, get("/v2/models/m%C3%BC/versions/2/ready")).endswith(
        b"two GET /v2/models/m%C3%BC/versions/2/ready 0")


def test_sequence_requests_go_to_their_slots_replica(loop, front):
    """A sequence model's version has a listener per routing slot: a call naming a sequence goes
    to the slot's replica (HAProxy's CRC-32 of the id must be the replicas' own, zlib's), over
    gRPC and HTTP (JSON alone, or a JSON header before binary data); the others to any."""
    frontend, port = front
    replicas = [Replica(loop, name) for name in ("a", "b", "c")]
    slots = [replicas[(slot * 7) % 3] for slot in range(SLOTS)]  # not in blocks: any slot counts
    asyncio.run_coroutine_threadsafe(frontend.publish(
        {"seq/": [("127.0.0.1", r.port) for r in slots]}, frozenset({"seq/"})), loop).result(10)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    tensor = grpcclient.InferInput("X", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 1), np.float32))
    ids: list[int | str] = [1, 2, 3, 17, 64, 1000, 2**40 + 5, "a", "sequence-7", "\u00fc-9", 'q"\\/\t\U0001f600']
    for sequence_id in ids:
        expected = slots[slot_of(sequence_id)].name
        for start in (True, False):
            served = client.infer("seq", [tensor], sequence_id=sequence_id, sequence_start=start).get_response()
            assert served.model_name == expected, (sequence_id, start)
        for body, extra in _http_sequence_bodies(sequence_id):
            reply = http_exchange(frontend.http_port, post("/v2/models/seq/infer", body, extra))
            assert reply.split(b"\r\n\r\n", 1)[1].startswith(expected.encode() + b" POST"), (sequence_id, body)
    unnamed = Counter(client.infer("seq", [tensor]).get_response().model_name for _ in range(30))
    assert len(unnamed) > 1, unnamed
    client.close()


def _http_sequence_bodies(sequence_id: int | str) -> list[tuple[bytes, bytes]]:
    header = json.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 1],
                                     "parameters": {"binary_data_size": 4}}],
                         "parameters": {"sequence_start": False, "sequence_id": sequence_id}},
                        ensure_ascii=False).encode()
    plain = json.dumps({"parameters": {"sequence_id": sequence_id}, "inputs": []}, ensure_ascii=False).encode()
    # JSON escapes, as tritonclient writes a string id (\u escapes for anything not ASCII).
    escaped = json.dumps({"inputs": [], "parameters": {"sequence_id": sequence_id}}).encode()
    # Binary data that looks like another id must not count.
    binary = header + b'"sequence_id": 999'
    return [(plain, b""), (escaped, b""), (binary, b"inference-header-content-length: %d\r\n" % len(header))]


def test_unrouted_model_gets_go_to_the_v2_application(loop):
    """A model GET with no replica gets the /v2 application's prefix on its way to Serve's
    ingress (here a listener that echoes the path); other requests keep their path."""
    ingress, one = Replica(loop, "ingress", ingress=True), Replica(loop, "one")
    http_port = free_port()
    frontend = Front(("127.0.0.1", http_port, "127.0.0.1", ingress.port), None, "v2", front_key=TEST_FRONT_KEY)
    try:
        publish(loop, frontend, {"m/": [("127.0.0.1", one.port)]})
        assert http_exchange(http_port, get("/v2/models/m/ready")).endswith(b"one GET /v2/models/m/ready 0")
        for path in ("/v2/models/loading/ready", "/v2/models/loading", "/v2/models/m/versions/3/config",
                     "/v2/models/stats"):
            reply = http_exchange(http_port, get(path))
            assert reply.endswith(b"ingress GET /v2/unrouted" + path.encode() + b" 0"), reply
        for request, echoed in ((get("/v2/health/ready"), b"ingress GET /v2/health/ready 0"),
                                (post("/v2/models/loading/infer", b"{}"), b"ingress POST /v2/models/loading/infer 2"),
                                (get("/v2"), b"ingress GET /v2 0")):
            assert http_exchange(http_port, request).endswith(echoed), request
    finally:
        frontend.stop()


def test_framing_and_message_encoding():
    assert unframe(b"\x00\x00\x00\x00\x02hi", None) == b"hi"
    import gzip

    packed = gzip.compress(b"hello")
    assert unframe(b"\x01" + len(packed).to_bytes(4, "big") + packed, b"gzip") == b"hello"
    with pytest.raises(Exception, match="exactly one message"):
        unframe(b"\x00\x00\x00\x00\x05hi", None)
    assert grpc_message_header("a 100% \u00fc") == b"a 100%25 %C3%BC"


def test_a_new_front_with_the_same_settings_takes_the_running_one_over(loop):
    """A /v2 replica started again (after a crash) finds the front still serving: it takes it
    over, routes and all, instead of stopping it; one with other settings replaces it."""
    port, http_port = free_port(), free_port()
    endpoints = (("127.0.0.1", http_port, "127.0.0.1", free_port()), ("127.0.0.1", port, "127.0.0.1", free_port()))
    first = Front(*endpoints, "v2", front_key=TEST_FRONT_KEY)
    replica = Replica(loop, "one")
    publish(loop, first, {"m/": [("127.0.0.1", replica.port)]})
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    data = np.ones((1, 3), dtype=np.float32)
    second = Front(*endpoints, "v2", front_key=TEST_FRONT_KEY)
    assert second._dir == first._dir and second.running and second.published == first.published
    assert infer(client, "m", data).model_name == "one"  # the same HAProxy kept serving
    # A route the new owner has not been told of yet is kept for a few seconds.
    publish(loop, second, {})
    assert second.published == first.published
    third = Front(*endpoints, "v2", max_input_size=1000, front_key=TEST_FRONT_KEY)  # other settings: a new HAProxy
    assert third._dir != first._dir and not first.running and third.running
    publish(loop, third, {"m/": [("127.0.0.1", replica.port)]})
    assert infer(client, "m", data).model_name == "one"
    # A front an earlier server left (its node file names another Ray node) is never taken over:
    # its routes lead to that server's replicas.
    (third._dir / "node").write_text("an earlier server's node")
    fourth = Front(*endpoints, "v2", max_input_size=1000, front_key=TEST_FRONT_KEY)
    assert fourth._dir != third._dir and not third.running and fourth.running
    client.close()
    stop_fronts([("127.0.0.1", http_port)])  # what the CLI does as it stops
    assert not fourth.running and refuses_connections(port) and not fourth._dir.exists()


def test_a_front_is_taken_over_only_with_the_same_acceptor_ports(loop):
    """HAProxy's configuration does not name the ports the acceptor owns: a new front with the
    same HTTP port but another gRPC port starts a front of its own; one with the same ports
    takes the running one over."""
    http_port, grpc_port, other_grpc_port = free_port(), free_port(), free_port()
    upstream_http, upstream_grpc = free_port(), free_port()

    def front(grpc: int) -> Front:
        return Front(("127.0.0.1", http_port, "127.0.0.1", upstream_http), ("127.0.0.1", grpc, "127.0.0.1", upstream_grpc),
                     "v2", direct=True, front_key=TEST_FRONT_KEY)

    first = front(grpc_port)
    second = front(other_grpc_port)
    assert second._dir != first._dir and not first.running and second.running
    assert refuses_connections(grpc_port) and not refuses_connections(other_grpc_port)
    third = front(other_grpc_port)
    assert third._dir == second._dir and third.running
    stop_fronts([("127.0.0.1", http_port)])
    assert not third.running and refuses_connections(other_grpc_port)


def test_an_orphaned_front_stops_after_its_grace_period(loop, monkeypatch):
    monkeypatch.setenv("RAYINFER_FRONT_ORPHAN_GRACE_S", "0.5")
    http_port = free_port()
    front = Front(("127.0.0.1", http_port, "127.0.0.1", free_port()), None, "v2", front_key=TEST_FRONT_KEY)
    (front._dir / "owner").write_text("999999999")  # an owner that is gone
    wait_until(lambda: not front.running, "the orphaned front to stop", timeout_s=10)
    assert refuses_connections(http_port)
    (front._dir / "owner").write_text(str(os.getpid()))
    front.stop()  # removes its folder


def test_calls_over_the_inflight_limit_are_refused_at_once(loop):
    """--max-inflight-requests counts the calls relayed to replicas over both ports; one more is
    answered at once (503 over HTTP, UNAVAILABLE over gRPC) and the limit frees as calls end."""
    port, http_port = free_port(), free_port()
    replica = Replica(loop, "one", ingress=True)  # Serve's HTTP ingress too
    front = Front(("127.0.0.1", http_port, "127.0.0.1", replica.port),
                  ("127.0.0.1", port, "127.0.0.1", free_port()), "v2", max_inflight=2, front_key=TEST_FRONT_KEY)
    publish(loop, front, {"slow/": [("127.0.0.1", replica.port)], "m/": [("127.0.0.1", replica.port)]})
    data = np.zeros((1, 1), np.float32)
    clients = [grpcclient.InferenceServerClient(f"127.0.0.1:{port}") for _ in range(2)]
    held: list = []
    # Both held calls on one HTTP/2 connection: the limit counts calls, not connections.
    threads = [threading.Thread(target=lambda: held.append(infer(clients[0], "slow", data))) for _ in range(2)]
    try:
        for thread in threads:
            thread.start()
        wait_until(lambda: replica.slow_calls == 2, "two calls held in flight", timeout_s=10)
        busy = "Server is busy: 2 inference requests are in flight, the limit set by --max-inflight-requests. Retry later."
        with pytest.raises(InferenceServerException) as error:
            infer(clients[1], "m", data)
        assert (error.value.status(), error.value.message()) == ("StatusCode.UNAVAILABLE", busy)
        reply = http_exchange(http_port, post("/v2/models/m/infer", b"{}"))
        assert reply.startswith(b"HTTP/1.1 503") and b"content-type: application/json" in reply
        assert json.loads(reply.partition(b"\r\n\r\n")[2]) == {"error": busy}
        # What is not relayed to a replica (health, the server's own endpoints) is not counted.
        assert http_exchange(http_port, get("/v2/health/live")).startswith(b"HTTP/1.1 200")
    finally:  # the held calls answer even when an assertion above fails
        replica.release_slow()
        for thread in threads:
            thread.join(10)
    assert [r.model_name for r in held] == ["one", "one"]
    assert infer(clients[1], "m", data).model_name == "one"
    assert http_exchange(http_port, post("/v2/models/m/infer", b"{}")).startswith(b"HTTP/1.1 200")
    for client in clients:
        client.close()
    front.stop()



def test_a_call_routed_to_a_dead_listener_fails_fast(loop, front):
    """A replica that died refuses connections: its calls get 503 / UNAVAILABLE after one retry
    (about a second), not after three."""
    import time

    frontend, port = front
    publish(loop, frontend, {"gone/": [("127.0.0.1", free_port())]})
    start = time.monotonic()
    reply = http_exchange(frontend.http_port, post("/v2/models/gone/infer", b"{}"))
    assert reply.startswith(b"HTTP/1.1 503") and b'"error":"Service Unavailable' in reply
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    with pytest.raises(InferenceServerException) as error:
        infer(client, "gone", np.zeros((1, 1), np.float32))
    assert error.value.status() == "StatusCode.UNAVAILABLE"
    client.close()
    assert time.monotonic() - start < 4.0  # two calls; three retries a second apart took 6 s


def test_the_fronts_abnormal_sessions_are_kept_for_its_admin_socket(loop, front):
    """``show events abnormal`` lists the front's sessions that failed (here a call whose
    replica is gone: 503), with HAProxy's termination state, server and status, and not the
    calls that went well."""
    frontend, port = front
    publish(loop, frontend, {"ok/": [("127.0.0.1", Replica(loop, "ok").port)], "lost/": [("127.0.0.1", free_port())]})
    assert http_exchange(frontend.http_port, post("/v2/models/ok/infer", b"{}")).startswith(b"HTTP/1.1 200")
    assert http_exchange(frontend.http_port, post("/v2/models/lost/infer", b"{}")).startswith(b"HTTP/1.1 503")
    wait_until(lambda: "/v2/models/lost/infer" in front_command(frontend._dir, f"show events {EVENTS_RING}"),
               "the failed request in the front's ring of abnormal sessions", timeout_s=10)
    events = front_command(frontend._dir, f"show events {EVENTS_RING}")
    (line,) = [line for line in events.splitlines() if "/v2/models/lost/infer" in line]
    # "SC": the server side refused the connection, at its connect stage.
    assert " 503 " in line and "triton_http replica/listener" in line and " SC" in line
    assert "/v2/models/ok/infer" not in events


class _V2StandIn(service_pb2_grpc.GRPCInferenceServiceServicer):
    """A gRPC server standing in for the /v2 replica's (or Serve's ingress): ServerMetadata
    answers its name, ModelStreamInfer answers each request with a response naming it."""

    def __init__(self, name: str):
        self.name = name

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name=self.name)

    async def ModelStreamInfer(self, requests, context):
        async for request in requests:
            yield pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse(model_name=self.name, id=request.id))


def _stand_in_server(loop, name: str, address: str, register):
    async def start():
        server = grpc.aio.server()
        register(_V2StandIn(name), server)
        port = server.add_insecure_port(address)
        await server.start()
        return server, port

    return asyncio.run_coroutine_threadsafe(start(), loop).result(10)


def test_the_v2_applications_grpc_calls_skip_serves_ingress_once_the_replica_gives_its_port(loop, monkeypatch):
    """Streams and the other calls of the /v2 application go to the port the /v2 replica's gRPC
    server took on 127.0.0.1 (grpc_service.want_loopback_port) once the replica gives it to the
    front; to Serve's ingress before that, and again within seconds of that server going away."""
    monkeypatch.setitem(grpc_service._LOOPBACK, "wanted", False)
    monkeypatch.setitem(grpc_service._LOOPBACK, "port", None)
    ingress, ingress_port = _stand_in_server(loop, "ingress", "127.0.0.1:0",
                                             service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server)
    grpc_service.want_loopback_port()
    # The replica's server as Serve starts it: its own port, then the servicer function.
    v2, _ = _stand_in_server(loop, "v2", "[::]:0", grpc_service.add_servicer_to_server)
    v2_port = grpc_service.loopback_port()
    assert v2_port
    port = free_port()
    frontend = Front(None, ("127.0.0.1", port, "127.0.0.1", ingress_port), "v2", front_key=TEST_FRONT_KEY)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")

    def stream_answers() -> list[tuple[str, str]]:
        answers = []
        stream = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        stream.start_stream(callback=lambda result, error: answers.append(
            (result.get_response().model_name, result.get_response().id) if error is None else error))
        for n in range(3):
            stream.async_stream_infer("m", [], request_id=str(n))
        wait_until(lambda: len(answers) == 3, 10)
        stream.stop_stream()
        stream.close()
        return answers

    try:
        assert client.get_server_metadata().name == "ingress"
        assert stream_answers() == [("ingress", "0"), ("ingress", "1"), ("ingress", "2")]
        asyncio.run_coroutine_threadsafe(frontend.use_v2_port(v2_port), loop).result(10)
        assert client.get_server_metadata().name == "v2"
        assert stream_answers() == [("v2", "0"), ("v2", "1"), ("v2", "2")]
        # The /v2 replica stops: the next call finds its port refusing and goes to the ingress.
        asyncio.run_coroutine_threadsafe(v2.stop(None), loop).result(10)
        started = time.monotonic()
        assert client.get_server_metadata().name == "ingress"
        assert time.monotonic() - started < 3
        assert stream_answers() == [("ingress", "0"), ("ingress", "1"), ("ingress", "2")]
    finally:
        client.close()
        frontend.stop()
        asyncio.run_coroutine_threadsafe(ingress.stop(None), loop).result(10)
