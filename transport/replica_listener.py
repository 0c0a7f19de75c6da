"""A model replica's own listener for the inference calls the front relays to it.

Ray Serve answers a request in a replica through uvicorn or grpcio's Python server plus its own
per-request wrapper; on small machines that costs more CPU than the model (see
docs/dev/benchmark-log.md). The front (HAProxy, :mod:`front`) instead hands the calls it routes to
this listener as HTTP/1.1:

- KServe v2 ``POST .../infer`` requests, as the client sent them;
- gRPC calls: HAProxy turns the HTTP/2 call into an HTTP/1.1 request with the gRPC-framed
  message as its body, and turns the chunked HTTP/1.1 response with ``grpc-status`` and
  ``grpc-message`` trailers back into a gRPC response.

Parsing is httptools (the parser uvicorn uses; each connection: :mod:`listener_connection`); there
is no HTTP/2, no ASGI and no gRPC library
on the replica's side of the call.

With the front's acceptor (:mod:`acceptor`), the listener also takes clients' HTTP connections
themselves, passed over a Unix socket: their requests for this replica's model version are
answered here with no front in between; any other request on them is relayed to the front's
HAProxy and its answer written back. A stopping replica gives such connections back to the acceptor
between two requests, so that their clients' next calls are served elsewhere. Clients' gRPC
connections (HTTP/2) from the acceptor are served by :mod:`replica_h2`.

The listener's port is on the node's network, where the front's HAProxy and other replicas reach
it: a request that arrives over it is served only with the server's front key
(:mod:`rayinfer.protocol.front_key`); the connections it holds, over its port and the acceptor's
alike, are bounded by ``--replica-max-connections`` (one more is closed at once).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from rayinfer.transport import handoff
from rayinfer.transport.listener_connection import SERVICE_PATH, ListenerConnection
from rayinfer.transport.listener_responses import StreamedResponse, grpc_error, grpc_response, http_response
from rayinfer.transport.h2_stream import StreamHandler
from rayinfer.transport.front_paths import GRPC_RELAY_SOCKET
from rayinfer.transport.handoff import ReplicaHandoff
from rayinfer.transport.handoff_messages import GiveBack, HandOff
from rayinfer.transport.replica_h2 import H2Connection
from rayinfer.transport.client_connection import ClientConnection
from rayinfer.transport.replica_routes import ConnectionRoute, ReplicaRoutes
from rayinfer.protocol.errors import NotFoundError, UnavailableError, UnsupportedError
from rayinfer.protocol.front_key import front_key_matches
from rayinfer.protocol.grpc_wire import SERVICE, unframe_off_loop
from rayinfer.protocol.http_codec import error_response
from rayinfer.protocol.limits import (
    DEFAULT_CONNECTION_LIMITS,
    DEFAULT_HTTP_MAX_INPUT_SIZE,
    DEFAULT_MAX_INFLIGHT_REQUESTS,
    ConnectionLimits,
)
from rayinfer.protocol.restricted_api import Restrictions, grpc_message, header_names, http_message, missing_header

logger = logging.getLogger(__name__)

# A refusal of the same kind (a connection over the cap, a request without the key) is logged at
# most this often, with the count since.
_WARN_EVERY_S = 5.0


# (method name, serialized request message) -> serialized response message; raises on error.
GrpcHandler = Callable[[str, bytes], Awaitable[bytes]]
# (method, path, lower-case request headers, body) -> (status, extra response headers, body:
# bytes, or chunks that stream as they come).
HttpHandler = Callable[[str, str, dict[bytes, bytes], bytes],
                       Awaitable[tuple[int, list[tuple[bytes, bytes]], bytes | AsyncIterator[bytes]]]]

class ReplicaListener:
    """Listens on ``host`` (an ephemeral port); answers unary GRPCInferenceService calls relayed
    as HTTP/1.1 with ``grpc_handler`` and every other request with ``http_handler``. A body over
    ``max_input_size`` bytes (gRPC: over gRPC's maximum message) is refused while it arrives."""

    def __init__(self, grpc_handler: GrpcHandler, http_handler: HttpHandler | None = None,
                 max_input_size: int = DEFAULT_HTTP_MAX_INPUT_SIZE, model: str = "", front_key: str = "") -> None:
        """``model``: the model whose serving core traces this listener's requests with their
        protocol timestamps (:class:`~rayinfer.serving.trace.ProtocolStamps`); ``front_key``: the
        server's, which every request over the listener's port must carry ("": not known, every
        such request is refused)."""
        self._grpc_handler = grpc_handler
        self.front_key = front_key
        self.model = model
        self._http_handler = http_handler
        self.max_input_size = max_input_size
        self._server: asyncio.AbstractServer | None = None
        # HTTP/1.1 connections, and the acceptor's HTTP/2 ones (replica_h2.H2Connection); at most
        # limits.max_connections, with the acceptor's being set up (_handing).
        self._connections: set[ClientConnection] = set()
        self._handing = 0
        # Refusals by kind: (the count not logged yet, when one was last logged).
        self._refusals: dict[str, tuple[int, float]] = {}
        self.in_flight = 0
        self.port = 0
        # Clients' connections from the front's acceptor: which requests are this replica's, and
        # how many may be in flight here before more are answered 503 (--max-inflight-requests).
        self.routes: ReplicaRoutes | None = None  # None: no request on them is this replica's
        # A gRPC stream on a client's connection: its requests -> its answers (:mod:`h2_stream`).
        self.stream_grpc: StreamHandler = _no_streams
        self.max_inflight = DEFAULT_MAX_INFLIGHT_REQUESTS
        # What each client's connection may hold or take (the server's connection flags).
        self.limits: ConnectionLimits = DEFAULT_CONNECTION_LIMITS
        self.held_bytes = 0  # request bytes the clients' HTTP/2 calls hold here (replica_h2)
        self._handoff: ReplicaHandoff | None = None
        self.handoff_name = ""
        self.closing = False
        # --http-restricted-api and --grpc-restricted-protocol (:meth:`restrict`), and the
        # headers they name (kept from a request's headers for the check).
        self._restricted: tuple[Restrictions, Restrictions] | None = None
        self.restricted_headers: frozenset[bytes] = frozenset()

    async def start(self, host: str) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: ListenerConnection(self), host, 0, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        self.handoff_name = handoff.handoff_name(host, self.port)
        self._handoff = ReplicaHandoff(self.handoff_name, self._take_connection)
        self._handoff.open()
        return self.port

    def _take_connection(self, client: socket.socket, given: HandOff) -> None:
        """A client's connection from the front's acceptor (:mod:`replica_handoff`); closed at once
        when the listener holds ``--replica-max-connections``."""
        if self.closing:
            handoff.give_back(os.path.basename(os.path.dirname(given.relay)), [client.fileno()],
                              GiveBack(self.handoff_name, True))
            client.close()
            return
        if self._full():
            self.refused("connections over --replica-max-connections", "a client's, from the acceptor")
            client.close()
            return
        client.setblocking(False)
        loop = asyncio.get_running_loop()
        relay, key, run_left = given.relay, given.route_key, given.run_left
        # gRPC's connections (HTTP/2) relay to HAProxy's gRPC socket, HTTP/1.1's to its HTTP one.
        if os.path.basename(relay) == GRPC_RELAY_SOCKET:
            route = ConnectionRoute(self.routes, key, run_left, reconnects=True)
            connection: Callable[[], asyncio.Protocol] = lambda: H2Connection(self, relay, route)
        else:
            route = ConnectionRoute(self.routes, key, run_left)
            connection = lambda: ListenerConnection(self, relay, route)
        self._handing += 1
        loop.create_task(self._connect(connection, client))

    async def _connect(self, connection: Callable[[], asyncio.Protocol], client: socket.socket) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(connection, client)
        finally:
            self._handing -= 1

    def _full(self) -> bool:
        return len(self._connections) + self._handing >= self.limits.max_connections

    def admit(self, connection: ClientConnection) -> bool:
        """Hold a new connection: one over the listener's port only below
        ``--replica-max-connections`` (a client's from the acceptor was counted as it came)."""
        if not connection.direct and self._full():
            self.refused("connections over --replica-max-connections", "over the listener's port")
            return False
        self._connections.add(connection)
        return True

    def release(self, connection: ClientConnection) -> None:
        """A connection ended (or was refused)."""
        self._connections.discard(connection)

    def front_key_matches(self, given: bytes | None) -> bool:
        """Whether a request over the listener's port carries the server's front key (``given``:
        its header's value, None without one)."""
        return front_key_matches(self.front_key, given)

    def refused(self, what: str, source: str) -> None:
        """Count a refusal (``what``: its kind, ``source``: whose); log a warning at most every
        few seconds per kind."""
        count, logged_at = self._refusals.get(what, (0, float("-inf")))
        now = time.monotonic()
        if now - logged_at < _WARN_EVERY_S:
            self._refusals[what] = (count + 1, logged_at)
            return
        self._refusals[what] = (0, now)
        logger.warning("model replica listener (%s): refused %s (%s)%s", self.model or "?", what, source,
                       f"; {count} more since the last warning" if count else "")

    def restrict(self, http: Restrictions, grpc: Restrictions) -> None:
        """Answer a restricted group's requests only with their header (tritonserver's
        --http-restricted-api and --grpc-restricted-protocol, as the front checks them): a
        client that reaches this listener directly gets the front's refusal."""
        self._restricted = (http, grpc) if http or grpc else None
        self.restricted_headers = header_names(http, grpc)

    async def respond(self, path: bytes, headers: dict[bytes, bytes], body: bytes,
                      method: bytes = b"POST") -> bytes | StreamedResponse:
        """The whole HTTP/1.1 response to one relayed request (or its head and its chunks)."""
        if self._restricted is not None:
            key = missing_header(*self._restricted, path.decode("latin-1"), headers, SERVICE)
            if key is not None:
                if path.startswith(SERVICE_PATH):
                    return grpc_error(UnavailableError(grpc_message(key)))
                return http_response(403, [(b"content-type", b"application/json")],
                                     json.dumps({"error": http_message(key)}).encode())
        self.in_flight += 1
        try:
            if not path.startswith(SERVICE_PATH):
                return await self._respond_http(method, path, headers, body)
            message = await unframe_off_loop(body, headers.get(b"grpc-encoding"), self.limits.max_message_bytes)
            return grpc_response(await self._grpc_handler(path[len(SERVICE_PATH):].decode("latin-1"), message))
        except Exception as exc:
            return grpc_error(exc)
        finally:
            self.in_flight -= 1

    async def call_grpc(self, method: str, message: bytes) -> bytes:
        """One model RPC of a client's HTTP/2 connection (:mod:`replica_h2`)."""
        self.in_flight += 1
        try:
            return await self._grpc_handler(method, message)
        finally:
            self.in_flight -= 1

    async def _respond_http(self, method: bytes, path: bytes, headers: dict[bytes, bytes],
                            body: bytes) -> bytes | StreamedResponse:
        try:
            if self._http_handler is None:
                raise NotFoundError(f"Not Found: {path.decode('latin-1')}")
            status, extra, content = await self._http_handler(method.decode("latin-1"), path.decode("latin-1"),
                                                              headers, body)
            if isinstance(content, bytes):
                return http_response(status, extra, content)
            return StreamedResponse(status, extra, content, self.limits)
        except Exception as exc:
            return http_response(*error_response(exc))

    async def close(self, grace_s: float) -> None:
        """Stop accepting, let calls in flight finish (up to ``grace_s``), give clients' HTTP/1.1
        connections that wait for their next request back to the front's acceptor, close clients'
        HTTP/2 connections gracefully (GOAWAY), close the rest."""
        loop = asyncio.get_running_loop()
        self.closing = True
        if self._server is not None:
            self._server.close()
        if self._handoff is not None:
            self._handoff.stop_accepting()
        deadline = loop.time() + grace_s
        while True:
            # Clients' connections go back to the acceptor between requests (the others once they
            # are answered); one waiting for a relayed answer goes with that answer to the acceptor.
            for connection in list(self._connections):
                if connection.direct and not connection.hand_over_relay() and connection.idle:
                    connection.hand_back()
            if not (self.in_flight or any(c.direct for c in self._connections)) or loop.time() >= deadline:
                break
            await asyncio.sleep(0.01)
        for connection in list(self._connections):
            connection.close()
        if self._handoff is not None:
            self._handoff.close()


async def _no_streams(requests: AsyncIterator[Any], headers: list[tuple[bytes, bytes]]) -> AsyncGenerator[bytes, None]:
    """A listener with no stream handler: its streams end UNIMPLEMENTED."""
    raise UnsupportedError("this listener does not answer ModelStreamInfer")
    yield b""  # an async generator
