"""A replica listener's own port serves only the server's parts: a request over TCP without the
front key (the front's HAProxy and other replicas send it) is refused with a 403 before its
body; the server's internal headers count only from them; TCP connections keep a client
connection's limits and the replica's connection cap. Real sockets, the listeners of
tests/front_stand_ins.py, a real HAProxy; no Ray."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import time
from pathlib import Path

import pytest

from front_stand_ins import TEST_FRONT_KEY, Replica, free_port, http_exchange, publish
from rayinfer.deployments.front import Front
from rayinfer.protocol.limits import DEFAULT_CONNECTION_LIMITS
from rayinfer.transport import front_config
from test_acceptor import _serves_model, acceptor  # noqa: F401  (acceptor: the front's acceptor, a fixture)
from waiting import wait_until

_KEY_HEADER = b"rayinfer-front-key"
# What a client might set to pass for the server's own parts.
_INTERNAL = (b"x-rayinfer-stream: 1\r\nrayinfer-sequence-forwarded: 1\r\n"
             b"x-rayinfer-trace-parent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n")
_INTERNAL_NAMES = {b"x-rayinfer-stream", b"rayinfer-sequence-forwarded", b"x-rayinfer-trace-parent", _KEY_HEADER}


class _Recording(Replica):
    """A replica that keeps the headers of the requests its handler was given."""

    def __init__(self, loop, name: str) -> None:
        super().__init__(loop, name)
        self.seen: list[dict[bytes, bytes]] = []

    async def handle_http(self, method: str, path: str, headers: dict[bytes, bytes], body: bytes):
        self.seen.append(dict(headers))
        return await super().handle_http(method, path, headers, body)


def _key(value: str = TEST_FRONT_KEY) -> bytes:
    return b"%b: %b\r\n" % (_KEY_HEADER, value.encode())


def _infer(body: bytes, extra: bytes = b"", path: bytes = b"/v2/models/m/infer") -> bytes:
    return b"POST %b HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n%b\r\n%b" % (path, len(body), extra, body)


def _answer_then_closed(sock: socket.socket, timeout_s: float = 5.0) -> bytes:
    """What the server sends until it closes the connection (a reset counts as closed)."""
    sock.settimeout(timeout_s)
    answer = b""
    with contextlib.suppress(ConnectionResetError):  # what came before the reset is the answer
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def _status_and_error(answer: bytes) -> tuple[int, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head, answer
    return int(head.split()[1]), json.loads(body)["error"]


def test_the_listener_port_refuses_requests_without_the_front_key_before_their_body(loop):
    replica = _Recording(loop, "one")
    for extra in (b"", _key("f" * 64), _key(TEST_FRONT_KEY[:-1]), _key(""), _key(TEST_FRONT_KEY + "0")):
        with socket.create_connection(("127.0.0.1", replica.port), 5) as sock:
            # The head only: the refusal does not wait for the 100 kB body.
            sock.sendall(b"POST /v2/models/m/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n%b\r\n" % extra)
            answer = _answer_then_closed(sock)
        head = answer.partition(b"\r\n\r\n")[0]
        assert head.startswith(b"HTTP/1.1 403 ") and b"connection: close" in head, (extra, answer)
        status, error = _status_and_error(answer)
        assert status == 403 and "rayinfer-front-key" in error, error
        assert TEST_FRONT_KEY.encode() not in answer
    assert replica.seen == []  # no request got as far as the handler
    # With the key: served, on a connection kept for the next request; the handler does not see the key.
    with socket.create_connection(("127.0.0.1", replica.port), 5) as sock:
        for body in (b"abc", b"defg"):
            sock.sendall(_infer(body, _key()))
            answer = b""
            while not answer.endswith(b"one POST /v2/models/m/infer %d" % len(body)):
                chunk = sock.recv(65536)
                assert chunk, answer
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200 ")
    assert len(replica.seen) == 2 and all(_KEY_HEADER not in headers for headers in replica.seen)


def test_a_listener_that_does_not_know_the_key_refuses_every_request(loop):
    replica = Replica(loop, "one")
    replica.listener.front_key = ""
    for extra in (b"", _key(""), _key()):
        with socket.create_connection(("127.0.0.1", replica.port), 5) as sock:
            sock.sendall(_infer(b"abc", extra))
            assert _status_and_error(_answer_then_closed(sock))[0] == 403


def test_the_servers_internal_headers_count_only_from_the_servers_parts(loop, acceptor):  # noqa: F811
    """A client's own connection (from the acceptor) and a client's request through HAProxy
    lose the internal headers and the key; a request over TCP with the key keeps the internal
    headers (another replica's) and loses the key."""
    front, port = acceptor
    replica = _Recording(loop, "one")
    replica.listener.routes = _serves_model("m")
    publish(loop, front, {"m/": [("127.0.0.1", replica.port)]})
    with socket.create_connection(("127.0.0.1", port), 5) as sock:  # given to the replica by the acceptor
        sock.sendall(_infer(b"abc", _INTERNAL + _key() + b"connection: close\r\n"))
        assert _answer_then_closed(sock).endswith(b"one POST /v2/models/m/infer 3")
    assert len(replica.seen) == 1 and not _INTERNAL_NAMES & set(replica.seen[0]), replica.seen
    with socket.create_connection(("127.0.0.1", replica.port), 5) as sock:  # another replica's
        sock.sendall(_infer(b"abc", _INTERNAL + _key() + b"connection: close\r\n"))
        assert _answer_then_closed(sock).endswith(b"one POST /v2/models/m/infer 3")
    assert set(replica.seen[1]) & _INTERNAL_NAMES == _INTERNAL_NAMES - {_KEY_HEADER}, replica.seen


def test_haproxy_drops_the_internal_headers_and_replaces_a_clients_key(loop):
    replica = _Recording(loop, "one")
    http_port = free_port()
    front = Front(("127.0.0.1", http_port, "127.0.0.1", free_port()), None, "v2", front_key=TEST_FRONT_KEY)
    try:
        publish(loop, front, {"m/": [("127.0.0.1", replica.port)]})
        for key in (b"", _key("f" * 64), _key()):
            reply = http_exchange(http_port, _infer(b"abc", _INTERNAL + key + b"connection: close\r\n"))
            assert reply.startswith(b"HTTP/1.1 200 ") and reply.endswith(b"one POST /v2/models/m/infer 3"), reply
        assert len(replica.seen) == 3 and not any(_INTERNAL_NAMES & set(seen) for seen in replica.seen), replica.seen
    finally:
        front.stop()


def test_the_front_config_sets_the_key_and_drops_the_internal_headers(tmp_path: Path):
    text = front_config.render(tmp_path, ("127.0.0.1", 8000, "127.0.0.1", 9000), ("127.0.0.1", 8001, "127.0.0.1", 9001),
                               "v2", 1, 1 << 26, None, None, 1024, front_key=TEST_FRONT_KEY)
    sections = {block.split("\n", 1)[0]: block for block in text.split("\n\n") if block.strip()}
    replica = next(block for name, block in sections.items() if name == "backend replica")
    assert f"http-request set-header rayinfer-front-key {TEST_FRONT_KEY}" in replica
    for frontend in ("frontend triton_http", "frontend triton_grpc"):
        rules = [line.strip() for line in sections[frontend].splitlines() if line.strip().startswith("http-request")]
        deleted = {rule.split()[-1] for rule in rules if rule.startswith("http-request del-header")}
        assert deleted == {name.decode() for name in _INTERNAL_NAMES}, (frontend, rules)
        assert all(rule.startswith("http-request del-header") for rule in rules[:len(deleted)]), rules  # first
    assert text.count(TEST_FRONT_KEY) == 1
    with pytest.raises(ValueError):
        front_config.render(tmp_path, ("127.0.0.1", 8000, "127.0.0.1", 9000), None, "v2", 1, 1 << 26, None, None, 1024,
                            front_key="a key\n    server evil 1.2.3.4:80")


def test_a_half_head_over_tcp_is_answered_408_after_the_request_timeout(loop):
    replica = Replica(loop, "one")
    replica.listener.limits = dataclasses.replace(DEFAULT_CONNECTION_LIMITS, request_head_timeout_s=0.5)
    with socket.create_connection(("127.0.0.1", replica.port), 5) as sock:
        sock.sendall(b"POST /v2/models/m/infer HTTP/1.1\r\nhost: x\r\n")
        start = time.monotonic()
        answer = _answer_then_closed(sock)
        elapsed = time.monotonic() - start
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert "--http-request-timeout" in _status_and_error(answer)[1]
    assert 0.4 <= elapsed < 2.5, elapsed


def _served(sock: socket.socket) -> bool:
    sock.sendall(_infer(b"abc", _key()))
    sock.settimeout(5)
    answer = b""
    try:
        while not answer.endswith(b"one POST /v2/models/m/infer 3"):
            chunk = sock.recv(65536)
            if not chunk:
                return False
            answer += chunk
    except ConnectionResetError:
        return False
    return True


def test_the_connection_cap_closes_one_connection_more(loop, acceptor):  # noqa: F811
    """At --replica-max-connections, one more connection (over TCP, or a client's from the
    acceptor) is closed at once; below it again, a new one is served."""
    front, port = acceptor
    replica = Replica(loop, "one")
    replica.listener.routes = _serves_model("m")
    replica.listener.limits = dataclasses.replace(DEFAULT_CONNECTION_LIMITS, max_connections=2)
    publish(loop, front, {"m/": [("127.0.0.1", replica.port)]})
    held = [socket.create_connection(("127.0.0.1", replica.port), 5) for _ in range(2)]
    try:
        assert all(_served(sock) for sock in held)
        with socket.create_connection(("127.0.0.1", replica.port), 5) as extra:
            start = time.monotonic()
            assert not _served(extra)
            assert time.monotonic() - start < 2.0
        with socket.create_connection(("127.0.0.1", port), 5) as client:  # through the acceptor
            client.sendall(_infer(b"abc"))
            assert _answer_then_closed(client) == b""
        held.pop().close()
        wait_until(lambda: len(replica.listener._connections) == 1, "the listener to let a connection go", 5)
        with socket.create_connection(("127.0.0.1", replica.port), 5) as again:
            assert _served(again)
    finally:
        for sock in held:
            sock.close()


def test_a_grpc_path_on_a_clients_http_connection_gets_the_http_body_limit(loop, acceptor):  # noqa: F811
    """A client's HTTP connection may not send a body over --http-max-input-size by naming a
    gRPC method's path: 70 MB are refused at their head, not read."""
    front, port = acceptor
    replica = Replica(loop, "one")
    replica.listener.routes = _serves_model("m")
    replica.listener.max_input_size = limit = 60_000_000  # the replica's answer, not HAProxy's (64 MiB)
    publish(loop, front, {"m/": [("127.0.0.1", replica.port)]})
    size = 70_000_000
    with socket.create_connection(("127.0.0.1", port), 5) as sock:
        sock.sendall(_infer(b""))  # the connection is the replica's
        sock.settimeout(5)
        first = b""
        while not first.endswith(b"one POST /v2/models/m/infer 0"):
            chunk = sock.recv(65536)
            assert chunk, first
            first += chunk
        sock.sendall(b"POST /inference.GRPCInferenceService/ModelInfer HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/grpc\r\ncontent-length: %d\r\n\r\n" % size + b"\0" * 65536)
        second = b""
        while not second.endswith(b"}"):  # the answer's JSON body, whole
            chunk = sock.recv(65536)
            assert chunk, second
            second += chunk
    assert first.startswith(b"HTTP/1.1 200 ") and second.startswith(b"HTTP/1.1 400 "), (first, second)
    assert b"connection: close" in second.partition(b"\r\n\r\n")[0]
    assert _status_and_error(second) == (400, f"Request JSON size of {size} bytes exceeds the maximum allowed value "
                                              f"of {limit} bytes. Use --http-max-input-size to increase the limit.")


def test_the_grpc_form_over_tcp_is_bounded_by_the_grpc_message_size(loop):
    replica = Replica(loop, "one")
    replica.listener.limits = dataclasses.replace(DEFAULT_CONNECTION_LIMITS, max_message_bytes=1024)
    with socket.create_connection(("127.0.0.1", replica.port), 5) as sock:
        sock.sendall(b"POST /inference.GRPCInferenceService/ModelInfer HTTP/1.1\r\nhost: x\r\n%b"
                     b"content-type: application/grpc\r\ncontent-length: 2000\r\n\r\n" % _key())
        sock.settimeout(5)
        answer = b""
        while not (b"grpc-status" in answer and answer.endswith(b"\r\n\r\n")):  # the trailers: the body is not read
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
    assert b"grpc-status: 8\r\n" in answer, answer
    assert b"grpc-message: Received message larger than max (2000 vs. 1024)" in answer, answer
