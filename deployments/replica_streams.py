"""A model replica's answers to the gRPC streams (``ModelStreamInfer``) clients start on connections
it holds (:mod:`~rayinfer.transport.h2_stream`).

Each request of the stream goes where the ``/v2`` replica says its model version is served (the
route asked once a second per model, as for a Python model's BLS calls): this replica's own
model answers it here, with no other process in between; another model's goes to a replica of
that model by streaming deployment handle (``ModelDeployment.grpc_stream``), one Ray call, as the
``/v2`` replica sends the streams the front gives it. The stream itself (order, sequences,
errors as responses) is :func:`~rayinfer.serving.stream_infer.answer_stream`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from tritonclient.grpc import service_pb2 as pb

from rayinfer.deployments.model_handles import model_handle
from rayinfer.deployments.model_forwarder import ModelRoutes, stream_by_handle
from rayinfer.protocol.errors import InvalidArgError
from rayinfer.serving import model_grpc
from rayinfer.serving.model_core import ModelCore
from rayinfer.serving.protocol_stamps import TRACEPARENT, StreamTrace, wall_clock_offset_ns
from rayinfer.transport.replica_listener import ReplicaListener
from rayinfer.serving.stream_infer import Traced, answer_stream, ends_on_error

logger = logging.getLogger(__name__)


class ReplicaStreams:
    """Answers the streams on a replica's connections; ``own``: the route (application,
    deployment) of the model version served here, ``server``: a handle to the ``/v2`` deployment."""

    def __init__(self, core: ModelCore, own: tuple[str, str], server: Callable[[], Any], listener: ReplicaListener) -> None:
        self._core, self._own, self._server, self._listener = core, own, server, listener
        self._routes = ModelRoutes(server)
        self._handles: dict[tuple[str, str], Any] = {}
        self._reports: set[asyncio.Task] = set()

    async def answer(self, requests: AsyncIterator[Any], headers: list[tuple[bytes, bytes]]) -> AsyncGenerator[bytes, None]:
        """The serialized responses to one stream's ``requests`` (``headers``: the call's)."""
        trace_context = next((value.decode("latin-1") for name, value in headers if name == TRACEPARENT), None)

        def forward(request: pb.ModelInferRequest, read: tuple[int, int]) -> AsyncIterator[Any]:
            return self._forward(request, trace_context, read, headers)

        async for response in answer_stream(requests, forward, _error_response, self._sent, ends_on_error(headers),
                                            max_queued_responses=self._listener.limits.max_queued_responses):
            yield response

    async def _forward(self, request: pb.ModelInferRequest, trace_context: str | None,
                       read: tuple[int, int], headers: list[tuple[bytes, bytes]]) -> AsyncIterator[bytes | Traced]:
        if not request.model_name:
            raise InvalidArgError("the request does not name a model")
        route = await self._routes.route(request.model_name, request.model_version, headers)
        if tuple(route) != self._own:  # another version (a pool's route names the pool's deployment for all)
            async for item in stream_by_handle(self._handle(route), request.SerializeToString(), trace_context, read):
                yield item
            return
        to_wall = wall_clock_offset_ns()
        self._listener.in_flight += 1
        try:
            async for message in model_grpc.stream_serialized(self._core, request, trace_context,
                                                              (read[0] + to_wall, read[1] + to_wall)):
                yield Traced(message.token, 0) if isinstance(message, StreamTrace) else message
        finally:
            self._listener.in_flight -= 1

    def _handle(self, route: tuple[str, str]) -> Any:
        handle = self._handles.get(route)
        if handle is None:
            handle = self._handles[route] = model_handle(route)
        return handle

    def _sent(self, token: str, stamps: list[tuple[str, int]]) -> None:
        """A traced request's send stamps, for the ``/v2`` replica's trace file."""
        task = asyncio.ensure_future(self._report_sent(token, stamps))
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _report_sent(self, token: str, stamps: list[tuple[str, int]]) -> None:
        try:
            await self._server().trace_sent.remote(token, stamps)
        except Exception as exc:
            logger.warning("could not report a stream trace's send stamps: %s", exc)


def _error_response(message: str) -> bytes:
    return pb.ModelStreamInferResponse(error_message=message).SerializeToString()
