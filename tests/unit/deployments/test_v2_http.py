"""The ``/v2`` replica's Starlette router (deployments/v2_http.py), driven as Serve's ingress
drives it (an ASGI call): each route reaches its operation, and a route that does not exist or
does not take the method is Triton's 404 naming the method and the path as sent. The operations
behind it (V2Api) are a stand-in here; tests/compat and tests/integration run them for real."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from rayinfer.deployments.v2_http import v2_router


class _Api:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.log_settings = {"log_info": True}
        self.shm = SimpleNamespace(status=lambda name, kind: self.calls.append(("shm_status", kind, name)) or [])

    def server_metadata(self) -> dict:
        return {"name": "triton"}

    def set_log_settings(self, settings: dict) -> None:
        self.log_settings = settings

    async def ready(self) -> bool:
        return True

    async def index(self, ready: bool) -> list:
        self.calls.append(("index", ready))
        return []

    async def trace_setting(self, model: str, update: Any) -> dict:
        self.calls.append(("trace", model, update))
        return {"trace_level": ["OFF"]}

    async def model_stats(self, model: str, version: str) -> list:
        return []

    async def change_model(self, action: str, model: str, parameters: dict) -> None:
        self.calls.append((action, model, parameters))

    async def shm_unregister(self, name: str, kind: str) -> None:
        self.calls.append(("shm_unregister", kind, name))


class _Server:
    def __init__(self) -> None:
        self._api = _Api()
        self._max_input_size = 1 << 20
        self._restrictions = None
        self.unrouted: list[tuple] = []

    async def unrouted_model(self, route, scope, receive, send) -> None:
        self.unrouted.append((route.model, route.version, route.action, scope["method"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def _call(app, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "root_path": "/v2", "headers": [],
             "query_string": b""}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


@pytest.fixture
def served() -> tuple[Any, _Server]:
    server = _Server()
    return v2_router(server._api, server._max_input_size, None, server.unrouted_model), server  # type: ignore[arg-type]


def test_each_route_reaches_its_operation(served):
    app, server = served
    assert _call(app, "GET", "/v2") == (200, b'{"name":"triton"}')
    assert _call(app, "GET", "/v2/health/ready/")[0] == 200  # a trailing slash is taken off
    assert _call(app, "POST", "/v2/repository/index", b'{"ready": true}')[0] == 200
    assert _call(app, "POST", "/v2/repository/models/simple/load", b'{"parameters": {"config": "{}"}}')[0] == 200
    assert _call(app, "POST", "/v2/models/simple/trace/setting", b'{"trace_level": ["TIMESTAMPS"]}')[0] == 200
    assert _call(app, "GET", "/v2/systemsharedmemory/region/r%201/status")[0] == 200
    assert _call(app, "POST", "/v2/cudasharedmemory/unregister")[0] == 200
    assert server._api.calls == [("index", True), ("load", "simple", {"config": "{}"}),
                                 ("trace", "simple", {"trace_level": ["TIMESTAMPS"]}),
                                 ("shm_status", "system", "r%201"), ("shm_unregister", "cuda", "")]
    # A model route (the front's /v2/unrouted prefix taken off) goes to the unrouted-model answer.
    assert _call(app, "POST", "/v2/unrouted/v2/models/m/versions/2/infer")[0] == 200
    assert _call(app, "GET", "/v2/models/m/ready")[0] == 200
    assert server.unrouted == [("m", "2", "infer", "POST"), ("m", "", "ready", "GET")]


@pytest.mark.parametrize(("method", "path", "message"), [
    ("POST", "/v2/health/live", "Not Found: POST /v2/health/live"),
    ("GET", "/v2/repository/index", "Not Found: GET /v2/repository/index"),
    ("POST", "/v2/repository/models/simple/delete", "Not Found: POST /v2/repository/models/simple/delete"),
    ("POST", "/v2/repository/models/a/b/load", "Not Found: POST /v2/repository/models/a/b/load"),
    ("PUT", "/v2/trace/setting", "Not Found: PUT /v2/trace/setting"),
    ("GET", "/v2/models/m/bogus", "Not Found: GET /v2/models/m/bogus"),
    ("GET", "/v2/nothing/", "Not Found: GET /v2/nothing/"),
    ("POST", "/v2/systemsharedmemory/status", "Not Found: POST /v2/systemsharedmemory"),
])
def test_an_unknown_route_or_method_is_tritons_404(served, method: str, path: str, message: str):
    app, _ = served
    status, body = _call(app, method, path)
    assert (status, json.loads(body)) == (404, {"error": message})


def test_a_failing_operation_answers_its_triton_error(served):
    app, _ = served
    status, body = _call(app, "POST", "/v2/logging", b"{not json")
    assert (status, json.loads(body)["error"]) == (400, "failed to parse the request JSON buffer: Missing a name for object member. at 1")
    status, body = _call(app, "POST", "/v2/repository/models/m/load", b'{"parameters": [1]}')
    assert (status, json.loads(body)) == (400, {"error": "'parameters' of a repository request must be a JSON object"})
