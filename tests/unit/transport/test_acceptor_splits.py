"""A rollout's split on the clients' HTTP/1.1 connections the front's acceptor (a real supervisor
and HAProxy) hands to replicas: a connection answers runs of version-less requests at one
version's replica and is placed again between runs, so that each version answers its weight's
share with no proxy in between and the connections stay spread over both by weight; a sticky
value's requests always reach its version. A gRPC connection answers its runs the same way, one
connection a run. Stand-in listeners of tests/front_stand_ins.py as the two versions' replicas; raw
sockets and tritonclient.grpc as clients."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import asdict

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from front_stand_ins import TEST_FRONT_KEY, Replica, free_port
from rayinfer.deployments.front import Front
from rayinfer.transport import client_relay
from rayinfer.transport.front_paths import FrontPaths
from rayinfer.transport.replica_routes import ReplicaRoutes
from rayinfer.transport.router import RUN_REQUESTS, VersionSplit, minority_run, pick_version
from test_acceptor import _Client, _direct_connections, acceptor  # noqa: F401  (acceptor: a fixture)

_NAMES = {"1": "one", "2": "two"}


def _split_replicas(loop, front, split: VersionSplit) -> tuple[Replica, Replica]:
    one, two = Replica(loop, "one"), Replica(loop, "two")
    for replica, version in ((one, "1"), (two, "2")):  # as a model replica routes (deployments/model.py)
        replica_routes = ReplicaRoutes("m", version)
        replica_routes.take_split(False, asdict(split))
        replica.listener.routes = replica_routes
    routes = {"m/1": [("127.0.0.1", one.port)], "m/2": [("127.0.0.1", two.port)], "m/": [("127.0.0.1", one.port)]}
    asyncio.run_coroutine_threadsafe(front.publish(routes, frozenset(), {"m": split.front_entry()}), loop).result(10)
    return one, two


def _infer(client: _Client, extra: bytes = b"") -> str:
    client.sock.sendall(b"POST /v2/models/m/infer HTTP/1.1\r\nhost: x\r\n%bcontent-length: 2\r\n\r\n{}" % extra)
    status, _, body = client.request_sent()
    assert status == 200, body
    return body.split()[0].decode()


def _unsplit(loop, front) -> None:
    asyncio.run_coroutine_threadsafe(front.publish({}, frozenset(), {}), loop).result(10)


def _runs(answers: list[str]) -> list[list]:
    """[name, length] of each run of answers by the same replica."""
    runs: list[list] = []
    for name in answers:
        if not runs or runs[-1][0] != name:
            runs.append([name, 0])
        runs[-1][1] += 1
    return runs


def _check_runs(answers: list[str], weight: int) -> None:
    """The candidate's runs are RUN_REQUESTS long (the first and last may be cut by where the
    requests began and ended), and its share is its weight within a run at each end."""
    runs = _runs(answers)
    assert all(n == RUN_REQUESTS for name, n in runs[1:-1] if name == "two"), runs
    share = Counter(answers)["two"] / len(answers)
    assert abs(share - weight / 100) <= 2 * RUN_REQUESTS / len(answers), (weight, share, runs)


def test_a_connection_answers_each_versions_weight_in_runs_at_its_replica(loop, acceptor):
    front, port = acceptor
    for weight, requests in ((50, 8 * RUN_REQUESTS), (10, 25 * RUN_REQUESTS)):
        _split_replicas(loop, front, VersionSplit("1", "2", weight))
        client = _Client(port)
        try:
            _check_runs([_infer(client) for _ in range(requests)], weight)
        finally:
            client.close()
        _unsplit(loop, front)


def test_many_connections_stay_spread_over_both_versions_by_weight(loop, acceptor):
    """Eight clients in lockstep at 50%: neither version's replica ever holds more than five of
    their connections (their runs would otherwise gather them at one), and each version answers
    half of the requests."""
    front, port = acceptor
    one, two = _split_replicas(loop, front, VersionSplit("1", "2", 50))
    clients = [_Client(port) for _ in range(8)]
    answers, most = [], 0
    try:
        for _ in range(5 * RUN_REQUESTS):
            answers += [_infer(client) for client in clients]
            most = max(most, _direct_connections(one), _direct_connections(two))
        assert most <= 5
        assert abs(Counter(answers)["two"] / len(answers) - 0.5) <= 2 * RUN_REQUESTS / len(answers)
    finally:
        for client in clients:
            client.close()
        _unsplit(loop, front)


def test_a_client_beside_another_gets_both_versions_by_weight(loop, acceptor):
    """Two clients at 50%, the second half a run behind the first: each one's own requests go to
    both versions (neither holds the other in place)."""
    front, port = acceptor
    _split_replicas(loop, front, VersionSplit("1", "2", 50))
    clients = [_Client(port), _Client(port)]
    answers: list[list[str]] = [[], []]
    try:
        answers[0] += [_infer(clients[0]) for _ in range(RUN_REQUESTS // 2)]
        for _ in range(8 * RUN_REQUESTS):
            for client, seen in zip(clients, answers):
                seen.append(_infer(client))
        for seen in answers:
            assert 0.3 <= Counter(seen)["two"] / len(seen) <= 0.7, _runs(seen)
    finally:
        for client in clients:
            client.close()
        _unsplit(loop, front)


def test_a_run_goes_on_where_a_rebalanced_connection_is_placed_again(loop, acceptor, monkeypatch):
    """A connection given back in the middle of its run (here after every request, as when it is
    rebalanced or its replica stops) carries the rest of its run to the acceptor and back."""
    from rayinfer.transport import listener_connection

    monkeypatch.setattr(listener_connection, "_REBALANCE_S", 0.0)
    front, port = acceptor
    _split_replicas(loop, front, VersionSplit("1", "2", 20))
    client = _Client(port)
    try:
        _check_runs([_infer(client) for _ in range(15 * RUN_REQUESTS)], 20)
    finally:
        client.close()
        _unsplit(loop, front)


def test_a_sticky_value_always_reaches_its_version_and_its_connection_stays_there(loop, acceptor):
    front, port = acceptor
    split = VersionSplit("1", "2", 50, "x-user-id")
    one, two = _split_replicas(loop, front, split)
    versions = Counter()
    try:
        for n in range(30):
            user = f"user-{n}"
            expected = _NAMES[pick_version(split, user)]
            versions[expected] += 1
            client = _Client(port)
            try:
                header = f"X-User-Id: {user}\r\n".encode()
                assert {_infer(client, header) for _ in range(RUN_REQUESTS * 3)} == {expected}, user
                # Placed by its first request's value: no request of it was relayed.
                assert _direct_connections(one if expected == "one" else two) == 1
            finally:
                client.close()
        assert len(versions) == 2, versions  # both versions have users
        # One connection carrying two users: each request still reaches its user's version
        # (relayed to the front when the connection is at the other version's replica).
        users = [next(f"u{n}" for n in range(100) if pick_version(split, f"u{n}") == v) for v in ("1", "2")]
        client = _Client(port)
        try:
            for _ in range(5):
                for user, expected in zip(users, ("one", "two")):
                    assert _infer(client, f"x-user-id: {user}\r\n".encode()) == expected
        finally:
            client.close()
    finally:
        _unsplit(loop, front)


@pytest.fixture(scope="module")
def grpc_front(loop):
    port = free_port()
    front = Front(None, ("127.0.0.1", port, "127.0.0.1", free_port()), "v2", direct=True, front_key=TEST_FRONT_KEY)
    assert front.grpc_direct
    yield front, port
    front.stop()


def _grpc_infer(client, headers: dict | None = None) -> str:
    tensor = grpcclient.InferInput("X", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 1), np.float32))
    return client.infer("m", [tensor], headers=headers).get_response().model_name


@pytest.mark.parametrize("weight", [30, 80])
def test_grpc_calls_are_answered_in_runs_at_each_versions_replica(loop, grpc_front, weight):
    """A gRPC connection is placed like an HTTP/1.1 one: its replica answers its run of
    version-less calls and closes it (GOAWAY), and the client's next connection is placed for
    the next run; no call is relayed. A sticky value's calls reach its version wherever they
    arrive (relayed when the connection is at the other one)."""
    front, port = grpc_front
    split = VersionSplit("1", "2", weight, "x-user-id")
    _split_replicas(loop, front, split)
    relays = str(FrontPaths(front._dir).grpc_relay_socket)
    client_relay._IDLE.pop(relays, None)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        run = minority_run(split, reconnects=True)  # longer than an HTTP/1.1 connection's
        assert run > RUN_REQUESTS
        calls = 12 * run
        answers = [_grpc_infer(client) for _ in range(calls)]
        runs = _runs(answers)
        minority = "two" if weight < 50 else "one"
        # (Two runs in a row at one version read as one.)
        assert all(n % run == 0 for name, n in runs[1:-1] if name == minority), runs
        assert abs(Counter(answers)["two"] / calls - weight / 100) <= 2 * run / calls, runs
        assert not client_relay._IDLE.get(relays), "a version-less call was relayed"
        for n in range(20):
            user = f"user-{n}"
            expected = _NAMES[pick_version(split, user)]
            assert {_grpc_infer(client, {"x-user-id": user}) for _ in range(3)} == {expected}, user
    finally:
        client.close()
        _unsplit(loop, front)
