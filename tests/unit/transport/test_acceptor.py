"""The front's acceptor (a real supervisor and HAProxy) giving HTTP connections to replica listeners,
which answer their own requests and relay the others to HAProxy; raw sockets as clients, the
listeners of tests/front_stand_ins.py as replicas and as Serve's ingress behind the front."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from front_stand_ins import TEST_FRONT_KEY, Replica, free_port, publish
from rayinfer.transport.replica_routes import ReplicaRoutes
from rayinfer.deployments.front import Front
from rayinfer.transport.acceptor import listening_socket
from rayinfer.transport.request_heads import route_key
from waiting import wait_until


@pytest.fixture(scope="module")
def acceptor(loop):
    serve = Replica(loop, "serve", ingress=True)  # what HAProxy relays when no replica's route matches
    http_port = free_port()
    front = Front(("127.0.0.1", http_port, "127.0.0.1", serve.port), None, "v2", direct=True, front_key=TEST_FRONT_KEY)
    assert front.direct
    yield front, http_port
    front.stop()


class _ServesModel(ReplicaRoutes):
    """A replica of ``model`` that answers every request under /v2/models/<model>/ itself."""

    def serves(self, method: str, path: str, key: str, turn: object, headers: list) -> bool:
        return path.startswith(f"/v2/models/{self.model}/")


def _serves_model(model: str) -> ReplicaRoutes:
    return _ServesModel(model, "1")


class _Client:
    """One keep-alive HTTP/1.1 connection to the front."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), 5)
        self._buffer = b""

    def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
        self.sock.sendall(b"%b %b HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%b"
                          % (method.encode(), path.encode(), len(body), body))
        return self.request_sent()

    def request_sent(self) -> tuple[int, dict[str, str], bytes]:
        """The answer to the request sent last."""
        while b"\r\n\r\n" not in self._buffer:
            self._read()
        head, _, self._buffer = self._buffer.partition(b"\r\n\r\n")
        status_line, *lines = head.decode().split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        length = int(headers["content-length"])
        while len(self._buffer) < length:
            self._read()
        body, self._buffer = self._buffer[:length], self._buffer[length:]
        return int(status_line.split()[1]), headers, body

    def _read(self) -> None:
        chunk = self.sock.recv(65536)
        assert chunk, "the server closed the connection"
        self._buffer += chunk

    def close(self) -> None:
        self.sock.close()


def _direct_connections(replica: Replica) -> int:
    return sum(1 for connection in list(replica.listener._connections) if connection._direct is not None)


def test_route_keys_of_request_lines():
    assert route_key(b"POST /v2/models/m/infer HTTP/1.1\r\n") == "m/"
    assert route_key(b"POST /v2/models/m/versions/3/infer?x=1 HTTP/1.1\r\nhost: a\r\n") == "m/3"
    assert route_key(b"POST /v2/models/m%C3%BC/infer HTTP/1.1\r\n") == "m\u00fc/"
    for action in ("", "/ready", "/config", "/stats"):
        assert route_key(f"GET /v2/models/m/versions/2{action} HTTP/1.1\r\n".encode()) == "m/2"
    for line in (b"GET /v2/models/stats HTTP/1.1", b"GET /v2/health/ready HTTP/1.1", b"PUT /v2/models/m/infer HTTP/1.1",
                 b"POST /v2/models/m/ready HTTP/1.1"):
        assert route_key(line + b"\r\n") == "", line  # not a model's request
    for line in (b"POST /v2/models/m/infer", b"\x16\x03\x01 garbage", b"PRI * HTTP/2.0"):
        assert route_key(line + b"\r\n") is None, line  # not HTTP/1.x


def test_a_models_connection_is_the_replicas_and_its_other_requests_are_relayed(loop, acceptor):
    front, port = acceptor
    one = Replica(loop, "one")
    one.listener.routes = _serves_model("m")
    publish(loop, front, {"m/": [("127.0.0.1", one.port)], "n/": [("127.0.0.1", one.port)]})
    client = _Client(port)
    try:
        status, _, body = client.request("POST", "/v2/models/m/infer", b"abcd")
        assert (status, body) == (200, b"one POST /v2/models/m/infer 4")
        assert _direct_connections(one) == 1
        # On the same connection: the /v2 API and a model the replica does not serve go through
        # HAProxy (to Serve's ingress, and to the model's route), a large body included.
        status, _, body = client.request("GET", "/v2/health/ready")
        assert (status, body) == (200, b"serve GET /v2/health/ready 0")
        big = b"x" * 3_000_000
        assert client.request("POST", "/v2/models/n/infer", big)[2] == b"one POST /v2/models/n/infer 3000000"
        assert client.request("POST", "/v2/models/m/infer", b"ab")[2] == b"one POST /v2/models/m/infer 2"
        assert _direct_connections(one) == 1
    finally:
        client.close()


def test_a_connection_opened_with_another_request_is_placed_by_its_next_one(loop, acceptor):
    """A replica relays the first request (not a model's) and gives the connection back; the
    acceptor gives it to the replica of the model its next request names."""
    front, port = acceptor
    one, two = Replica(loop, "one"), Replica(loop, "two")
    one.listener.routes = _serves_model("m")
    two.listener.routes = _serves_model("n")
    publish(loop, front, {"m/": [("127.0.0.1", one.port)], "n/": [("127.0.0.1", two.port)]})
    client = _Client(port)
    try:
        assert client.request("GET", "/v2")[2] == b"serve GET /v2 0"
        # The replica gives the connection back once the relayed answer has ended (HAProxy closed
        # its side); a next request sent before that is relayed by it too.
        wait_until(lambda: _direct_connections(one) == 0, "the connection to be given back", 5)
        assert client.request("POST", "/v2/models/n/infer", b"a")[2] == b"two POST /v2/models/n/infer 1"
        assert (_direct_connections(one), _direct_connections(two)) == (0, 1)
        # Another model's request on it: relayed, then the connection moves to that model's
        # replica with the next request sent once it has been given back.
        assert client.request("POST", "/v2/models/m/infer", b"a")[2] == b"one POST /v2/models/m/infer 1"
        wait_until(lambda: _direct_connections(two) == 0, "the connection to be given back", 5)
        assert client.request("POST", "/v2/models/m/infer", b"a")[2] == b"one POST /v2/models/m/infer 1"
        assert (_direct_connections(one), _direct_connections(two)) == (1, 0)
    finally:
        client.close()


def test_a_sequence_models_connections_go_to_haproxy_unless_one_replica_holds_every_slot(loop, acceptor):
    """Its calls are routed one by one by correlation id (HAProxy reads it from each request)."""
    front, port = acceptor
    one, two = Replica(loop, "one"), Replica(loop, "two")
    one.listener.routes = two.listener.routes = _serves_model("s")
    for replicas, direct in (([one], 1), ([one, two], 0)):
        routes = {"s/": [("127.0.0.1", r.port) for r in replicas]}
        asyncio.run_coroutine_threadsafe(front.publish(routes, frozenset({"s/"})), loop).result(10)
        client = _Client(port)
        try:
            assert client.request("POST", "/v2/models/s/infer", b"{}")[2].endswith(b" POST /v2/models/s/infer 2")
            assert _direct_connections(one) + _direct_connections(two) == direct
        finally:
            client.close()
        wait_until(lambda: _direct_connections(one) == 0, "the connection to close")


def test_a_stopping_replica_gives_its_waiting_connections_back(loop, acceptor):
    """The client's next request on the same connection is served through HAProxy."""
    front, port = acceptor
    one, two = Replica(loop, "one"), Replica(loop, "two")
    one.listener.routes = _serves_model("m")
    publish(loop, front, {"m/": [("127.0.0.1", one.port)]})
    client = _Client(port)
    try:
        assert client.request("POST", "/v2/models/m/infer")[2] == b"one POST /v2/models/m/infer 0"
        assert _direct_connections(one) == 1
        publish(loop, front, {"m/": [("127.0.0.1", two.port)]})
        asyncio.run_coroutine_threadsafe(one.listener.close(1.0), loop).result(10)
        assert _direct_connections(one) == 0
        assert client.request("POST", "/v2/models/m/infer")[2] == b"two POST /v2/models/m/infer 0"
    finally:
        client.close()


def test_a_replica_stopping_while_it_relays_leaves_the_answer_to_the_door(loop):
    """A request that stops the replica it was relayed by (as unloading its own model does) is
    answered after the replica stopped: the acceptor copies the answer to the client."""
    serve = Replica(loop, "serve", ingress=True)
    port = free_port()
    front = Front(("127.0.0.1", port, "127.0.0.1", serve.port), None, "v2", direct=True, front_key=TEST_FRONT_KEY)
    one = Replica(loop, "one")
    one.listener.routes = _serves_model("m")
    publish(loop, front, {"m/": [("127.0.0.1", one.port)]})
    client = _Client(port)
    try:
        assert client.request("POST", "/v2/models/m/infer")[2] == b"one POST /v2/models/m/infer 0"
        client.sock.sendall(b"POST /v2/repository/slow HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        assert serve.slow_arrived.wait(10)
        asyncio.run_coroutine_threadsafe(one.listener.close(5.0), loop).result(10)
        serve.release_slow()
        status, headers, body = client.request_sent()
        assert (status, body, headers["connection"]) == (200, b"serve POST /v2/repository/slow 0", "close")
    finally:
        client.close()
        front.stop()


def test_connections_spread_over_replicas_and_a_busy_replica_answers_503(loop, acceptor):
    front, port = acceptor
    one, two = Replica(loop, "one"), Replica(loop, "two")
    for replica in (one, two):
        replica.listener.routes = _serves_model("m")
    publish(loop, front, {"m/": [("127.0.0.1", one.port), ("127.0.0.1", two.port)]})
    clients = [_Client(port) for _ in range(4)]
    try:
        answered = sorted(c.request("POST", "/v2/models/m/infer")[2].split()[0] for c in clients)
        assert answered == [b"one", b"one", b"two", b"two"]
        wait_until(lambda: _direct_connections(one) == _direct_connections(two) == 2, "four direct connections")
        one.listener.max_inflight = two.listener.max_inflight = 0  # --max-inflight-requests reached
        status, headers, body = clients[0].request("POST", "/v2/models/m/infer")
        assert status == 503 and headers["content-type"] == "application/json"
        assert "--max-inflight-requests" in json.loads(body)["error"]
    finally:
        one.listener.max_inflight = two.listener.max_inflight = 1024
        for client in clients:
            client.close()


def test_a_replica_that_is_gone_gets_no_connections(loop, acceptor):
    front, port = acceptor
    one = Replica(loop, "one")
    publish(loop, front, {"m/": [("127.0.0.1", one.port), ("127.0.0.1", free_port())]})
    for _ in range(4):  # the second listener does not exist: HAProxy takes those connections
        client = _Client(port)
        try:
            status, _, body = client.request("POST", "/v2/models/m/infer")
            assert status in (200, 503), body
        finally:
            client.close()


def test_connections_are_rebalanced_over_the_replicas(loop, acceptor, monkeypatch):
    """A replica gives its connection back to the acceptor between two requests once it is due to be
    rebalanced: one keep-alive client reaches both replicas (one started later, as after a scale-up)."""
    from rayinfer.transport import listener_connection

    monkeypatch.setattr(listener_connection, "_REBALANCE_S", 0.0)
    front, port = acceptor
    one = Replica(loop, "one")
    one.listener.routes = _serves_model("m")
    publish(loop, front, {"m/": [("127.0.0.1", one.port)]})
    client = _Client(port)
    try:
        assert client.request("POST", "/v2/models/m/infer")[2].split()[0] == b"one"
        two = Replica(loop, "two")
        two.listener.routes = _serves_model("m")
        publish(loop, front, {"m/": [("127.0.0.1", one.port), ("127.0.0.1", two.port)]})
        answered = [client.request("POST", "/v2/models/m/infer")[2].split()[0] for _ in range(6)]
        assert set(answered) == {b"one", b"two"}, answered
    finally:
        client.close()


def test_a_relay_the_front_does_not_answer_is_a_502(loop, tmp_path):
    from rayinfer.transport.client_relay import RelayedRequest

    class Sink:  # what the relay writes to the client's connection
        written = b""

        def write(self, data: bytes) -> None:
            self.written += data

    sink = Sink()
    relayed = RelayedRequest(str(tmp_path / "no-front.sock"), b"GET", b"/v2", [(b"Host", b"x")], b"")
    keep_alive = asyncio.run_coroutine_threadsafe(relayed.answer(sink, True), loop).result(10)
    head, _, body = sink.written.partition(b"\r\n\r\n")
    assert not keep_alive and head.startswith(b"HTTP/1.1 502 ") and b"connection: close" in head
    assert json.loads(body) == {"error": "the front did not answer a relayed request"}
    assert f"content-length: {len(body)}".encode() in head


def _raw(port: int, data: bytes) -> tuple[int, dict]:
    """Send ``data`` on a new connection; the status and JSON body of the answer (the
    connection is closed after it)."""
    with socket.create_connection(("127.0.0.1", port), 5) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:])}
    assert headers[b"content-type"] == b"application/json", answer
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize("data, reason", [
    (b"HELLO THERE\r\n\r\n", "malformed request line"),
    (b"GET /v2/health/live HTTP/9\r\nhost: x\r\n\r\n", "malformed request line"),
    (b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n", "request line too long"),
    (b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 17000 + b"\r\n\r\n",
     "request headers too large (over 16384 bytes)"),
    (b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n" + b"".join(b"x-h%d: v\r\n" % i for i in range(100)) + b"\r\n",
     "too many request headers (over 100)"),
])
def test_a_request_head_haproxy_would_refuse_gets_a_json_400(acceptor, data: bytes, reason: str) -> None:
    """HAProxy answers these with an HTML page (HAProxy 2.8 ignores errorfile 400 for parse
    errors): the acceptor answers them itself, as Triton's errors look."""
    _, port = acceptor
    assert _raw(port, data) == (400, {"error": f"malformed HTTP request: {reason}"})


def test_a_request_head_at_haproxys_header_count_passes(acceptor) -> None:
    _, port = acceptor
    client = _Client(port)
    headers = b"".join(b"x-h%d: v\r\n" % i for i in range(98))  # with host and content-length: 100
    client.sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n" + headers + b"content-length: 0\r\n\r\n")
    status, _, body = client.request_sent()
    assert status == 200 and body.startswith(b"serve GET /v2/health/live")


_OVER_LIMITS = [
    (b"x-big: " + b"a" * 20000 + b"\r\n", "request headers too large (over 16384 bytes)"),
    (b"".join(b"x-h%d: v\r\n" % i for i in range(150)), "too many request headers (over 100)"),
]


@pytest.mark.parametrize("extra, reason", _OVER_LIMITS, ids=["large", "many"])
def test_a_replica_refuses_a_clients_head_over_the_limits(loop, acceptor, extra: bytes, reason: str) -> None:
    """The acceptor gives a model's request to its replica at its request line; the replica's
    listener bounds the rest of the head (httptools would keep a header's value whole)."""
    front, port = acceptor
    one = Replica(loop, "one")
    one.listener.routes = _serves_model("m")
    publish(loop, front, {"m/": [("127.0.0.1", one.port)]})
    assert _raw(port, b"POST /v2/models/m/infer HTTP/1.1\r\nhost: x\r\n" + extra + b"\r\n") == (
        400, {"error": f"malformed HTTP request: {reason}"})
    client = _Client(port)
    try:  # a head just under 16 KB is the model's
        client.sock.sendall(b"POST /v2/models/m/infer HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 16000
                            + b"\r\ncontent-length: 0\r\n\r\n")
        assert client.request_sent()[::2] == (200, b"one POST /v2/models/m/infer 0")
    finally:
        client.close()


@pytest.mark.parametrize("extra, reason", _OVER_LIMITS, ids=["large", "many"])
def test_haproxy_refuses_a_later_head_over_the_limits_with_json(acceptor, extra: bytes, reason: str) -> None:
    """A connection the acceptor gave HAProxy (its first request is no replica's): a later request's
    head over the limits gets the same JSON 400 from HAProxy, one just under them is served."""
    _, port = acceptor
    client = _Client(port)
    try:
        assert client.request("GET", "/v2/health/live")[0] == 200
        client.sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 16000
                            + b"\r\ncontent-length: 0\r\n\r\n")
        assert client.request_sent()[0] == 200
        client.sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n" + extra + b"\r\n")
        status, headers, body = client.request_sent()
        assert (status, headers["content-type"], json.loads(body)) == (
            400, "application/json", {"error": f"malformed HTTP request: {reason}"})
    finally:
        client.close()


def test_a_refused_head_is_answered_once_and_pipelined_requests_are_not_refused(loop, acceptor) -> None:
    """A head over the header count with a Content-Length over the body limit gets one 400 (the
    head's); requests sent back to back in one write, a large body between them, are served."""
    front, port = acceptor
    one = Replica(loop, "one")
    one.listener.routes = _serves_model("m")
    publish(loop, front, {"m/": [("127.0.0.1", one.port)]})
    many = b"".join(b"x-h%d: v\r\n" % i for i in range(101))
    assert _raw(port, b"POST /v2/models/m/infer HTTP/1.1\r\nhost: x\r\n" + many
                + b"content-length: 99999999999\r\n\r\n") == (400, {"error": "malformed HTTP request: too many request headers (over 100)"})
    client = _Client(port)
    try:
        # The first head in two pieces (the replica has read the first), the second piece ending
        # with the next request's start, whose rest comes once the first is answered.
        body = b"b" * 30000
        client.sock.sendall(b"POST /v2/models/m/infer HTTP/1.1\r\nhost: x\r\n")
        wait_until(lambda: any(c._direct is not None and c._in_head for c in list(one.listener._connections)),
                   "the replica to read the first piece of the head", timeout_s=10)
        client.sock.sendall(b"content-length: %d\r\n\r\n%bPOST /v2/models/m/infer HTTP/1.1\r\nhost: x\r\n" % (
            len(body), body))
        assert client.request_sent()[::2] == (200, b"one POST /v2/models/m/infer 30000")
        client.sock.sendall(b"content-length: 0\r\n\r\n")
        assert client.request_sent()[::2] == (200, b"one POST /v2/models/m/infer 0")
    finally:
        client.close()


def test_the_doors_connections_send_small_writes_at_once():
    """The acceptor's connections carry TCP_NODELAY to whoever takes them: HAProxy does not set it on
    a connection it is given, and a gRPC answer's frames then waited for the client's delayed
    acknowledgement (about 40 ms a call)."""
    listening = listening_socket("127.0.0.1", 0)
    client = socket.create_connection(listening.getsockname())
    try:
        listening.setblocking(True)
        connection, _ = listening.accept()
        with connection:
            assert connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        client.close()
        listening.close()
