"""What the front holds for clients is bounded: the acceptor never blocks on a HAProxy that takes
no more connections, holds at most --front-max-connections waiting for a first request, and
HAProxy's timeouts and maxconn come from the server's flags instead of an hour."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

from front_stand_ins import TEST_FRONT_KEY, Replica, free_port
from rayinfer.deployments.front import Front
from rayinfer.protocol.limits import DEFAULT_CONNECTION_LIMITS
from rayinfer.transport import front_config
from rayinfer.transport.acceptor import Acceptor, AcceptorLimits, listening_socket

_HEALTH = b"GET /v2/health/ready HTTP/1.1\r\nhost: x\r\n\r\n"


def _closed_by_server(client: socket.socket, timeout_s: float) -> bool:
    client.settimeout(timeout_s)
    try:
        while client.recv(1 << 16):
            continue
    except TimeoutError:
        return False
    except ConnectionResetError:  # closed with a reset: closed all the same
        return True
    return True


def test_the_acceptor_never_blocks_on_a_haproxy_that_takes_no_connections(tmp_path: Path):
    """HAProxy's end of the socket pair is never read: connections for it are closed once the
    pair is full, and the acceptor goes on (before, its blocking send stalled both ports)."""
    port = free_port()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    acceptor = Acceptor({"http": listening_socket("127.0.0.1", port)}, {"http": ours}, tmp_path)
    server = threading.Thread(target=acceptor.serve, args=(4.0,), daemon=True)
    server.start()
    clients = []
    try:
        for _ in range(1500):
            client = socket.create_connection(("127.0.0.1", port), timeout=5)
            client.sendall(_HEALTH)
            clients.append(client)
        server.join(10)
        assert not server.is_alive(), "the acceptor blocked on HAProxy's socket pair"
        assert _closed_by_server(clients[-1], 1.0)
    finally:
        for client in clients:
            client.close()
        ours.close()
        theirs.close()


def test_connections_past_front_max_connections_are_closed_at_once(tmp_path: Path):
    port = free_port()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    acceptor = Acceptor({"http": listening_socket("127.0.0.1", port)}, {"http": ours}, tmp_path,
                        AcceptorLimits(max_connections=5))
    clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(8)]
    try:
        acceptor.serve(0.2)  # none has sent its first request: five wait, three are closed
        closed = sum(_closed_by_server(client, 0.2) for client in clients)
        assert closed == 3
    finally:
        for client in clients:
            client.close()
        acceptor.close()
        ours.close()
        theirs.close()


def test_haproxys_maxconn_and_timeouts_are_the_servers_flags(tmp_path: Path):
    limits = replace(DEFAULT_CONNECTION_LIMITS, front_max_connections=77, stream_idle_timeout_s=12,
                     keepalive_timeout_s=7, request_head_timeout_s=3)
    config = front_config.render(tmp_path, ("127.0.0.1", 1, "127.0.0.1", 2), ("127.0.0.1", 3, "127.0.0.1", 4), "v2",
                                 1, 1 << 20, None, None, 10, True, True, front_key=TEST_FRONT_KEY, limits=limits)
    lines = {line.strip() for line in config.splitlines()}
    assert {"maxconn 77", "timeout client 12s", "timeout server 12s", "timeout tunnel 12s",
            "timeout http-keep-alive 7s", "timeout http-request 3s"} <= lines
    assert not any(line.endswith(" 1h") for line in lines)


def test_haproxy_closes_idle_connections_after_the_flags_timeouts(loop):
    """A connection the acceptor gives HAProxy (its first request is no model's) that then sits
    idle, and one that never sends a request, are closed within the server's timeouts."""
    serve = Replica(loop, "serve", ingress=True)
    port = free_port()
    limits = replace(DEFAULT_CONNECTION_LIMITS, keepalive_timeout_s=1, request_head_timeout_s=1,
                     stream_idle_timeout_s=2)
    front = Front(("127.0.0.1", port, "127.0.0.1", serve.port), None, "v2", direct=True, front_key=TEST_FRONT_KEY,
                  limits=limits)
    try:
        idle = socket.create_connection(("127.0.0.1", port), timeout=5)
        idle.sendall(_HEALTH)
        idle.settimeout(5)
        assert idle.recv(1 << 16).startswith(b"HTTP/1.1 200")
        silent = socket.create_connection(("127.0.0.1", port), timeout=5)
        started = time.monotonic()
        assert _closed_by_server(idle, 6) and _closed_by_server(silent, 6)
        assert time.monotonic() - started < 5
    finally:
        front.stop()
