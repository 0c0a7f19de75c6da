"""ServerDeployment: the ``/v2`` application for everything that is not one model's traffic.

The replica wires the ``/v2`` jobs together and supervises what runs beside them: model
control and readiness (:mod:`v2_api`, :class:`~rayinfer.serving.model_control.ModelController`),
Serve's state (:mod:`serve_state`), the front's route table (:mod:`route_table`), the
statistics store, and the processes and loops it starts (the front, the metrics port, the
repository poller, route publishing). Its HTTP routes are in :mod:`v2_http`, its gRPC methods in
:mod:`grpc_service`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from ray import serve
from tritonclient.grpc import service_pb2 as pb

from rayinfer.deployments import asgi
from rayinfer.deployments.control import ServeDeployer
from rayinfer.transport.front_config import TlsSettings
from rayinfer.deployments.grpc_service import RPC_NAMES, GrpcInferenceService, loopback_port, want_loopback_port
from rayinfer.deployments.metrics_endpoint import MetricsEndpoint
from rayinfer.deployments.model_forwarder import ModelForwarder
from rayinfer.deployments.names import SERVER_APP, app_model
from rayinfer.deployments.rollouts import Rollouts
from rayinfer.deployments.replica_options import ModelControl
from rayinfer.deployments.route_table import RouteTable
from rayinfer.deployments.serve_state import ServeState
from rayinfer.deployments.cluster_records import save_startup_ended, saved_load_errors
from rayinfer.deployments.v2_api import V2Api
from rayinfer.deployments.v2_http import v2_router
from rayinfer.protocol import log_settings
from rayinfer.protocol.errors import ServingError, as_serving_error
from rayinfer.protocol.restricted_api import parse_restrictions
from rayinfer.protocol.metrics import MetricsOptions
from rayinfer.protocol.limits import DEFAULT_MAX_INFLIGHT_REQUESTS, ConnectionLimits
from rayinfer.protocol.shared_memory import Registration
from rayinfer.repository.model_config import config_to_json
from rayinfer.repository.object_store import local_repository
from rayinfer.serving import response_cache
from rayinfer.serving.model_control import ModelController
from rayinfer.serving.trace import parse_update, settings_from_flags
from rayinfer.serving.routes import POST_ACTIONS, ModelRoute, keep_request_headers

# How often the front's routes are compared with the served versions and their replicas.
_ROUTES_REFRESH_S = 2.0

logger = logging.getLogger(__name__)


@serve.deployment(name="ServerDeployment")
@serve.ingress()
class ServerDeployment:
    """Serves the server-wide v2 endpoints (HTTP and gRPC); holds the statistics reported by
    model replicas; runs the metrics port, the front and the repository poller when asked to."""

    def __init__(
        self,
        model_repository: str,
        server_id: str = "triton",
        strict_readiness: bool = True,
        metrics: MetricsOptions | None = None,
        control: ModelControl | None = None,
        grpc_front: tuple[str, int, str, int] | None = None,
        http_front: tuple[str, int, str, int] | None = None,
        front_threads: int | None = None,
        http_restricted: list[str] | None = None,
        grpc_restricted: list[str] | None = None,
        max_inflight: int | None = None,
        direct_connections: bool = True,
        front_on_every_node: bool = False,
        tls: dict[str, dict[str, Any]] | None = None,
        startup_models: list[str] | None = None,
        load_errors: dict[str, str] | None = None,
        launch: str | None = None,
    ):
        """``front_on_every_node``: the front runs on every node with model replicas too
        (:mod:`node_fronts`), not only on this replica's. ``startup_models``: the models the
        server loads at start (it is not ready before each is served or failed);
        ``load_errors``: those of them that could not be read, with the reason. ``launch``: the
        ``rayinfer serve`` run that deployed this replica, which tells it when its start ended
        (:meth:`startup_ended`); a replica Serve starts again for the same launch reads that
        from :mod:`cluster_records` instead."""
        control = control or ModelControl()
        log_settings.write_lines_here()  # rayinfer's lines: Triton's format (see log_settings)
        # An s3:// repository is read from its copy on this node, brought up to date on each poll
        # and load; replicas are given the URL and copy their own model's folder.
        repository = local_repository(model_repository)
        self._controller = ModelController(repository, ServeDeployer(control), control.mode, str(model_repository))
        state = ServeState(repository, self._controller)
        self._front: Any = None
        # Checked by the front, and again here for what reaches Serve's ingress some other way.
        self._restrictions = (parse_restrictions(http_restricted or [], "--http-restricted-api"),
                              parse_restrictions(grpc_restricted or [], "--grpc-restricted-protocol"))
        if grpc_front is not None or http_front is not None:
            from rayinfer.deployments.front import Front
            from rayinfer.deployments.cluster_records import cluster_front_key

            options = {
                "server_app": SERVER_APP, "threads": front_threads, "max_input_size": control.max_input_size,
                "http_restricted": self._restrictions[0], "grpc_restricted": self._restrictions[1],
                "max_inflight": max_inflight or DEFAULT_MAX_INFLIGHT_REQUESTS, "direct": direct_connections,
                "tls": {kind: TlsSettings(**values) for kind, values in (tls or {}).items()},
                "limits": ConnectionLimits.from_values(dict(control.connection_limits)),
            }
            # The front key: each node's front reads it from the store itself (not an actor argument).
            self._front = Front(http_front, grpc_front, **options, front_key=cluster_front_key())
            if grpc_front is not None:
                want_loopback_port()
            if front_on_every_node:
                from rayinfer.deployments.node_fronts import Fronts

                self._front = Fronts(self._front, http_front, grpc_front, options)
        self._max_input_size = control.max_input_size
        self._max_inflight = max_inflight or DEFAULT_MAX_INFLIGHT_REQUESTS
        self._connection_limits = dict(control.connection_limits)
        self._api = V2Api(server_id, strict_readiness, self._controller, state, RouteTable(state, self._front),
                          control.poll_secs,
                          settings_from_flags(list(control.trace_config)))
        self._server_id, self._launch = server_id, launch
        ended = saved_load_errors(server_id, launch) if launch else None
        self._controller.load_errors = dict(load_errors or {}) if ended is None else ended
        self._api.startup_pending = set(startup_models or ()) if ended is None else set()
        # --log-verbose and the --log-* flags (a Serve config written before them: --log-verbose alone).
        start = log_settings.default_settings(verbose_level=1 if control.log_level == "DEBUG" else 0)
        self._api.set_log_settings({**start, **dict(control.log_settings)})
        if control.cache_size_bytes:  # a new server: its models may differ from the last one's
            response_cache.clear(response_cache.default_root())
            self._api.cache_size_bytes = control.cache_size_bytes
        self._api.rollouts = Rollouts(self._api, server_id)
        self._api.on_unload.append(self._api.rollouts.forget)
        self._forwarder = ModelForwarder(self._api)
        self._grpc = GrpcInferenceService(self._api, self._forwarder, self._restrictions,
                                          ConnectionLimits.from_values(dict(control.connection_limits)).max_queued_responses)
        self._api.on_unload.append(self._forwarder.forget)
        loop = asyncio.get_running_loop()
        self._tasks: list[asyncio.Task] = []
        if control.mode == "poll":
            self._tasks.append(loop.create_task(self._api.poll_forever(repository)))
        if self._front is not None:
            self._tasks.append(loop.create_task(self._publish_routes_forever()))
        self._tasks.append(loop.create_task(self._api.rollouts.run_forever()))
        self._metrics: MetricsEndpoint | None = None
        if metrics is not None:
            self._metrics = MetricsEndpoint(
                functools.partial(self._api.render_metrics, summary_quantiles=metrics.summary_quantiles,
                                  counter_latencies=metrics.counter_latencies,
                                  histogram_latencies=metrics.histogram_latencies), metrics)
            self._metrics.start()

    def __getattr__(self, name: str) -> Any:
        """Serve's gRPC ingress calls the deployment's method named after the RPC: the
        service's (:class:`~rayinfer.deployments.grpc_service.GrpcInferenceService`)."""
        if name in RPC_NAMES and "_grpc" in self.__dict__:
            return self._grpc.rpc(name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    # ---- calls from model replicas ----------------------------------------------------------

    async def register_listener(self, replica_key: str, app: str, host: str, port: int,
                                sequences: bool = False, actor: Any = None) -> dict[str, Any]:
        """Register a model replica's listener (``sequences``: its model routes sequences by
        slot; ``actor``: the replica's Ray actor, asked why it died if it stops registering);
        answers the log and trace settings it is to follow, and for a sequence model the slots'
        listeners."""
        routes = self._api.routes
        await routes.register(replica_key, app, host, port, sequences, actor)
        model = app_model(app)
        version = next((key.split("/", 1)[1] for key, (a, _) in self._api.state.routes.items()
                        if a == app and not key.endswith("/")), "")
        assert self._api.rollouts is not None
        return {"log": self._api.log_settings, "trace": self._api.trace_settings.as_dict(),
                "version_less": self._api.rollouts.routes_version_less(model, version),
                "split": self._api.rollouts.split_of(model, version),
                "shadow": self._api.rollouts.shadow_target(model, version),
                "sequence_slots": routes.slot_table(app) if sequences else None, "max_inflight": self._max_inflight,
                "connection_limits": self._connection_limits}

    async def control_poll(self, replica_key: str, epoch: str | None, acked: int) -> tuple[str, list[Any]]:
        """A model replica's long poll on the control channel (:mod:`control_channel`)."""
        return await self._api.routes.channel.poll(replica_key, epoch, acked)

    async def trace_setting(self, model: str, doc: dict[str, Any] | None) -> dict[str, Any]:
        """A model's trace settings over HTTP, which Serve routes to the model's replica."""
        return await self._api.trace_setting(model, parse_update(doc) if doc is not None else None)

    async def report_traces(self, model: str, traces: list[dict[str, Any]]) -> None:
        """Traces a model replica took (the trace extension)."""
        await self._api.report_traces(model, traces)

    async def trace_sent(self, token: str, stamps: list[tuple[str, int]]) -> None:
        """When the responses of a traced stream request were written by the model replica that
        holds the stream's connection (its trace's GRPC_SEND_START and _END)."""
        self._api.traces.sent(token, stamps)

    async def shared_memory_region(self, name: str) -> Registration | None:
        """A model replica's request names a region it has not mapped: its registration, if any."""
        return self._api.shm_registration(name)

    async def withdraw_listener(self, replica_key: str) -> None:
        await self._api.routes.withdraw(replica_key)

    async def report_statistics(self, replica_key: str, model: str, version: str, snapshot: dict[str, Any],
                                wanted: str | None = None) -> list[tuple[str, dict[str, Any]]]:
        return await self._api.report_statistics(replica_key, model, version, snapshot, wanted)

    async def model_route(self, name: str, version: str, strict: bool = True) -> tuple[str, str] | None:
        """(application, deployment) serving ``name`` at ``version`` ("" for the default) for a
        model's BLS call or a stream's request; Triton's error (or None when not ``strict``) if it is not served."""
        route = await self._forwarder.route(name, version)
        if route is None and strict:
            raise await self._api.unavailable_model(name, version or None)
        return route

    async def ready_models(self) -> list[str]:
        """The models with a version ready now (the OpenAI-compatible API's model list)."""
        return sorted({row["name"] for row in await self._api.index(ready_only=True)})

    async def report_shadow(self, replica_key: str, model: str, candidate: str, counts: dict[str, int]) -> None:
        """A stable version's replica's shadow counts (deployments/shadow_sender.py)."""
        assert self._api.rollouts is not None
        self._api.rollouts.report_shadow(replica_key, model, candidate, counts)

    async def model_routes(self, name: str, version: str) -> tuple[tuple[str, str], Any]:
        """As :meth:`model_route`, with a model in a rollout's split for version-less requests:
        (route, None) or (the stable version's route, (split, the candidate's route))."""
        split = None if version else self._api.state.splits.get(name)
        if split is not None:
            stable = await self._forwarder.route(name, split.stable)
            candidate = await self._forwarder.route(name, split.candidate)
            if stable is not None and candidate is not None:
                return stable, (split, candidate)
        route = await self.model_route(name, version)
        assert route is not None
        return route, None

    async def startup_ended(self, load_errors: dict[str, str], models: list[str]) -> None:
        """``rayinfer serve``, once each model it loads at start is deployed or failed:
        ``load_errors`` (the failed ones, with the reason) count against readiness and no
        startup model is waited for any more, in this replica and (by :mod:`cluster_records`)
        in one Serve starts again. Returns once the front routes ``models``, those it deployed
        (their replicas register their listeners every 2 s), so that a client told the server
        started finds them ready (up to 15 s; after that the ``/v2`` app answers for them)."""
        self._controller.load_errors = dict(load_errors)
        self._api.startup_pending = set()
        self._api.state.invalidate()
        if self._launch:
            await asyncio.to_thread(save_startup_ended, self._server_id, self._launch, dict(load_errors))
        await self._api.routes.wait_routed(*models)

    async def member_listeners(self, name: str, version: str) -> tuple[str, str, list[tuple[str, int]]]:
        """An ensemble's step target: (application, deployment, its replicas' listeners);
        Triton's error when the version is not served."""
        route = await self.model_route(name, version)
        assert route is not None
        return route[0], route[1], self._api.routes.listeners(route[0])

    async def member_route(self, name: str, version: str) -> tuple[str, str] | None:
        """A loading ensemble's member: its route when served, None while it is still loading,
        else Triton's error with the reason it is not served."""
        route = await self._forwarder.route(name, version)
        if route is not None:
            return route
        rows = [r for r in await self._api.state.refresh()
                if r["name"] == name and (not version or r.get("version") == version)]
        if any(r["state"] == "LOADING" for r in rows):
            return None
        raise await self._api.unavailable_model(name, version or None)

    async def change_model(self, action: str, model: str, parameters: dict[str, Any]) -> None:
        """A Python model's ``pb_utils.load_model`` / ``unload_model``."""
        await self._api.change_model(action, model, parameters)

    # ---- HTTP ---------------------------------------------------------------------------------

    def __serve_build_asgi_app__(self) -> Any:
        return v2_router(self._api, self._max_input_size, self._restrictions, self.unrouted_model)  # deployments/v2_http.py

    async def unrouted_model(self, route: ModelRoute, scope: asgi.Scope, receive: asgi.Receive,
                             send: asgi.Send) -> None:
        """A model route the front had no replica for: the model is unknown, unavailable or still
        loading (Triton's "not ready" at once), or its replicas run but are not registered with
        the front (yet: a dedicated replica starting; a pooled version that its pool replica
        unloaded loads again), answered through a deployment handle, as over gRPC."""
        name, version, method = route.model, route.version, scope["method"]
        if method == "POST" and route.action in POST_ACTIONS:
            # (A rollout's sticky header picks the version, as the front would.)
            target = await self._forwarder.route(name, version, dict(scope["headers"]))
            if target is None:
                raise await self._api.unavailable_model(name, version or None)
            body = await asgi.read_body(receive, self._max_input_size)
            try:
                status, headers, payload = await self._forwarder.http(
                    target, method, route, keep_request_headers(scope["headers"]), body)
            except ServingError:
                raise
            except Exception as exc:  # the replica's failure, as Ray raises it
                raise as_serving_error(exc) from None
            await asgi.send_bytes(send, status, payload, headers)
            return
        routed = method == "GET" and route.action != "infer" and await self._forwarder.route(name, version) is not None
        if route.action == "ready" and method == "GET":
            answer = await self._grpc.ModelReady(pb.ModelReadyRequest(name=name, version=version)) if routed else None
            await asgi.send_empty(send, 200 if answer is not None and answer.ready else 400)
        elif not routed:
            raise await self._api.unavailable_model(name, version or None)
        elif route.action == "stats":
            await asgi.send_json(send, 200, {"model_stats": await self._api.model_stats(name, version)})
        else:
            try:
                doc = await self._forwarded_document(route)
            except ServingError:
                raise
            except Exception as exc:  # the replica's failure, as Ray raises it
                raise as_serving_error(exc) from None
            await asgi.send_json(send, 200, doc)

    async def _forwarded_document(self, route: ModelRoute) -> dict[str, Any]:
        """A served model's metadata or config from one of its replicas, in Triton's HTTP form."""
        name, version = route.model, route.version
        if route.action == "config":
            config = await self._forwarder.forward("ModelConfig", name, version,
                                                   pb.ModelConfigRequest(name=name, version=version))
            return config_to_json(config.config)
        meta = await self._forwarder.forward("ModelMetadata", name, version,
                                             pb.ModelMetadataRequest(name=name, version=version))
        inputs, outputs = ([{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in group]
                           for group in (meta.inputs, meta.outputs))
        return {"name": meta.name, "versions": list(meta.versions), "platform": meta.platform,
                "inputs": inputs, "outputs": outputs}

    # ---- supervision ----------------------------------------------------------------------------

    async def _publish_routes_forever(self) -> None:
        port_given = False
        while True:
            await self._api.routes.publish()
            if not port_given and (port := loopback_port()) is not None:
                port_given = await self._give_front_grpc_port(port)
            await asyncio.sleep(_ROUTES_REFRESH_S)

    async def _give_front_grpc_port(self, port: int) -> bool:
        """Give the front this replica's gRPC port on 127.0.0.1 (until it has it, the front sends
        this replica's gRPC calls through Serve's ingress); False to try again later."""
        try:
            await self._front.use_v2_port(port)
        except OSError:  # the front's admin socket
            return False
        except RuntimeError as exc:
            logger.warning("the front cannot call this replica's gRPC server directly: %s", exc)
        return True

    def check_health(self) -> None:
        """Serve restarts this replica (which starts a new front) if the front has died."""
        if self._front is not None and not self._front.running:
            raise RuntimeError("the front (HAProxy) has exited")

    def __del__(self) -> None:
        controller = getattr(self, "_controller", None)
        if controller is not None:
            controller.close()
        metrics = getattr(self, "_metrics", None)
        if metrics is not None:
            metrics.stop()
        for task in getattr(self, "_tasks", []):
            task.cancel()
        front = getattr(self, "_front", None)
        if front is not None:
            front.stop()
        api = getattr(self, "_api", None)
        if api is not None:  # traces kept for the end (log_frequency 0) go to the trace file now
            api.traces.close()
