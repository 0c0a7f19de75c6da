"""ModelDeployment: one Serve deployment per model version, a shell around a ModelCore.

The replica loads the model into a :class:`~rayinfer.serving.model_core.ModelCore` and answers
through it: the calls the front relays (HTTP infer requests and the model RPCs) arrive at the
replica's own listener (:mod:`replica_listener`), the other HTTP model routes (metadata,
readiness, config, statistics) through Serve's ingress, and model RPCs the ``/v2`` replica
forwards by deployment handle (``grpc_forwarded``). Serve's gRPC ingress sends this
application nothing: the front addresses every call it does not route to the ``/v2`` one.
The replica registers its listener with the ``/v2`` replica and reports its statistics there.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import ray
from ray import serve

from rayinfer.adapters.loader import load_runner
from rayinfer.adapters.python_backend import bls
from rayinfer.deployments import asgi
from rayinfer.deployments.autoscaling import LISTENER_ONGOING
from rayinfer.deployments.bls_client import ReplicaBlsClient
from rayinfer.deployments.shadow_sender import ShadowSender
from rayinfer.deployments.ensemble_members import EnsembleMembers, load_ensemble
from rayinfer.deployments.front_key_store import cluster_front_key
from rayinfer.deployments.control_channel import (
    ROLLOUT_SPLIT,
    SEQUENCE_SLOTS,
    SHM_FORGET,
    TRACE_SETTINGS,
    ControlMessage,
)
from rayinfer.deployments.names import SERVER_APP, SERVER_DEPLOYMENT
from rayinfer.deployments.serve_internals import replica_id
from rayinfer.deployments.replica_streams import ReplicaStreams
from rayinfer.transport.replica_listener import ReplicaListener
from rayinfer.protocol import log_settings
from rayinfer.protocol.errors import NotFoundError, ServingError, UnavailableError, UnsupportedError, as_serving_error
from rayinfer.protocol.http_codec import parse_json_body
from rayinfer.protocol.limits import DEFAULT_HTTP_MAX_INPUT_SIZE, ConnectionLimits
from rayinfer.protocol.listener_client import STREAM_HEADER, ListenerClient, front_key_header
from rayinfer.protocol.shared_memory import Registration, SharedMemoryRegistry
from rayinfer.protocol.types import InferRequest, InferResponse, StreamEnd
from rayinfer.protocol.restricted_api import inference_headers, parse_restrictions
from rayinfer.repository.ensemble import is_ensemble
from rayinfer.repository.model_config import config_to_json, read_config
from rayinfer.repository.object_store import local_repository
from rayinfer.serving import model_grpc, model_http, otel, response_cache
from rayinfer.serving.executor import Result
from rayinfer.serving.model_core import ModelCore
from rayinfer.serving.response_cache import ResponseCache, model_fingerprint
from rayinfer.serving.sequence_routing import FORWARDED_HEADER, SequenceRoutes
from rayinfer.serving.protocol_stamps import StreamTrace, stamp_http_request
from rayinfer.serving.trace import TraceSettings
from rayinfer.serving.routes import keep_request_headers, parse_model_route
from rayinfer.transport.replica_routes import ReplicaRoutes

logger = logging.getLogger(__name__)

_STATS_PUSH_INTERVAL_S = 0.5
# The replica's listener is registered with the ``/v2`` replica this often (which forgets
# a listener not registered again within a few intervals: a replica that died).
_LISTENER_REGISTER_INTERVAL_S = 2.0
# The last message of every streaming handle call (grpc_stream, bls_stream), which the caller
# drops: a call that yields nothing ends as a gRPC trailers-only response, without the initial
# metadata Serve's handle waits for, and Serve then fails it ("Unexpected error
# (StatusCode.OK)"), about once in 25 such calls here.
_STREAM_END = b""
# How long a replica being stopped waits for the calls its listener is answering.
_LISTENER_DRAIN_S = 10.0
# How long a replica being stopped waits for its last spans to be exported (opentelemetry mode).
_SPAN_FLUSH_MS = 5000
# How long a replica waits for the /v2 replica to tell it a shared memory region's registration.
_SHM_FETCH_S = 10.0
# A model's trace settings, which Serve routes to the model's application (its route prefix).
_TRACE_ROUTE = re.compile(r"/v2/models/([^/]+)/trace/setting")


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
        self._replica_key = f"{context.app_name}/{replica_id(context)}"
        self._app_name = context.app_name
        # The statistics last pushed, by the key they were reported under (_reported_cores).
        self._pushed: dict[str, tuple[int, ...]] = {}
        # A rollout's shadow traffic, when this replica's version is its stable one.
        self._shadow = ShadowSender()
        self._shadow_reported: dict[str, int] = {}
        # An ensemble's members, as its steps reach them (None for any other model).
        self._members: EnsembleMembers | None = None
        self._server: Any = None
        # A Python model's calls to other models (set before loading: initialize may call).
        self._bls = ReplicaBlsClient(context.deployment)
        bls.set_client(self._bls)
        # A replica given a share of a GPU runs the model's GPU instances (Ray sets
        # CUDA_VISIBLE_DEVICES to that GPU); one given none runs them on the CPU.
        on_gpu = bool(ray.get_gpu_ids())
        # An s3:// repository: this model's folder, copied to this node.
        # --http-restricted-api / --grpc-restricted-protocol: checked by the front, and by this
        # replica's listener for a client that reaches it directly; its own calls to other
        # replicas' listeners carry the inference group's header.
        restricted = restricted or {}
        restrictions = (parse_restrictions(restricted.get("http", []), "--http-restricted-api"),
                        parse_restrictions(restricted.get("grpc", []), "--grpc-restricted-protocol"))
        # The server's front key: this replica's listener serves only requests with it over its
        # port, and its own calls to other replicas' listeners carry it.
        front_key = await asyncio.to_thread(cluster_front_key)
        peer_headers = (front_key_header(front_key), *inference_headers(restrictions[0]))
        self._restrictions = restrictions  # and at Serve's HTTP ingress (_asgi)
        repository = await asyncio.to_thread(local_repository, model_repository, [model_name])
        if is_ensemble(read_config(repository / model_name, override=config_override)):
            # An ensemble runs no model of its own: it calls its members' deployments (and reads
            # their folders: all of an s3:// repository).
            self._members = EnsembleMembers(peer_headers)
            repository = await asyncio.to_thread(local_repository, model_repository)
            runner, entry = await load_ensemble(repository, model_name, int(version), config_override, self._members)
        else:
            runner, entry = await asyncio.to_thread(
                load_runner, repository, model_name, int(version), auto_complete, config_override, on_gpu, any_version
            )
        cache = _response_cache(repository / model_name, runner, cache_size_bytes)
        self._core = self._bls.core = ModelCore(runner, entry.versions, self._merged_statistics,
                                                SharedMemoryRegistry(self._shared_memory_region), cache)
        self._max_input_size = max_input_size
        self._listener = ReplicaListener(self._listener_grpc, self._listener_http, max_input_size, self._core.name,
                                         front_key)
        # Which requests on the clients' connections this replica holds are its own.
        self._routes = ReplicaRoutes(self._core.name, self._core.version)
        self._listener.routes = self._routes
        self._listener.restrict(*restrictions)
        self._listener.stream_grpc = ReplicaStreams(self._core, context.deployment, self._server_handle,
                                                    self._listener).answer
        host = ray.util.get_node_ip_address()
        self._listener_address = (host, await self._listener.start(host))
        # A sequence model's replicas each hold their own sequences: a request of another
        # replica's sequence is sent on to it (a decoupled model's responses stream back).
        self._sequences: SequenceRoutes | None = None
        if self._core.spec.sequence_batching is not None and self._members is None:
            self._sequences = SequenceRoutes(self._listener_address)
            self._sequence_client = ListenerClient(peer_headers)
            self._core.route_sequences(self._sequences.owner, self._send_sequence_on, self._stream_sequence_on)
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
        """Serve's HTTP ingress: the model's routes."""
        if scope["type"] == "lifespan":
            await asgi.handle_lifespan(receive, send)
            return
        if await asgi.refuse_restricted(send, self._restrictions, scope["path"], scope["headers"]):
            return
        route = parse_model_route(scope["path"])
        if route is None:
            trace = _TRACE_ROUTE.fullmatch(scope["path"].rstrip("/"))
            if trace is not None and scope["method"] in ("GET", "POST"):
                # Serve sends the model's prefix here: the trace settings live in the /v2 replica.
                await self._trace_setting(trace[1], scope["method"], receive, send)
                return
            await asgi.send_error(send, NotFoundError(f"Not Found: {scope['method']} {scope['path']}"))
            return
        recv_start = time.perf_counter_ns()
        try:
            body = await asgi.read_body(receive, self._max_input_size) if scope["method"] == "POST" else b""
        except ServingError as exc:
            await asgi.send_error(send, exc)
            return
        headers = keep_request_headers(scope["headers"])
        # The trace extension's protocol stamps (and a client's trace context), as a listener's.
        stamps = stamp_http_request(self._core.name, recv_start, scope["headers"])
        status, extra_headers, payload = await model_http.respond(self._core, scope["method"], route, headers, body,
                                                                  self._max_input_size)
        send_start = time.perf_counter_ns()
        if isinstance(payload, bytes):
            await asgi.send_bytes(send, status, payload, extra_headers)
        else:  # generate_stream's events
            await asgi.send_chunks(send, status, payload, extra_headers)
        if stamps.finish is not None:  # a traced request: its trace ends here
            stamps.finish(send_start, time.perf_counter_ns())

    async def _trace_setting(self, model: str, method: str, receive: asgi.Receive, send: asgi.Send) -> None:
        try:
            doc = parse_json_body(await asgi.read_body(receive, self._max_input_size)) if method == "POST" else None
            settings = await self._server_handle().trace_setting.remote(model, doc)
        except Exception as exc:
            await asgi.send_error(send, as_serving_error(exc))
            return
        await asgi.send_json(send, 200, settings)

    async def _listener_http(self, method: str, path: str, headers: dict[bytes, bytes],
                             body: bytes) -> model_http.HttpResponse:
        """A model route the front relayed to this replica's listener: an infer request, or a GET
        of the model's metadata, readiness, config or statistics."""
        route = parse_model_route(path, encoded=True)
        if route is None:
            raise NotFoundError(f"Not Found: {method} {path}")
        if STREAM_HEADER in headers and FORWARDED_HEADER in headers and self._core.decoupled \
                and route.action == "infer" and method == "POST" and model_http.unknown_version(self._core, route) is None:
            # Another replica sent on a request of a sequence this one holds: stream the responses.
            return await model_http.stream_forwarded(self._core, headers, body, self._max_input_size)
        return await model_http.respond(self._core, method, route, headers, body, self._max_input_size)

    async def _listener_grpc(self, method: str, payload: bytes) -> bytes:
        """A model RPC the front relayed to this replica's listener."""
        return await model_grpc.call_serialized(self._core, method, payload)

    async def grpc_forwarded(self, method: str, payload: bytes) -> bytes:
        """A model RPC the ``/v2`` replica forwards by handle: messages travel serialized
        (protobuf messages do not pickle); errors travel as ServingError."""
        return await model_grpc.call_serialized(self._core, method, payload)

    async def bls_infer(self, request: InferRequest) -> InferResponse:
        """A Python model's BLS request (``exec`` / ``async_exec``) to this model."""
        if self._core.decoupled:
            raise UnsupportedError(f"model '{self._core.name}' is decoupled: call it with exec(decoupled=True)")
        return await self._core.infer(self._core.prepare(request))

    async def _send_sequence_on(self, listener: tuple[str, int], request: InferRequest) -> InferResponse:
        """A request of a sequence another replica holds, answered by that replica."""
        return await self._sequence_client.infer(listener, request, ((FORWARDED_HEADER, b"1"),))

    def _stream_sequence_on(self, listener: tuple[str, int], request: InferRequest) -> AsyncIterator[Result]:
        """A decoupled model's request of a sequence another replica holds: that replica's responses."""
        return self._sequence_client.stream(listener, request, ((FORWARDED_HEADER, b"1"),))

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's autoscaler, for a model whose parameters ask for autoscaling: the calls this
        replica's listener is answering, which Serve does not count itself (deployments/autoscaling.py)."""
        return {LISTENER_ONGOING: float(self._listener.in_flight)}

    async def model_ready(self) -> bool:
        """Whether the model says it can serve (an ensemble asks its members this)."""
        return await self._core.ready()

    def model_config_json(self) -> str:
        """The model's config as served (auto-completed), in Triton's JSON form."""
        return json.dumps(self._core.config_json)

    async def bls_stream(self, request: InferRequest, mark_final_alone: bool = False) -> Any:
        """A request by streaming handle (a Python model's BLS request with
        ``exec(decoupled=True)``, an ensemble's step to a decoupled member, the OpenAI API's):
        each response as it comes; ``mark_final_alone``: then ``StreamEnd.FINAL_ALONE`` if a
        decoupled model sent its final flag on its own (a BLS iterator's last response)."""
        prepared = self._core.prepare(request)
        responses = self._core.stream(prepared)
        try:
            async for result in responses:
                yield result
        finally:  # a caller that gave up: the request is cancelled now, not when the stream is collected
            await responses.aclose()
        sender = prepared.sender
        if mark_final_alone and self._core.decoupled and not (sender is not None and sender.final_yielded):
            yield StreamEnd.FINAL_ALONE
        yield None  # the end (see _STREAM_END)

    async def grpc_stream(self, payload: bytes, trace_context: str | None = None,
                          read_walls: tuple[int, int] | None = None) -> Any:
        """One request of a gRPC stream the ``/v2`` replica forwards by streaming handle: its
        serialized ModelStreamInferResponse messages, as the model answers them
        (``trace_context``: the client's traceparent, for the opentelemetry trace mode;
        ``read_walls``: when, on the wall clock in ns, the ``/v2`` replica began and ended reading
        it)."""
        async for message in model_grpc.stream_serialized(self._core, payload, trace_context, read_walls):
            if isinstance(message, StreamTrace):  # a traced request's: on this node's clock
                message = message._replace(node=ray.get_runtime_context().get_node_id())
            yield message
        yield _STREAM_END

    # ---- the /v2 replica: statistics and the listener's registration ------------------------

    def _server_handle(self) -> Any:
        """One handle to the ``/v2`` app for the replica's life: each new handle builds a router."""
        if self._server is None:
            self._server = serve.get_deployment_handle(SERVER_DEPLOYMENT, SERVER_APP)
        return self._server

    def _trace_settings(self, doc: dict[str, Any]) -> None:
        """The trace extension's settings from the ``/v2`` replica: this model's apply."""
        settings = TraceSettings.from_dict(doc)
        self._core.tracer.configure(settings.of(self._core.name), settings.version, settings.opentelemetry)

    def _take_control(self, message: ControlMessage) -> None:
        """A change the ``/v2`` replica sent on the control channel."""
        if message.kind == TRACE_SETTINGS:
            self._trace_settings(message.body)
        elif message.kind == SHM_FORGET:  # a region unregistered (every one of its kind for "")
            self._core.shm.unregister(message.body["name"], message.body["kind"])
        elif message.kind == SEQUENCE_SLOTS and self._sequences is not None:
            self._sequences.update(message.body)
        elif message.kind == ROLLOUT_SPLIT and message.body["model"] == self._core.name:
            # A rollout of this model changed (Rollouts.split_message): its stable and candidate
            # versions' parts in it.
            if self._core.version in message.body["version_less"]:
                self._routes.take_split(message.body["version_less"][self._core.version], message.body["split"])

    async def _poll_control_forever(self) -> None:
        """Take the ``/v2`` replica's changes as they come (:mod:`control_channel`)."""
        epoch, acked = None, 0
        while True:
            try:
                answer_epoch, messages = await self._server_handle().control_poll.remote(self._replica_key, epoch, acked)
            except Exception as exc:  # the server app may not be deployed (yet), or restarts
                logger.debug("could not poll the control channel: %s", exc)
                # Tried again as registration is: what was missed meanwhile comes with it.
                await asyncio.sleep(_LISTENER_REGISTER_INTERVAL_S)
                continue
            if answer_epoch != epoch:
                epoch, acked = answer_epoch, 0
            for seq, message in messages:
                try:
                    self._take_control(message)
                except Exception:
                    logger.exception("could not take the server's %s", message.kind)
                acked = max(acked, seq)

    async def _shared_memory_region(self, name: str) -> Registration | None:
        """A shared memory region a request names that this replica has not mapped:
        its registration with the ``/v2`` replica (None if there is none)."""
        try:
            return await asyncio.wait_for(self._server_handle().shared_memory_region.remote(name), _SHM_FETCH_S)
        except asyncio.TimeoutError:
            raise UnavailableError(f"shared memory region '{name}': the server did not answer in time") from None

    async def _merged_statistics(self, version: str, snapshot: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """Report this replica's figures and read back every replica's sum (one Ray call);
        this replica's own figures when the ``/v2`` app is absent (a hand-written Serve config)."""
        try:
            merged = await self._server_handle().report_statistics.remote(
                self._replica_key, self._core.name, self._core.version, snapshot, version
            )
            self._pushed[self._replica_key] = _change_key(snapshot)
            return merged
        except Exception as exc:
            logger.debug("falling back to this replica's statistics: %s", exc)
            return []

    async def _report_forever(self) -> None:
        """Register the listener every few seconds; push statistics when they changed."""
        registered_at = float("-inf")
        limit_values: Any = None
        while True:
            if time.monotonic() - registered_at >= _LISTENER_REGISTER_INTERVAL_S:
                try:
                    settings = await self._server_handle().register_listener.remote(
                        self._replica_key, self._app_name, *self._listener_address, self._sequences is not None,
                        ray.get_runtime_context().current_actor,
                    )
                    registered_at = time.monotonic()
                    self._listener.max_inflight = settings.get("max_inflight", self._listener.max_inflight)
                    self._routes.take_split(settings.get("version_less", True), settings.get("split"))
                    shadowing = self._shadow.configure(settings.get("shadow"))
                    self._core.on_answer = self._shadow.offer if shadowing and not self._core.decoupled else None
                    if settings.get("connection_limits") != limit_values:  # the flags, as at the last registration
                        limit_values = settings.get("connection_limits")
                        self._listener.limits = ConnectionLimits.from_values(limit_values)
                        self._core.max_queued_responses = self._listener.limits.max_queued_responses
                    if self._sequences is not None:
                        self._sequences.update(settings.get("sequence_slots"))
                    # The logging extension's (again: loggers created since get them too).
                    log_settings.apply(settings["log"])
                    self._trace_settings(settings["trace"])
                except Exception as exc:  # the server app may not be deployed (yet)
                    logger.debug("could not register the listener: %s", exc)
            await asyncio.sleep(_STATS_PUSH_INTERVAL_S)
            await self._report_shadow()
            for key, core in self._reported_cores():
                traces = core.tracer.collect()  # an in-place member's: its steps' child traces
                if traces:
                    try:
                        await self._server_handle().report_traces.remote(core.name, traces)
                    except Exception as exc:  # the server app may be gone: those traces are lost
                        logger.debug("could not report traces: %s", exc)
                snapshot = core.snapshot()
                if _change_key(snapshot) == self._pushed.get(key):
                    continue
                try:
                    await self._server_handle().report_statistics.remote(key, core.name, core.version, snapshot)
                    self._pushed[key] = _change_key(snapshot)
                except Exception as exc:  # the server app may not be deployed (yet)
                    logger.debug("could not publish statistics: %s", exc)

    async def _report_shadow(self) -> None:
        """The shadow counts, when they changed."""
        target, counts = self._shadow.target, self._shadow.counts.as_dict()
        if target is None or counts == self._shadow_reported:
            return
        try:
            await self._server_handle().report_shadow.remote(self._replica_key, self._core.name, target["candidate"], counts)
            self._shadow_reported = counts
        except Exception as exc:  # the server app may be gone: the counts go with the next report
            logger.debug("could not report shadow counts: %s", exc)

    def _reported_cores(self) -> list[tuple[str, ModelCore]]:
        """(key, core) of the model served here and of an ensemble's members running here,
        whose figures count as those of one more replica of the member."""
        cores = [(self._replica_key, self._core)]
        if self._members is not None and self._members.in_place is not None:
            cores += [(f"{self._replica_key}/in-place/{core.name}", core) for core in self._members.in_place.cores()]
        return cores

    async def __del__(self) -> None:
        """Serve stops the replica: out of the front's routes first, then drain."""
        for name in ("_report_task", "_control_task"):
            task = getattr(self, name, None)
            if task is not None:
                task.cancel()
        listener = getattr(self, "_listener", None)
        if listener is not None:
            try:
                await asyncio.wait_for(self._server_handle().withdraw_listener.remote(self._replica_key), 5.0)
            except Exception as exc:  # the /v2 app is gone too: nothing routes here any more
                logger.debug("could not withdraw the listener: %s", exc)
            await listener.close(_LISTENER_DRAIN_S)
        core = getattr(self, "_core", None)
        if core is not None:
            core.close()
        members = getattr(self, "_members", None)
        if members is not None:
            members.close()
        for name in ("_bls", "_sequence_client"):
            client = getattr(self, name, None)
            if client is not None:
                client.close()
        exporter = otel.current()
        if exporter is not None:  # the opentelemetry trace mode: spans not yet exported go now
            await asyncio.to_thread(exporter.provider.force_flush, _SPAN_FLUSH_MS)


def _response_cache(model_dir: Path, runner: Any, size_bytes: int) -> ResponseCache | None:
    """The node's response cache for this model version, when the server has one
    (``--cache-config``) and the model's config enables it; Triton's rules for the models that
    cannot use one (decoupled and sequence models) are logged, and the model serves uncached."""
    spec = runner.spec
    if not spec.config.response_cache.enable:
        return None
    name = spec.name
    if size_bytes <= 0:
        logger.warning("model '%s' enables response_cache but the server has no cache (--cache-config "
                       "local,size=N): its responses are not cached", name)
        return None
    if getattr(runner, "decoupled", False) or spec.sequence_batching is not None:
        logger.warning("model '%s': the response cache does not support decoupled or sequence models: its "
                       "responses are not cached", name)
        return None
    version = str(getattr(runner, "version", ""))
    fingerprint = model_fingerprint(model_dir, version, json.dumps(config_to_json(spec.config), sort_keys=True))
    try:
        return ResponseCache(response_cache.default_root(), name, version, fingerprint, size_bytes)
    except OSError as exc:  # the node's cache folder is unusable (another user's, ...): no cache
        logger.warning("model '%s': the response cache is off: %s", name, exc)
        return None


def _change_key(snapshot: dict[str, Any]) -> tuple[int, ...]:
    durations = snapshot["durations"]  # successes count the response cache's hits, which execute nothing
    return (snapshot["execution_count"], durations["success"][0], durations["fail"][0],
            snapshot["pending_request_count"], snapshot.get("custom_metrics_version", 0))
