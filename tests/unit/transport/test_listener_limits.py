"""A replica listener's limits on a client's own HTTP/1.1 connection (``ConnectionLimits``), over
real sockets through the front's acceptor: one connection misbehaves (a slow head, an idle one, a
pipelining flood, a client that does not read its answers) and is closed within its limit, while
another connection to the same listener is answered at once."""

from __future__ import annotations

import dataclasses
import json
import select
import socket
import time

from front_stand_ins import Replica, publish
from rayinfer.protocol.limits import DEFAULT_CONNECTION_LIMITS, ConnectionLimits
from test_acceptor import _Client, _serves_model, acceptor  # noqa: F401  (acceptor: the front's acceptor, a fixture)
from waiting import wait_until

_INFER = b"POST /v2/models/m/infer HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%b"
_TCP_CLOSE, _TCP_CLOSE_WAIT = 7, 8  # Linux's TCP states: reset by the server, or closed by it


class _LargeAnswers(Replica):
    """A replica whose HTTP answer to a body of digits is that many bytes; counts them."""

    answered = 0

    async def handle_http(self, method: str, path: str, headers: dict[bytes, bytes], body: bytes):
        if not body.isdigit():
            return await super().handle_http(method, path, headers, body)
        self.answered += 1
        return 200, [(b"content-type", b"application/octet-stream")], b"x" * int(body)


def _replica(loop, front, limits: ConnectionLimits, kind: type[Replica] = Replica) -> Replica:
    """A replica of model "m" with ``limits``, the only one the acceptor gives m's connections to."""
    replica = kind(loop, "one")
    replica.listener.routes = _serves_model("m")
    replica.listener.limits = limits
    publish(loop, front, {"m/": [("127.0.0.1", replica.port)]})
    return replica


def _connect(port: int, rcvbuf: int = 0, sndbuf: int = 0) -> socket.socket:
    """A connection to the front with small kernel buffers where given (set before connecting)."""
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    if sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.settimeout(5)
    sock.connect(("127.0.0.1", port))
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    """The server closed or reset the connection, seen without reading what it sent (TCP_INFO)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] in (_TCP_CLOSE, _TCP_CLOSE_WAIT)


def _assert_answered_at_once(port: int) -> None:
    """A well-behaved client's request to the same replica is answered within 2 s."""
    start = time.monotonic()
    client = _Client(port)
    try:
        client.sock.settimeout(2)
        assert client.request("POST", "/v2/models/m/infer", b"7")[0] == 200
    finally:
        client.close()
    assert time.monotonic() - start < 2.0


def _send_until_blocked(sock: socket.socket, data: bytes, blocked_s: float = 0.5) -> int:
    """Send ``data`` until the connection takes no more of it for ``blocked_s``; the bytes sent."""
    sock.setblocking(False)
    view, sent = memoryview(data), 0
    while sent < len(data) and select.select([], [sock], [], blocked_s)[1]:
        try:
            sent += sock.send(view[sent:sent + 65536])
        except BlockingIOError:
            continue
    return sent


def test_a_slow_request_head_is_answered_408_and_closed(loop, acceptor):  # noqa: F811
    """A client that sends its head a byte at a time gets a 408 naming the flag once the head
    timeout passes, and the connection ends."""
    front, port = acceptor
    _replica(loop, front, dataclasses.replace(DEFAULT_CONNECTION_LIMITS, request_head_timeout_s=0.5))
    slow = _connect(port)
    try:
        slow.sendall(b"POST /v2/models/m/infer HTTP/1.1\r\nhost: x\r\n")  # the acceptor gives it at its request line
        start = time.monotonic()
        slow.sendall(b"x")
        _assert_answered_at_once(port)
        slow.settimeout(0.1)  # a header byte each 0.1 s, until the server ends the connection
        answer = b""
        while time.monotonic() < start + 5:
            try:
                slow.sendall(b"x")
                chunk = slow.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                break
            answer += chunk
        elapsed = time.monotonic() - start
    finally:
        slow.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head, answer
    assert "--http-request-timeout" in json.loads(body)["error"]
    assert 0.5 <= elapsed < 2.5, elapsed


def test_an_idle_connection_is_closed_and_a_busy_one_is_not(loop, acceptor):  # noqa: F811
    front, port = acceptor
    _replica(loop, front, dataclasses.replace(DEFAULT_CONNECTION_LIMITS, keepalive_timeout_s=0.5))
    idle, busy = _Client(port), _Client(port)
    try:
        assert idle.request("POST", "/v2/models/m/infer", b"a")[0] == 200
        start = time.monotonic()
        _assert_answered_at_once(port)
        # A connection that asks again and again stays open past the idle timeout.
        while time.monotonic() < start + 1.2:
            assert busy.request("POST", "/v2/models/m/infer", b"b")[0] == 200
        idle.sock.settimeout(3)
        assert idle.sock.recv(1) == b""  # closed quietly, no answer
        assert time.monotonic() - start < 2.5
    finally:
        idle.close()
        busy.close()


def test_a_request_body_that_stops_arriving_is_dropped(loop, acceptor):  # noqa: F811
    """A half-open client: its head whole, its body half sent, then nothing."""
    front, port = acceptor
    _replica(loop, front, dataclasses.replace(DEFAULT_CONNECTION_LIMITS, keepalive_timeout_s=0.5))
    silent = _connect(port)
    try:
        silent.sendall(b"POST /v2/models/m/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n" + b"x" * 50)
        start = time.monotonic()
        _assert_answered_at_once(port)
        silent.settimeout(3)
        assert silent.recv(1) == b""  # closed, no answer
        assert 0.5 <= time.monotonic() - start < 2.5
    finally:
        silent.close()


def test_a_pipelining_flood_that_is_not_read_is_bounded_and_closed(loop, acceptor):  # noqa: F811
    """Behind a request the replica holds, the listener reads only a few pipelined requests
    ahead: the client soon cannot send more. Once the replica answers, the client reads none
    of the answers: the listener stops answering, then disconnects it."""
    front, port = acceptor
    limits = dataclasses.replace(DEFAULT_CONNECTION_LIMITS, max_pipelined_requests=4, send_timeout_s=0.5,
                                 connection_buffer_bytes=65536)
    replica = _replica(loop, front, limits, _LargeAnswers)
    flood = _connect(port, rcvbuf=16384, sndbuf=65536)
    try:
        flood.sendall(b"POST /v2/models/m/slow HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        assert replica.slow_arrived.wait(5)
        request = _INFER % (5, b"65536")  # 64 KiB answers
        sent = _send_until_blocked(flood, request * 500_000)  # 35 MB of requests
        assert sent < 4_000_000, sent  # the listener stopped reading them
        _assert_answered_at_once(port)
        replica.release_slow()
        start = time.monotonic()
        wait_until(lambda: _closed_by_server(flood), "the flooding connection to be closed", 5, 0.05)
        assert time.monotonic() - start < 3.0
        assert replica.answered < min(1000, sent // len(request)), (replica.answered, sent // len(request))
    finally:
        flood.close()


def test_a_client_that_does_not_read_large_answers_is_disconnected(loop, acceptor):  # noqa: F811
    """The listener stops answering a client that does not take its answers, and disconnects it
    after the send timeout; what it holds for it stays bounded."""
    front, port = acceptor
    limits = dataclasses.replace(DEFAULT_CONNECTION_LIMITS, send_timeout_s=0.5, connection_buffer_bytes=1 << 18)
    replica = _replica(loop, front, limits, _LargeAnswers)
    reader = _connect(port, rcvbuf=16384)
    try:
        requests = 16
        reader.sendall((_INFER % (7, b"4194304")) * requests)  # 4 MiB answers, none read
        wait_until(lambda: replica.answered, "the first answer", 5, 0.05)
        start = time.monotonic()
        _assert_answered_at_once(port)
        wait_until(lambda: _closed_by_server(reader), "the non-reading connection to be closed", 5, 0.05)
        assert time.monotonic() - start < 3.0
        assert replica.answered <= 1 + 3  # its own first answers and the well-behaved client's
    finally:
        reader.close()
