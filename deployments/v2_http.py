"""The ``/v2`` replica's HTTP API: one Starlette router, its whole route table in
:func:`v2_router`.

Serve's HTTP ingress sends this replica what the front does not route to a model's replica:
server metadata and health, the repository, logging, trace and shared-memory extensions,
statistics of every model, and model routes of models with no routed replica (unknown,
unavailable, loading, or not registered with the front yet). Every answer is Triton's: an error
is ``{"error": message}`` with its code's status, and a route that does not exist, or does not
take the request's method, is Triton's 404 ``Not Found: <method> <path>``.

Before routing, a trailing slash and the front's ``/v2/unrouted`` prefix are taken off the path,
and ``--http-restricted-api`` is checked.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.routing import Route, Router

from rayinfer.deployments import asgi
from rayinfer.protocol import log_settings
from rayinfer.protocol.errors import InvalidArgError, NotFoundError, as_serving_error
from rayinfer.protocol.http_codec import parse_json_body, repository_index_ready
from rayinfer.protocol.limits import body_too_large, load_too_large
from rayinfer.protocol.shared_memory import CUDA, cuda_registration_from_json, registration_from_json
from rayinfer.serving.routes import UNROUTED_PREFIX, parse_model_route
from rayinfer.serving.trace import parse_update

from rayinfer.deployments.rollouts import ROLLOUT_ACTIONS

if TYPE_CHECKING:
    from rayinfer.deployments.v2_api import V2Api
    from rayinfer.protocol.restricted_api import Restrictions
    from rayinfer.serving.routes import ModelRoute

Handler = Callable[[asgi.Scope, asgi.Receive, asgi.Send], Awaitable[None]]
# The scope key keeping the path as the client sent it (for the 404 message).
_SENT_PATH = "rayinfer.sent_path"


def _not_found(scope: asgi.Scope) -> NotFoundError:
    return NotFoundError(f"Not Found: {scope['method']} {scope.get(_SENT_PATH, scope['path'])}")


class _Endpoint:
    """One route's handler, for any method (an ASGI app, so Starlette matches every method): a
    method the route does not take is Triton's 404, and every failure Triton's error body."""

    def __init__(self, handler: Handler, methods: tuple[str, ...] = ()) -> None:
        self.handler = handler
        self.methods = methods

    async def __call__(self, scope: asgi.Scope, receive: asgi.Receive, send: asgi.Send) -> None:
        try:
            if self.methods and scope["method"] not in self.methods:
                raise _not_found(scope)
            await self.handler(scope, receive, send)
        except Exception as exc:
            await asgi.send_error(send, as_serving_error(exc))


def v2_router(api: V2Api, limit: int, restrictions: tuple[Restrictions, Restrictions] | None,
              unrouted_model: Callable[[ModelRoute, asgi.Scope, asgi.Receive, asgi.Send], Awaitable[None]],
              ) -> Callable[[asgi.Scope, asgi.Receive, asgi.Send], Awaitable[None]]:
    """The ASGI app of the ``/v2`` replica's HTTP routes: ``api``'s operations, request bodies up
    to ``limit`` bytes, ``restrictions`` (--http-restricted-api, --grpc-restricted-protocol),
    and ``unrouted_model`` answering a model route the front had no replica for."""

    async def body(receive: asgi.Receive) -> dict[str, Any]:
        return parse_json_body(await asgi.read_body(receive, limit))

    async def metadata(scope, receive, send) -> None:
        await asgi.send_json(send, 200, api.server_metadata())

    async def live(scope, receive, send) -> None:
        await asgi.send_empty(send, 200)

    async def ready(scope, receive, send) -> None:
        await asgi.send_empty(send, 200 if await api.ready() else 400)

    async def index(scope, receive, send) -> None:
        ready = repository_index_ready(await asgi.read_body(receive, limit))
        await asgi.send_json(send, 200, await api.index(ready))

    async def logging(scope, receive, send) -> None:
        if scope["method"] == "POST":
            api.set_log_settings(log_settings.update_from_http(api.log_settings, await body(receive)))
        await asgi.send_json(send, 200, api.log_settings)

    async def trace_setting(scope, receive, send) -> None:
        update = parse_update(await body(receive)) if scope["method"] == "POST" else None
        await asgi.send_json(send, 200, await api.trace_setting(scope["path_params"].get("model", ""), update))

    async def all_stats(scope, receive, send) -> None:
        await asgi.send_json(send, 200, {"model_stats": await api.model_stats("", "")})

    async def repository_model(scope, receive, send) -> None:
        model, action = scope["path_params"]["model"], scope["path_params"]["action"]
        if action not in ("load", "unload"):
            raise _not_found(scope)
        raw = await asgi.read_body(receive, limit, load_too_large if action == "load" else body_too_large)
        parameters = (parse_json_body(raw) if raw else {}).get("parameters") or {}
        if not isinstance(parameters, dict):
            raise InvalidArgError("'parameters' of a repository request must be a JSON object")
        await api.change_model(action, model, parameters)
        await asgi.send_empty(send, 200)

    async def rollouts(scope, receive, send) -> None:
        assert api.rollouts is not None
        await asgi.send_json(send, 200, {"rollouts": api.rollouts.all()})

    async def rollout(scope, receive, send) -> None:
        assert api.rollouts is not None
        model, action = scope["path_params"]["model"], scope["path_params"].get("action", "")
        if not action:
            if scope["method"] != "GET":
                raise _not_found(scope)
            await asgi.send_json(send, 200, api.rollouts.status(model))
            return
        if scope["method"] != "POST" or action not in ROLLOUT_ACTIONS:
            raise _not_found(scope)
        raw = await asgi.read_body(receive, limit)
        doc = parse_json_body(raw, "rollout") if raw else {}
        await asgi.send_json(send, 200, await api.rollouts.act(model, action, doc))

    async def model(scope, receive, send) -> None:
        route = parse_model_route(scope["path"])
        if route is None:
            raise _not_found(scope)
        await unrouted_model(route, scope, receive, send)

    def shared_memory(kind: str, action: str) -> _Endpoint:
        method = "GET" if action == "status" else "POST"

        async def handle(scope, receive, send) -> None:
            if scope["method"] != method:  # Triton's message names the extension, not the path
                raise NotFoundError(f"Not Found: {scope['method']} /v2/{kind}sharedmemory")
            name = scope["path_params"].get("name", "")
            if action == "status":
                await asgi.send_json(send, 200, api.shm.status(name, kind))
            elif action == "register":
                if not name:
                    raise InvalidArgError(f"'region name' is necessary to register {kind} shared memory region")
                if kind == CUDA:
                    api.require_gpus(name)
                doc = await body(receive)
                if kind == CUDA:
                    api.shm_register_cuda(name, *cuda_registration_from_json(doc))
                else:
                    api.shm_register(name, *registration_from_json(doc))
                await asgi.send_empty(send, 200)
            else:
                await api.shm_unregister(name, kind)
                await asgi.send_empty(send, 200)

        return _Endpoint(handle)

    routes = [
        Route("/v2", _Endpoint(metadata, ("GET",))),
        Route("/v2/health/live", _Endpoint(live, ("GET",))),
        Route("/v2/health/ready", _Endpoint(ready, ("GET",))),
        Route("/v2/repository/index", _Endpoint(index, ("POST",))),
        Route("/v2/repository/rollouts", _Endpoint(rollouts, ("GET",))),
        Route("/v2/repository/models/{model}/rollout", _Endpoint(rollout, ("GET",))),
        Route("/v2/repository/models/{model}/rollout/{action}", _Endpoint(rollout, ("POST",))),
        Route("/v2/repository/models/{model}/{action}", _Endpoint(repository_model, ("POST",))),
        Route("/v2/logging", _Endpoint(logging, ("GET", "POST"))),
        Route("/v2/trace/setting", _Endpoint(trace_setting, ("GET", "POST"))),
        Route("/v2/models/stats", _Endpoint(all_stats, ("GET",))),
        Route("/v2/models/{model}/trace/setting", _Endpoint(trace_setting, ("GET", "POST"))),
        Route("/v2/models/{rest:path}", _Endpoint(model)),
    ]
    for kind in ("system", "cuda"):
        for action in ("status", "register", "unregister"):
            routes.append(Route(f"/v2/{kind}sharedmemory/{action}", shared_memory(kind, action)))
            routes.append(Route(f"/v2/{kind}sharedmemory/region/{{name}}/{action}", shared_memory(kind, action)))

    async def not_found(scope: asgi.Scope, receive: asgi.Receive, send: asgi.Send) -> None:
        await asgi.send_error(send, _not_found(scope))

    router = Router(routes=routes, default=not_found, redirect_slashes=False)

    async def app(scope: asgi.Scope, receive: asgi.Receive, send: asgi.Send) -> None:
        if scope["type"] != "http":  # lifespan: the router answers it
            await router(scope, receive, send)
            return
        path = scope["path"].rstrip("/")
        if path.startswith(UNROUTED_PREFIX + "/"):  # the front's way to this app for a model route
            path = path[len(UNROUTED_PREFIX):]
        if await asgi.refuse_restricted(send, restrictions, path, scope["headers"]):
            return
        # The path as routed here, from the root (Serve's route prefix is not taken off).
        await router({**scope, "path": path, "root_path": "", _SENT_PATH: scope["path"]}, receive, send)

    return app
