"""The OpenAI-compatible API's Serve deployment: the ``openai`` application at ``/v1``.

The front sends ``/v1`` requests on the HTTP port to Serve's HTTP ingress, which routes them
here by route prefix; each model request goes to a replica of the model version by deployment
handle (``ModelDeployment.bls_stream``: the model's validation, batcher, statistics and
metrics, as for any client), the version found as a model's BLS calls find it (the ``/v2``
replica names it; a rollout's split applies). Serve watches each request's connection: a client
that goes away cancels the request, and so the model's (its ``is_cancelled()``).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from rayinfer.deployments import asgi
from rayinfer.deployments.model_forwarder import ModelRoutes
from rayinfer.deployments.names import SERVER_APP, SERVER_DEPLOYMENT
from rayinfer.deployments.model_handles import model_handle
from rayinfer.protocol.limits import DEFAULT_HTTP_MAX_INPUT_SIZE
from rayinfer.protocol.openai_requests import ModelInterface, model_interface
from rayinfer.protocol.openai_responses import encode
from rayinfer.protocol.restricted_api import missing_openai_header, openai_restricted_document, parse_restrictions
from rayinfer.protocol.types import InferRequest
from rayinfer.serving.openai_service import OpenAIOptions, OpenAIService, Result, error_answer

# How long a model's config, as the API reads it, is kept (a reload may change it).
INTERFACE_TTL_S = 5.0


class ServeModelAccess:
    """Models reached by deployment handle (:class:`~rayinfer.serving.openai_service.ModelAccess`)."""

    def __init__(self) -> None:
        self._server: Any = None
        self._routes = ModelRoutes(self._server_handle)
        self._handles: dict[tuple[str, str], Any] = {}
        self._interfaces: dict[tuple[str, str], tuple[float, ModelInterface]] = {}

    def _server_handle(self) -> Any:
        if self._server is None:
            self._server = serve.get_deployment_handle(SERVER_DEPLOYMENT, SERVER_APP)
        return self._server

    def _handle(self, route: tuple[str, str]) -> Any:
        handle = self._handles.get(route)
        if handle is None:
            handle = self._handles[route] = model_handle(route)
        return handle

    async def ready_models(self) -> list[str]:
        return list(await self._server_handle().ready_models.remote())

    async def interface(self, model: str) -> ModelInterface:
        route = await self._routes.route(model, "")
        cached = self._interfaces.get(route)
        if cached is None or time.monotonic() - cached[0] >= INTERFACE_TTL_S:
            config = json.loads(await self._handle(route).model_config_json.remote())
            cached = self._interfaces[route] = (time.monotonic(), model_interface(config))
        return cached[1]

    async def stream(self, request: InferRequest) -> AsyncIterator[Result]:
        route = await self._routes.route(request.model_name, request.model_version)
        responses = self._handle(route).options(stream=True).bls_stream.remote(request)
        ended = False
        try:
            async for result in responses:
                if result is None:  # the end of every stream (ModelDeployment.bls_stream)
                    ended = True
                    return
                yield result
        finally:
            if not ended:  # given up: the model's request is cancelled
                responses.cancel()


@serve.deployment(name="OpenAIDeployment")
@serve.ingress()
class OpenAIDeployment:
    """Answers ``/v1``: the model list, completions, chat completions and embeddings."""

    def __init__(self, options: OpenAIOptions, max_input_size: int = DEFAULT_HTTP_MAX_INPUT_SIZE,
                 http_restricted: list[str] | None = None) -> None:
        self._service = OpenAIService(ServeModelAccess(), options)
        self._max_input_size = max_input_size
        self._restrictions = parse_restrictions(list(http_restricted or ()), "--http-restricted-api")

    def __serve_build_asgi_app__(self) -> Any:
        return asgi.asgi3(self._asgi)

    async def _asgi(self, scope: asgi.Scope, receive: asgi.Receive, send: asgi.Send) -> None:
        if scope["type"] == "lifespan":
            await asgi.handle_lifespan(receive, send)
            return
        method, path = scope["method"], scope["path"]
        key = missing_openai_header(self._restrictions, method, path, dict(scope["headers"]))
        if key is not None:  # --http-restricted-api, as the front checks it
            await asgi.send_bytes(send, 401, encode(openai_restricted_document(key)),
                                  [(b"content-type", b"application/json")])
            return
        try:
            body = await asgi.read_body(receive, self._max_input_size) if method == "POST" else b""
        except Exception as exc:
            status, headers, payload = error_answer(exc)
            await asgi.send_bytes(send, status, payload, headers)
            return
        status, headers, answer = await self._service.respond(method, path, body)
        if isinstance(answer, bytes):
            await asgi.send_bytes(send, status, answer, headers)
        else:
            await asgi.send_chunks(send, status, answer, headers)
