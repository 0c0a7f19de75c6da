"""ModelDeployment: one Serve deployment per model version, a shell around a HostedModel.

The replica loads the model as a :class:`~rayinfer.deployments.hosted_model.HostedModel` (its
:class:`~rayinfer.serving.model_core.ModelCore` and the listener the front hands clients'
connections to) and answers through it: the calls the front relays (HTTP infer requests and
the model RPCs) arrive at the listener, the other HTTP model routes (metadata, readiness,
config, statistics) through Serve's ingress, and model RPCs the ``/v2`` replica forwards by
deployment handle (``grpc_forwarded``). Serve's gRPC ingress sends this application nothing:
the front addresses every call it does not route to the ``/v2`` one. The shell runs the
replica's loops: it registers the listener with the ``/v2`` replica, reports statistics there
and takes the ``/v2`` replica's changes from the control channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from typing import Any

import ray
from ray import serve

from rayinfer.deployments import asgi
from rayinfer.deployments.autoscaling import LISTENER_ONGOING
from rayinfer.deployments.hosted_model import HostedModel, HostingOptions
from rayinfer.deployments.names import SERVER_APP, SERVER_DEPLOYMENT
from rayinfer.deployments.serve_internals import replica_id
from rayinfer.protocol import log_settings
from rayinfer.protocol.limits import DEFAULT_HTTP_MAX_INPUT_SIZE
from rayinfer.protocol.types import InferRequest, InferResponse
from rayinfer.serving.routes import ModelRoute

logger = logging.getLogger(__name__)

_STATS_PUSH_INTERVAL_S = 0.5
# The replica's listener is registered with the ``/v2`` replica this often (which forgets
# a listener not registered again within a few intervals: a replica that died).
_LISTENER_REGISTER_INTERVAL_S = 2.0


@serve.deployment(name="ModelDeployment")
@serve.ingress()
class ModelDeployment:
    """Serves one version of one model; keeps the model loaded per replica."""

    async def __init__(
        self,
        model_repository: str,
        model_name: str,
        version: int,
        auto_complete: bool = True,
        config_override: str | None = None,
        cache_size_bytes: int = 0,
        max_input_size: int = DEFAULT_HTTP_MAX_INPUT_SIZE,
        start_log_settings: dict[str, Any] | None = None,
        restricted: dict[str, list[str]] | None = None,
        any_version: bool = False,
    ):
        # rayinfer's and the model's lines: Triton's format, to this worker's stderr (or --log-file),
        # following the settings at start (--log-*) until the /v2 replica's current ones arrive.
        log_settings.write_lines_here()
        if start_log_settings:
            log_settings.apply({**log_settings.default_settings(), **start_log_settings})
        context = serve.get_replica_context()
        self._server: Any = None
        options = HostingOptions(
            auto_complete=auto_complete, config_override=config_override, cache_size_bytes=cache_size_bytes,
            max_input_size=max_input_size, any_version=any_version,
            restricted=tuple((kind, tuple(values)) for kind, values in (restricted or {}).items()),
        )
        self._model = await HostedModel.load(
            model_repository, model_name, version, options, replica_key=f"{context.app_name}/{replica_id(context)}",
            app_name=context.app_name, deployment=context.deployment, server=self._server_handle,
        )
        loop = asyncio.get_running_loop()
        self._report_task = loop.create_task(self._report_forever())
        self._control_task = loop.create_task(self._poll_control_forever())
        # Everything loaded so far (framework modules, the model) lives as long as the replica:
        # keep it out of the collector's generations so a full collection stays short.
        gc.freeze()

    # ---- entry points -----------------------------------------------------------------------

    def __serve_build_asgi_app__(self) -> Any:
        return asgi.asgi3(self._asgi)

    async def _asgi(self, scope: asgi.Scope, receive: asgi.Receive, send: asgi.Send) -> None:
        await self._model.asgi(scope, receive, send)

    async def grpc_forwarded(self, method: str, payload: bytes) -> bytes:
        """A model RPC the ``/v2`` replica forwards by handle: messages travel serialized
        (protobuf messages do not pickle); errors travel as ServingError."""
        return await self._model.grpc_forwarded(method, payload)

    async def http_forwarded(self, method: str, route: ModelRoute, headers: dict[bytes, bytes],
                             body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """A model route the ``/v2`` replica forwards by handle (its listener is not registered
        with the front yet): Triton's HTTP answer."""
        return await self._model.http_forwarded(method, route, headers, body)

    async def bls_infer(self, request: InferRequest) -> InferResponse:
        """A Python model's BLS request (``exec`` / ``async_exec``) to this model."""
        return await self._model.bls_infer(request)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaler, for a model whose parameters ask for autoscaling: the calls this
        replica's listener is answering, which Serve does not count itself (deployments/autoscaling.py)."""
        return {LISTENER_ONGOING: float(self._model.listener.in_flight)}

    async def model_ready(self) -> bool:
        """Whether the model says it can serve (an ensemble asks its members this)."""
        return await self._model.core.ready()

    def model_config_json(self) -> str:
        """The model's config as served (auto-completed), in Triton's JSON form."""
        return self._model.config_json()

    async def bls_stream(self, request: InferRequest, mark_final_alone: bool = False) -> Any:
        """A request by streaming handle (a Python model's BLS request with
        ``exec(decoupled=True)``, an ensemble's step to a decoupled member, the OpenAI API's):
        each response as it comes; ``mark_final_alone``: then ``StreamEnd.FINAL_ALONE`` if a
        decoupled model sent its final flag on its own (a BLS iterator's last response)."""
        async with contextlib.aclosing(self._model.bls_stream(request, mark_final_alone)) as messages:
            async for message in messages:  # a caller that gives up closes the model's stream at once
                yield message

    async def grpc_stream(self, payload: bytes, trace_context: str | None = None,
                          read_walls: tuple[int, int] | None = None) -> Any:
        """One request of a gRPC stream the ``/v2`` replica forwards by streaming handle: its
        serialized ModelStreamInferResponse messages, as the model answers them
        (``trace_context``: the client's traceparent, for the opentelemetry trace mode;
        ``read_walls``: when, on the wall clock in ns, the ``/v2`` replica began and ended reading
        it)."""
        async with contextlib.aclosing(self._model.grpc_stream(payload, trace_context, read_walls)) as messages:
            async for message in messages:
                yield message

    # ---- the /v2 replica: statistics and the listener's registration ------------------------

    def _server_handle(self) -> Any:
        """One handle to the ``/v2`` app for the replica's life: each new handle builds a router."""
        if self._server is None:
            self._server = serve.get_deployment_handle(SERVER_DEPLOYMENT, SERVER_APP)
        return self._server

    async def _poll_control_forever(self) -> None:
        """Take the ``/v2`` replica's changes as they come (:mod:`control_channel`)."""
        epoch, acked = None, 0
        while True:
            try:
                answer_epoch, messages = await self._server_handle().control_poll.remote(
                    self._model.replica_key, epoch, acked)
            except Exception as exc:  # the server app may not be deployed (yet), or restarts
                logger.debug("could not poll the control channel: %s", exc)
                # Tried again as registration is: what was missed meanwhile comes with it.
                await asyncio.sleep(_LISTENER_REGISTER_INTERVAL_S)
                continue
            if answer_epoch != epoch:
                epoch, acked = answer_epoch, 0
            for seq, message in messages:
                try:
                    self._model.take_control(message)
                except Exception:
                    logger.exception("could not take the server's %s", message.kind)
                acked = max(acked, seq)

    async def _report_forever(self) -> None:
        """Register the listener every few seconds; push statistics when they changed."""
        model = self._model
        registered_at = float("-inf")
        while True:
            if time.monotonic() - registered_at >= _LISTENER_REGISTER_INTERVAL_S:
                try:
                    settings = await self._server_handle().register_listener.remote(
                        model.replica_key, model.app_name, *model.listener_address, model.routes_sequences,
                        ray.get_runtime_context().current_actor,
                    )
                    registered_at = time.monotonic()
                    model.take_settings(settings)
                except Exception as exc:  # the server app may not be deployed (yet)
                    logger.debug("could not register the listener: %s", exc)
            await asyncio.sleep(_STATS_PUSH_INTERVAL_S)
            await model.report()

    async def __del__(self) -> None:
        """Serve stops the replica: out of the front's routes first, then drain."""
        for name in ("_report_task", "_control_task"):
            task = getattr(self, name, None)
            if task is not None:
                task.cancel()
        model = getattr(self, "_model", None)
        if model is not None:
            await model.close()
