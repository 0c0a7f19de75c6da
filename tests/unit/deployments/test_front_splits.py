"""A rollout's split at the front (a real HAProxy): version-less infer calls go to the
candidate by its weight, or by a sticky header's value as :func:`pick_version` picks; named
versions and model GETs are never split. Stand-in listeners answer with their names; no Ray."""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from front_stand_ins import TEST_FRONT_KEY, Replica, free_port, get, http_exchange, post
from rayinfer.deployments.front import Front
from rayinfer.transport.front_maps import splits_on_disk
from rayinfer.transport.router import VersionSplit, pick_version


@pytest.fixture(scope="module")
def split_front(loop):
    grpc_port, http_port = free_port(), free_port()
    front = Front(("127.0.0.1", http_port, "127.0.0.1", free_port()),
                  ("127.0.0.1", grpc_port, "127.0.0.1", free_port()), "v2", front_key=TEST_FRONT_KEY)
    stable, candidate = Replica(loop, "stable"), Replica(loop, "candidate")
    routes = {"m/1": [("127.0.0.1", stable.port)], "m/2": [("127.0.0.1", candidate.port)],
              "m/": [("127.0.0.1", stable.port)]}
    yield front, routes, grpc_port, http_port
    front.stop()


def _publish(loop, front: Front, routes, splits) -> None:
    asyncio.run_coroutine_threadsafe(front.publish(routes, frozenset(), splits), loop).result(10)


def _grpc_answer(client, version: str = "", headers: dict | None = None) -> str:
    tensor = grpcclient.InferInput("X", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 1), np.float32))
    return client.infer("m", [tensor], model_version=version, headers=headers).get_response().model_name


def _http_answer(port: int, path: str = "/v2/models/m/infer", extra: bytes = b"") -> str:
    reply = http_exchange(port, post(path, b"{}", extra))
    return reply.split(b"\r\n\r\n", 1)[1].split(b" ", 1)[0].decode()


def test_version_less_calls_are_split_by_weight(loop, split_front):
    front, routes, grpc_port, http_port = split_front
    _publish(loop, front, routes, {"m": (30, "2", "")})
    assert splits_on_disk(front._dir) == {"m": (30, "2", "")}  # as the acceptor reads them
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    served = Counter(_grpc_answer(client) for _ in range(600))
    assert 0.23 <= served["candidate"] / 600 <= 0.37, served
    served = Counter(_http_answer(http_port) for _ in range(400))
    assert 0.22 <= served["candidate"] / 400 <= 0.38, served
    # A named version, and a model's GET, are never split.
    assert {_grpc_answer(client, "1") for _ in range(30)} == {"stable"}
    assert {_http_answer(http_port, "/v2/models/m/versions/1/infer") for _ in range(30)} == {"stable"}
    assert {http_exchange(http_port, get("/v2/models/m")).split(b"\r\n\r\n", 1)[1][:6] for _ in range(20)} == {b"stable"}
    # The split ends: the stable version answers every version-less call.
    _publish(loop, front, routes, {})
    assert {_grpc_answer(client) for _ in range(50)} == {"stable"}
    client.close()


def test_a_sticky_header_always_reaches_the_same_version(loop, split_front):
    front, routes, grpc_port, http_port = split_front
    _publish(loop, front, routes, {"m": (50, "2", "x-user-id")})
    split = VersionSplit("1", "2", 50, "x-user-id")
    names = {"1": "stable", "2": "candidate"}
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    seen = Counter()
    for n in range(40):
        user = f"user-{n}"
        expected = names[pick_version(split, user)]
        seen[expected] += 1
        assert {_grpc_answer(client, headers={"x-user-id": user}) for _ in range(3)} == {expected}, user
        assert {_http_answer(http_port, extra=f"X-User-Id: {user}\r\n".encode()) for _ in range(3)} == {expected}, user
    assert len(seen) == 2, seen  # both versions get users
    # Without the header: chance.
    assert len(Counter(_grpc_answer(client) for _ in range(60))) == 2
    client.close()
