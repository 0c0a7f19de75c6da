"""HostedModel: one model version loaded in a replica, with everything that serves it there.

A replica holds a model version as a :class:`HostedModel`: its
:class:`~rayinfer.serving.model_core.ModelCore`, the listener that takes the clients'
connections the front hands it (:mod:`~rayinfer.transport.replica_listener`), which requests on
them are its own (a rollout's split), its sequences' routing, its shadow traffic, and, for an
ensemble, its members. The replica's deployment (:mod:`model`) is the shell around it: it
gives the hosted model its calls by handle, runs the loops that keep the ``/v2`` replica
informed and hands it what they bring back (:meth:`take_settings`, :meth:`take_control`), and
closes it when Serve stops the replica. The model knows nothing of how many models share its
replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from rayinfer.adapters.loader import load_runner
from rayinfer.adapters.python_backend import bls
from rayinfer.deployments import asgi
from rayinfer.deployments.bls_client import ReplicaBlsClient
from rayinfer.deployments.control_channel import (
    ROLLOUT_SPLIT,
    SEQUENCE_SLOTS,
    SHM_FORGET,
    TRACE_SETTINGS,
    ControlMessage,
)
from rayinfer.deployments.ensemble_members import EnsembleMembers, load_ensemble
from rayinfer.deployments.cluster_records import cluster_front_key
from rayinfer.deployments.names import POOL_DEPLOYMENT
from rayinfer.deployments.replica_streams import ReplicaStreams
from rayinfer.deployments.shadow_sender import ShadowSender
from rayinfer.protocol import log_settings
from rayinfer.protocol.errors import (ModelConfigError, NotFoundError, ServingError, UnavailableError, UnsupportedError,
                                      as_serving_error)
from rayinfer.protocol.http_codec import parse_json_body
from rayinfer.protocol.limits import DEFAULT_HTTP_MAX_INPUT_SIZE, ConnectionLimits
from rayinfer.protocol.listener_client import STREAM_HEADER, ListenerClient, front_key_header
from rayinfer.protocol.restricted_api import inference_headers, parse_restrictions
from rayinfer.protocol.shared_memory import Registration, SharedMemoryRegistry
from rayinfer.protocol.types import InferRequest, InferResponse, StreamEnd
from rayinfer.repository.ensemble import is_ensemble
from rayinfer.repository.model_config import config_to_json, read_config
from rayinfer.repository.object_store import local_repository
from rayinfer.serving import model_grpc, model_http, otel, response_cache
from rayinfer.serving.executor import Result
from rayinfer.serving.model_core import ModelCore
from rayinfer.serving.protocol_stamps import StreamTrace, stamp_http_request
from rayinfer.serving.response_cache import ResponseCache, model_fingerprint
from rayinfer.serving.routes import ModelRoute, keep_request_headers, parse_model_route
from rayinfer.serving.sequence_routing import FORWARDED_HEADER, SequenceRoutes
from rayinfer.serving.trace import TraceSettings
from rayinfer.transport.replica_listener import ReplicaListener
from rayinfer.transport.replica_routes import ReplicaRoutes

logger = logging.getLogger(__name__)

# The last message of every streaming handle call (grpc_stream, bls_stream), which the caller
# drops: a call that yields nothing ends as a gRPC trailers-only response, without the initial
# metadata Serve's handle waits for, and Serve then fails it ("Unexpected error
# (StatusCode.OK)"), about once in 25 such calls here.
STREAM_END = b""
# How long a replica being stopped waits for the calls its listener is answering.
_LISTENER_DRAIN_S = 10.0
# How long a replica being stopped waits for its last spans to be exported (opentelemetry mode).
_SPAN_FLUSH_MS = 5000
# How long a replica waits for the /v2 replica to tell it a shared memory region's registration.
_SHM_FETCH_S = 10.0
# A model's trace settings, which Serve routes to the model's application (its route prefix).
_TRACE_ROUTE = re.compile(r"/v2/models/([^/]+)/trace/setting")


@dataclass(frozen=True)
class HostingOptions:
    """How a replica loads a model version: the server's options for every model replica."""

    auto_complete: bool = True
    config_override: str | None = None
    cache_size_bytes: int = 0
    max_input_size: int = DEFAULT_HTTP_MAX_INPUT_SIZE
    # --http-restricted-api and --grpc-restricted-protocol, by protocol ("http", "grpc").
    restricted: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # A version the version policy does not select (served while a rollout keeps it).
    any_version: bool = False


class HostedModel:
    """One model version served in this replica (build it with :meth:`load`)."""

    def __init__(self, replica_key: str, app_name: str, deployment: str, server: Callable[[], Any],
                 stats_key: str | None = None) -> None:
        self.replica_key = replica_key  # the registration key of this model in this replica
        # The key its statistics are reported under (the model pool keeps one per version across
        # its loads; else the registration key).
        self.stats_key = stats_key or replica_key
        self.app_name = app_name
        self._server = server  # the /v2 application's handle
        # The statistics last pushed, by the key they were reported under (reported_cores).
        self.pushed: dict[str, tuple[int, ...]] = {}
        # A rollout's shadow traffic, when this replica's version is its stable one.
        self._shadow = ShadowSender()
        self._shadow_reported: dict[str, int] = {}
        # An ensemble's members, as its steps reach them (None for any other model).
        self._members: EnsembleMembers | None = None
        self._sequences: SequenceRoutes | None = None
        self._sequence_client: ListenerClient | None = None
        self._limit_values: Any = None
        # A Python model's calls to other models (set before loading: initialize may call).
        # Calls by deployment handle in flight (the model pool counts them, to drain them).
        self.handle_calls = 0
        self._bls = ReplicaBlsClient((app_name, deployment))
        bls.set_client(self._bls)
        self._deployment = deployment

    @classmethod
    async def load(cls, model_repository: str, model_name: str, version: int, options: HostingOptions, *,
                   replica_key: str, app_name: str, deployment: str, server: Callable[[], Any],
                   stats_key: str | None = None) -> HostedModel:
        """Load ``model_name`` at ``version`` from the repository and start its listener."""
        hosted = cls(replica_key, app_name, deployment, server, stats_key)
        await hosted._load(model_repository, model_name, version, options)
        return hosted

    async def _load(self, model_repository: str, model_name: str, version: int, options: HostingOptions) -> None:
        # A replica given a share of a GPU runs the model's GPU instances (Ray sets
        # CUDA_VISIBLE_DEVICES to that GPU); one given none runs them on the CPU.
        on_gpu = bool(ray.get_gpu_ids())
        # --http-restricted-api / --grpc-restricted-protocol: checked by the front, and by this
        # replica's listener for a client that reaches it directly; its own calls to other
        # replicas' listeners carry the inference group's header.
        restricted = dict(options.restricted)
        restrictions = (parse_restrictions(list(restricted.get("http", ())), "--http-restricted-api"),
                        parse_restrictions(list(restricted.get("grpc", ())), "--grpc-restricted-protocol"))
        # The server's front key: this replica's listener serves only requests with it over its
        # port, and its own calls to other replicas' listeners carry it.
        front_key = await asyncio.to_thread(cluster_front_key)
        peer_headers = (front_key_header(front_key), *inference_headers(restrictions[0]))
        self.restrictions = restrictions  # and at Serve's HTTP ingress (asgi)
        # An s3:// repository: this model's folder, copied to this node.
        override = options.config_override
        repository = await asyncio.to_thread(local_repository, model_repository, [model_name])
        if is_ensemble(read_config(repository / model_name, override=override)):
            # An ensemble runs no model of its own: it calls its members' deployments (and reads
            # their folders: all of an s3:// repository).
            self._members = EnsembleMembers(peer_headers)
            repository = await asyncio.to_thread(local_repository, model_repository)
            runner, entry = await load_ensemble(repository, model_name, int(version), override, self._members)
        else:
            with bls.loading_with(self._bls):  # a Python model keeps its own (the pool holds many)
                runner, entry = await asyncio.to_thread(
                    load_runner, repository, model_name, int(version), options.auto_complete, override, on_gpu,
                    options.any_version,
                )
        cache = _response_cache(repository / model_name, runner, options.cache_size_bytes)
        self.core = self._bls.core = ModelCore(runner, entry.versions, self._merged_statistics,
                                               SharedMemoryRegistry(self._shared_memory_region), cache)
        if self._deployment == POOL_DEPLOYMENT and getattr(runner, "decoupled", False):
            await self.core.aclose()  # its auto_complete_config made it decoupled, which the pool does not host
            raise ModelConfigError(f"model '{model_name}' cannot be pooled: it is decoupled (its "
                                   "auto_complete_config says so); serve it 'dedicated'")
        if self._deployment == POOL_DEPLOYMENT and getattr(runner, "calls_models", False):
            # Its BLS calls may go to a neighbour in this replica, whose answer needs this loop.
            self.core.inline_executions = False
        self._max_input_size = options.max_input_size
        self.listener = ReplicaListener(self._listener_grpc, self._listener_http, options.max_input_size,
                                        self.core.name, front_key)
        # Which requests on the clients' connections this replica holds are its own.
        self._routes = ReplicaRoutes(self.core.name, self.core.version)
        self.listener.routes = self._routes
        self.listener.restrict(*restrictions)
        # This version's route: a pooled version's names its own application and the pool's deployment.
        own = (self.app_name, self._deployment)
        self.listener.stream_grpc = ReplicaStreams(self.core, own, self._server, self.listener).answer
        host = ray.util.get_node_ip_address()
        self.listener_address = (host, await self.listener.start(host))
        # A sequence model's replicas each hold their own sequences: a request of another
        # replica's sequence is sent on to it (a decoupled model's responses stream back).
        if self.core.spec.sequence_batching is not None and self._members is None:
            self._sequences = SequenceRoutes(self.listener_address)
            self._sequence_client = ListenerClient(peer_headers)
            self.core.route_sequences(self._sequences.owner, self._send_sequence_on, self._stream_sequence_on)

    @property
    def routes_sequences(self) -> bool:
        """Whether this model's replicas hold sequences by routing slot."""
        return self._sequences is not None

    # ---- calls ------------------------------------------------------------------------------

    async def asgi(self, scope: asgi.Scope, receive: asgi.Receive, send: asgi.Send) -> None:
        """Serve's HTTP ingress: the model's routes."""
        if scope["type"] == "lifespan":
            await asgi.handle_lifespan(receive, send)
            return
        if await asgi.refuse_restricted(send, self.restrictions, scope["path"], scope["headers"]):
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
        stamps = stamp_http_request(self.core.name, recv_start, scope["headers"])
        status, extra_headers, payload = await model_http.respond(self.core, scope["method"], route, headers, body,
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
            settings = await self._server().trace_setting.remote(model, doc)
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
        if STREAM_HEADER in headers and FORWARDED_HEADER in headers and self.core.decoupled \
                and route.action == "infer" and method == "POST" and model_http.unknown_version(self.core, route) is None:
            # Another replica sent on a request of a sequence this one holds: stream the responses.
            return await model_http.stream_forwarded(self.core, headers, body, self._max_input_size)
        return await model_http.respond(self.core, method, route, headers, body, self._max_input_size)

    async def http_forwarded(self, method: str, route: ModelRoute, headers: dict[bytes, bytes],
                             body: bytes) -> model_http.HttpResponse:
        """A model route the ``/v2`` replica forwards by handle (the front had no listener of the
        model for it); a streamed answer comes whole."""
        status, extra, payload = await model_http.respond(self.core, method, route, headers, body,
                                                          self._max_input_size)
        if not isinstance(payload, bytes):
            payload = b"".join([chunk async for chunk in payload])
        return status, extra, payload

    @property
    def busy(self) -> bool:
        """Whether a request is in flight here (on its listener or by deployment handle), or a
        sequence is open here (its state would go with the model)."""
        listener = getattr(self, "listener", None)
        core = getattr(self, "core", None)
        return bool(self.handle_calls or (listener is not None and listener.in_flight)
                    or (core is not None and core.open_sequences))

    @property
    def last_inference_s(self) -> float:
        """When (Unix time, seconds, full precision) it last answered a request; 0 if it has not."""
        return self.core.executor.stats.last_inference_s

    async def _listener_grpc(self, method: str, payload: bytes) -> bytes:
        """A model RPC the front relayed to this replica's listener."""
        return await model_grpc.call_serialized(self.core, method, payload)

    async def grpc_forwarded(self, method: str, payload: bytes) -> bytes:
        """A model RPC the ``/v2`` replica forwards by handle (serialized messages)."""
        return await model_grpc.call_serialized(self.core, method, payload)

    async def bls_infer(self, request: InferRequest) -> InferResponse:
        """A Python model's BLS request (``exec`` / ``async_exec``) to this model."""
        if self.core.decoupled:
            raise UnsupportedError(f"model '{self.core.name}' is decoupled: call it with exec(decoupled=True)")
        return await self.core.infer(self.core.prepare(request))

    async def _send_sequence_on(self, listener: tuple[str, int], request: InferRequest) -> InferResponse:
        """A request of a sequence another replica holds, answered by that replica."""
        assert self._sequence_client is not None
        return await self._sequence_client.infer(listener, request, ((FORWARDED_HEADER, b"1"),))

    def _stream_sequence_on(self, listener: tuple[str, int], request: InferRequest) -> AsyncIterator[Result]:
        """A decoupled model's request of a sequence another replica holds: that replica's responses."""
        assert self._sequence_client is not None
        return self._sequence_client.stream(listener, request, ((FORWARDED_HEADER, b"1"),))

    async def bls_stream(self, request: InferRequest, mark_final_alone: bool = False) -> AsyncIterator[Any]:
        """Each response to ``request`` as it comes, then ``StreamEnd.FINAL_ALONE`` if
        ``mark_final_alone`` and a decoupled model sent its final flag on its own, then None."""
        prepared = self.core.prepare(request)
        responses = self.core.stream(prepared)
        try:
            async for result in responses:
                yield result
        finally:  # a caller that gave up: the request is cancelled now, not when the stream is collected
            await responses.aclose()
        sender = prepared.sender
        if mark_final_alone and self.core.decoupled and not (sender is not None and sender.final_yielded):
            yield StreamEnd.FINAL_ALONE
        yield None  # the end (see STREAM_END)

    async def grpc_stream(self, payload: bytes, trace_context: str | None = None,
                          read_walls: tuple[int, int] | None = None) -> AsyncIterator[Any]:
        """One request of a gRPC stream the ``/v2`` replica forwards: its serialized responses,
        then :data:`STREAM_END`."""
        async for message in model_grpc.stream_serialized(self.core, payload, trace_context, read_walls):
            if isinstance(message, StreamTrace):  # a traced request's: on this node's clock
                message = message._replace(node=ray.get_runtime_context().get_node_id())
            yield message
        yield STREAM_END

    def config_json(self) -> str:
        """The model's config as served (auto-completed), in Triton's JSON form."""
        return json.dumps(self.core.config_json)

    # ---- what the /v2 replica sends ---------------------------------------------------------

    def trace_settings(self, doc: dict[str, Any]) -> None:
        """The trace extension's settings: this model's apply."""
        settings = TraceSettings.from_dict(doc)
        self.core.tracer.configure(settings.of(self.core.name), settings.version, settings.opentelemetry)

    def take_settings(self, settings: dict[str, Any]) -> None:
        """What the ``/v2`` replica answered this model's registration with."""
        self.listener.max_inflight = settings.get("max_inflight", self.listener.max_inflight)
        self._routes.take_split(settings.get("version_less", True), settings.get("split"))
        shadowing = self._shadow.configure(settings.get("shadow"))
        self.core.on_answer = self._shadow.offer if shadowing and not self.core.decoupled else None
        if settings.get("connection_limits") != self._limit_values:  # the flags, as at the last registration
            self._limit_values = settings.get("connection_limits")
            self.listener.limits = ConnectionLimits.from_values(self._limit_values)
            self.core.max_queued_responses = self.listener.limits.max_queued_responses
        if self._sequences is not None:
            self._sequences.update(settings.get("sequence_slots"))
        # The logging extension's (again: loggers created since get them too).
        log_settings.apply(settings["log"])
        self.trace_settings(settings["trace"])

    def take_control(self, message: ControlMessage) -> None:
        """A change the ``/v2`` replica sent on the control channel."""
        if message.kind == TRACE_SETTINGS:
            self.trace_settings(message.body)
        elif message.kind == SHM_FORGET:  # a region unregistered (every one of its kind for "")
            self.core.shm.unregister(message.body["name"], message.body["kind"])
        elif message.kind == SEQUENCE_SLOTS and self._sequences is not None \
                and message.body.get("app", self.app_name) == self.app_name:  # a pool replica gets every version's
            self._sequences.update(message.body)
        elif message.kind == ROLLOUT_SPLIT and message.body["model"] == self.core.name:
            # A rollout of this model changed (Rollouts.split_message): its stable and candidate
            # versions' parts in it.
            if self.core.version in message.body["version_less"]:
                self._routes.take_split(message.body["version_less"][self.core.version], message.body["split"])

    async def _shared_memory_region(self, name: str) -> Registration | None:
        """A shared memory region a request names that this replica has not mapped:
        its registration with the ``/v2`` replica (None if there is none)."""
        try:
            return await asyncio.wait_for(self._server().shared_memory_region.remote(name), _SHM_FETCH_S)
        except asyncio.TimeoutError:
            raise UnavailableError(f"shared memory region '{name}': the server did not answer in time") from None

    # ---- what this model reports ------------------------------------------------------------

    async def _merged_statistics(self, version: str, snapshot: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """Report this replica's figures and read back every replica's sum (one Ray call);
        this replica's own figures when the ``/v2`` app is absent (a hand-written Serve config)."""
        try:
            merged = await self._server().report_statistics.remote(
                self.stats_key, self.core.name, self.core.version, snapshot, version
            )
            self.pushed[self.stats_key] = change_key(snapshot)
            return merged
        except Exception as exc:
            logger.debug("falling back to this replica's statistics: %s", exc)
            return []

    async def report_shadow(self) -> None:
        """The shadow counts, when they changed."""
        target, counts = self._shadow.target, self._shadow.counts.as_dict()
        if target is None or counts == self._shadow_reported:
            return
        try:
            await self._server().report_shadow.remote(self.replica_key, self.core.name, target["candidate"], counts)
            self._shadow_reported = counts
        except Exception as exc:  # the server app may be gone: the counts go with the next report
            logger.debug("could not report shadow counts: %s", exc)

    async def report(self) -> None:
        """Send the ``/v2`` replica what changed since the last report: the shadow counts, the
        traces collected, the statistics of this model and of an ensemble's in-place members."""
        await self.report_shadow()
        for key, core in self.reported_cores():
            traces = core.tracer.collect()  # an in-place member's: its steps' child traces
            if traces:
                try:
                    await self._server().report_traces.remote(core.name, traces)
                except Exception as exc:  # the server app may be gone: those traces are lost
                    logger.debug("could not report traces: %s", exc)
            snapshot = core.snapshot()
            if change_key(snapshot) == self.pushed.get(key):
                continue
            try:
                await self._server().report_statistics.remote(key, core.name, core.version, snapshot)
                self.pushed[key] = change_key(snapshot)
            except Exception as exc:  # the server app may not be deployed (yet)
                logger.debug("could not publish statistics: %s", exc)

    def reported_cores(self) -> list[tuple[str, ModelCore]]:
        """(key, core) of this model and of an ensemble's members running here, whose figures
        count as those of one more replica of the member."""
        cores = [(self.stats_key, self.core)]
        if self._members is not None and self._members.in_place is not None:
            cores += [(f"{self.stats_key}/in-place/{core.name}", core) for core in self._members.in_place.cores()]
        return cores

    async def close(self) -> None:
        """Out of the front's routes first, then drain, then release the model."""
        listener = getattr(self, "listener", None)
        if listener is not None:
            try:
                await asyncio.wait_for(self._server().withdraw_listener.remote(self.replica_key), 5.0)
            except Exception as exc:  # the /v2 app is gone too: nothing routes here any more
                logger.debug("could not withdraw the listener: %s", exc)
            await listener.close(_LISTENER_DRAIN_S)
        core = getattr(self, "core", None)
        if core is not None:
            await core.aclose()
        if self._members is not None:
            self._members.close()
        for client in (self._bls, self._sequence_client):
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


def change_key(snapshot: dict[str, Any]) -> tuple[int, ...]:
    """What of a statistics snapshot, when changed, makes it worth pushing again."""
    durations = snapshot["durations"]  # successes count the response cache's hits, which execute nothing
    return (snapshot["execution_count"], durations["success"][0], durations["fail"][0],
            snapshot["pending_request_count"], snapshot.get("custom_metrics_version", 0))
