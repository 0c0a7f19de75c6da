"""The request marks rayinfer adds in front of Ray Serve's per-replica HTTP server, without Ray."""

from __future__ import annotations

import asyncio
import importlib

from rayinfer.cluster.settings import RAY_ENVIRONMENT
from rayinfer.deployments.ingress import TritonRequestMarks, http_middlewares


class Inner:
    """An ASGI app that records the headers it was called with."""

    def __init__(self) -> None:
        self.headers: list[list[tuple[bytes, bytes]]] = []

    async def __call__(self, scope, receive, send) -> None:
        self.headers.append(list(scope["headers"]))


def call(app, path: str, headers: list[tuple[bytes, bytes]], kind: str = "http") -> None:
    async def receive():
        return {"type": "http.request", "body": b""}

    sent = []

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": kind, "path": path, "headers": headers}, receive, send))


def test_v2_requests_skip_the_disconnect_watcher_and_get_an_id():
    inner = Inner()
    marks = TritonRequestMarks(inner)
    call(marks, "/v2/models/mlp/infer", [(b"host", b"x")])
    call(marks, "/v2/models/mlp/infer", [(b"host", b"x")])
    first, second = (dict(h) for h in inner.headers)
    assert first[b"x-request-disconnect-disabled"] == b"?1"
    assert first[b"host"] == b"x"
    assert first[b"x-request-id"] != second[b"x-request-id"]


def test_a_client_request_id_is_kept():
    inner = Inner()
    call(TritonRequestMarks(inner), "/v2/health/ready", [(b"x-request-id", b"abc")])
    (headers,) = inner.headers
    assert [value for key, value in headers if key == b"x-request-id"] == [b"abc"]
    assert (b"x-request-disconnect-disabled", b"?1") in headers


def test_requests_outside_v2_pass_untouched():
    inner = Inner()
    marks = TritonRequestMarks(inner)
    call(marks, "/other-app/predict", [(b"host", b"x")])
    call(marks, "/v2/models/mlp", [(b"host", b"x")], kind="websocket")
    assert inner.headers == [[(b"host", b"x")], [(b"host", b"x")]]


def test_ray_environment_names_the_middlewares_ray_serve_validates():
    from ray.serve._private.http_util import validate_http_proxy_callback_return

    module_name, _, attr = RAY_ENVIRONMENT["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"].partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    assert factory is http_middlewares
    (middleware,) = validate_http_proxy_callback_return(factory())
    assert middleware.cls is TritonRequestMarks
