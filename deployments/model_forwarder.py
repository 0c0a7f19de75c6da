"""The ``/v2`` replica's forwarding of model RPCs it receives (the front could not route them to
a replica: a stream, a compressed message, no replica registered yet) to a replica of the model
version, by deployment handle."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any

import grpc
import ray
from tritonclient.grpc import service_pb2 as pb

from rayinfer.deployments.model_handles import model_handle
from rayinfer.protocol.errors import InvalidArgError, ServingError
from rayinfer.serving.model_grpc import MODEL_RPCS
from rayinfer.serving.protocol_stamps import StreamTrace, wall_clock_offset_ns
from rayinfer.serving.routes import ModelRoute
from rayinfer.serving.stream_infer import AsTheyCome, Traced
from rayinfer.transport.router import choose_version, sticky_value

if TYPE_CHECKING:
    from rayinfer.deployments.v2_api import V2Api

logger = logging.getLogger(__name__)


class ModelForwarder:
    """Forwards model RPCs to a replica of the model version by deployment handle (one hop)."""

    def __init__(self, api: V2Api) -> None:
        self._api = api
        self._handles: dict[tuple[str, str], Any] = {}

    async def route(self, name: str, version: str, headers: dict[str, Any] | None = None) -> tuple[str, str] | None:
        """(application, deployment) serving ``name`` at ``version`` (for a model in a rollout
        with a sticky header, ``headers``: the call's metadata); Serve is read again when the
        version is not routed yet (it may have become ready since the last read)."""
        state = self._api.state
        split = None if version else state.splits.get(name)
        sticky = sticky_value(split, (headers or {}).items()) if split is not None else None
        route = state.route(name, version, sticky) if sticky is not None else state.route(name, version)
        if route is None:
            await state.refresh()
            route = state.route(name, version, sticky) if sticky is not None else state.route(name, version)
        return route

    async def forward(self, method: str, name: str, version: str, request: Any) -> Any:
        """The model version's answer to ``request``, or Triton's error when it is not served."""
        if not name:
            raise InvalidArgError("the request does not name a model")
        route = await self.route(name, version)
        if route is None:
            raise await self._api.unavailable_model(name, version or None)
        payload = request.SerializeToString()
        handle = self._handles.get(route) or self._new_handle(route)
        try:
            answer_bytes = await handle.grpc_forwarded.remote(method, payload)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            # Serve's router reached a gRPC server without Serve's replica service, so the replica
            # address it holds is another server's now. The call never reached a model: it is
            # sent again through a new handle, which reads the replicas afresh.
            logger.warning("%s for model '%s' reached a server that is not its replica (%s); retrying "
                           "with a new handle", method, name, exc.details())
            answer_bytes = await self._new_handle(route).grpc_forwarded.remote(method, payload)
        return MODEL_RPCS[method][1].FromString(answer_bytes)

    async def stream(self, request: pb.ModelInferRequest, trace_context: str | None = None,
                     read: tuple[int, int] | None = None, headers: dict[str, Any] | None = None,
                     ) -> AsyncIterator[pb.ModelStreamInferResponse | Traced | ServingError]:
        """The responses of one stream request, from a replica of its model by streaming handle
        (:func:`stream_by_handle`); ``headers``: the stream's metadata."""
        name, version = request.model_name, request.model_version
        if not name:
            raise InvalidArgError("the request does not name a model")
        route = await self.route(name, version, headers)
        if route is None:
            raise await self._api.unavailable_model(name, version or None)
        handle = self._handles.get(route) or self._new_handle(route)
        async for item in stream_by_handle(handle, request.SerializeToString(), trace_context, read):
            # An error travels as its ServingError (answer_stream writes it by the stream's rule), and
            # AS_THEY_COME as it is.
            yield item if isinstance(item, (Traced, ServingError, AsTheyCome)) else pb.ModelStreamInferResponse.FromString(item)

    def forget(self, model: str) -> None:
        """Drop the handles to the applications of an unloaded model."""
        self._handles = {route: h for route, h in self._handles.items() if route[1].rpartition("_v")[0] != model}

    async def http(self, route: tuple[str, str], method: str, model_route: ModelRoute, headers: dict[bytes, bytes],
                   body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """A model route's HTTP answer (status, headers, body) from a replica of ``route``."""
        handle = self._handles.get(route) or self._new_handle(route)
        return await handle.http_forwarded.remote(method, model_route, headers, body)

    def _new_handle(self, route: tuple[str, str]) -> Any:
        """A deployment handle to ``route`` (application, deployment), kept for later calls."""
        handle = self._handles[route] = model_handle(route)
        return handle


async def stream_by_handle(handle: Any, payload: bytes, trace_context: str | None,
                           read: tuple[int, int] | None) -> AsyncIterator[bytes | Traced | ServingError]:
    """One stream request's serialized responses from ``handle``'s model by streaming handle call
    (``ModelDeployment.grpc_stream``). ``trace_context``: the client's traceparent; ``read``: when
    the request's read began and ended, on this process's monotonic clock, sent as wall-clock
    times (the replica may be on another node, whose monotonic clock is another). A traced request
    (Triton's trace file) ends with its :class:`Traced`."""
    to_wall = wall_clock_offset_ns()
    walls = (read[0] + to_wall, read[1] + to_wall) if read is not None else None
    async for answer in handle.options(stream=True).grpc_stream.remote(payload, trace_context, walls):
        if isinstance(answer, StreamTrace):
            yield Traced(answer.token, answer.clock_offset(ray.get_runtime_context().get_node_id(),
                                                           wall_clock_offset_ns()))
        elif answer:  # an empty one ends every stream (ModelDeployment.grpc_stream)
            yield answer


class ModelRoutes:
    """(application, deployment) serving a model version, as the ``/v2`` replica says
    (``ServerDeployment.model_routes``: Triton's error when the version is not served), each kept
    for :attr:`TTL_S`: a model replica's BLS calls and stream requests look their model up here.
    A model in a rollout's version-less requests are split here, each by itself
    (:func:`~rayinfer.transport.router.choose_version`; ``headers``: the request's, for a
    sticky split). ``server``: a handle to the ``/v2`` deployment (the caller's, for the loop it
    routes on)."""

    TTL_S = 1.0

    def __init__(self, server: Callable[[], Any]) -> None:
        self._server = server
        self._routes: dict[tuple[str, str], tuple[float, tuple[str, str], Any]] = {}
        # One lookup at a time per key: the requests waiting for it go on in the order they came
        # (a stream's requests reach their model's batcher in the stream's order).
        self._lookups: dict[tuple[str, str], asyncio.Future] = {}

    async def route(self, name: str, version: str, headers: Iterable[tuple[Any, Any]] = ()) -> tuple[str, str]:
        key = (name, version)
        cached = self._routes.get(key)
        if cached is None or time.monotonic() - cached[0] >= self.TTL_S:
            cached = await self._lookup(key)
        _, route, split = cached
        if split is not None and choose_version("", split[0], split[0].stable,
                                                sticky_value(split[0], headers)) == split[0].candidate:
            return tuple(split[1])  # type: ignore[return-value]
        return route  # type: ignore[return-value]

    async def _lookup(self, key: tuple[str, str]) -> tuple[float, tuple[str, str], Any]:
        lookup = self._lookups.get(key)
        if lookup is None:
            lookup = self._lookups[key] = asyncio.ensure_future(self._server().model_routes.remote(*key))
            lookup.add_done_callback(lambda _: self._lookups.pop(key, None))
        route, split = await asyncio.shield(lookup)
        cached = self._routes[key] = (time.monotonic(), tuple(route), split)
        return cached
