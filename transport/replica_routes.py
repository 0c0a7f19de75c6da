"""Which requests on the clients' connections a model replica holds are its own.

The front's acceptor hands a client's connection to a replica of the model version its first
request names (:mod:`rayinfer.transport.acceptor`); the replica answers the requests on it that the
front would have routed to it and relays the others to the front (:mod:`listener_connection`,
:mod:`replica_h2`). A version-less request is the default version's, on a connection given for
it ("<model>/"), unless a rollout splits the model's version-less requests between two versions
(:mod:`rayinfer.transport.router`): then an HTTP/1.1 connection's are this version's by the
connection's turn, and so are a gRPC connection's (its sticky calls by their value, the other
version's relayed naming it).

The ``/v2`` replica says which applies when the replica registers, and at once when a rollout
changes (:meth:`ReplicaRoutes.take_split`). Each client connection asks its own
:class:`ConnectionRoute` (the replica's routes, the key the acceptor gave the connection for, and
its turn at a rollout's split): the connection classes know nothing of versions or rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rayinfer.serving.routes import POST_ACTIONS, front_routed
from rayinfer.transport.router import ConnectionTurn, VersionSplit, sticky_value

Headers = list[tuple[bytes, bytes]]


class ReplicaRoutes:
    """The routing of a replica of ``model`` at ``version``, for the connections it holds."""

    def __init__(self, model: str, version: str) -> None:
        self.model = model
        self.version = version
        # Whether the version-less requests on connections given for the default version are this
        # replica's (false while a rollout splits them, or routes them to another version).
        self.version_less = True
        # The rollout's split this replica's version takes part in.
        self.split: VersionSplit | None = None

    def take_split(self, version_less: bool, split: dict[str, Any] | None) -> None:
        """What the ``/v2`` replica said: whether this version answers version-less requests, and
        the split of the model's rollout (the fields of a :class:`VersionSplit`, or None)."""
        self.version_less = version_less
        self.split = VersionSplit(**split) if split and self.version in (split["stable"], split["candidate"]) else None

    def serves(self, method: str, path: str, key: str, turn: ConnectionTurn, headers: Headers) -> bool:
        """Whether an HTTP request on a client's connection (given to this replica for ``key``,
        "<model>/<version>"; ``turn``: the connection's, ``headers``: the request's) is this
        replica's: the front would route it here. A rollout's version-less inferences are this
        version's by the connection's turn; its version-less GETs are the stable version's."""
        route = front_routed(method, path)
        if route is None:
            return False
        split = self.split
        if split is None or route.version or route.model != self.model or not key.endswith("/"):
            return self.serves_grpc(route.model, route.version, key, headers, turn)
        if route.action not in POST_ACTIONS:
            return self.version == split.stable
        return turn.serves(split, self.version, sticky_value(split, headers))

    def serves_grpc(self, model: str, version: str, key: str, headers: Headers, turn: ConnectionTurn) -> bool:
        """Whether a model RPC (or request) naming ``model`` and ``version`` on a client's
        connection given for ``key`` (``headers``: the call's; ``turn``: the connection's) is
        this replica's. A rollout's version-less calls are this version's by the connection's
        turn (a sticky value's by its bucket)."""
        if model != self.model:
            return False
        if version:
            return version == self.version
        if not key.endswith("/"):  # the default version's calls only on its connections
            return False
        split = self.split
        if split is not None:
            return turn.serves(split, self.version, sticky_value(split, headers))
        return self.version_less

    def split_target(self, model: str, key: str) -> str:
        """The version a version-less call of ``model`` that is not this replica's goes to: the
        rollout's other version ("" without a split: the front routes it)."""
        split = self.split
        if split is None or model != self.model or not key.endswith("/"):
            return ""
        return split.candidate if self.version == split.stable else split.stable


@dataclass(frozen=True, slots=True)
class GrpcPlace:
    """Where a model RPC on a client's connection goes: ``own``, answered by this replica; else
    relayed to the front, naming ``version`` when that is not "" (a rollout's other version);
    ``leave``: the connection is closed gracefully after it (its run at this version ended), so
    that the acceptor places the client's next connection."""

    own: bool
    version: str = ""
    leave: bool = False


class ConnectionRoute:
    """The routing of one client connection a replica holds: ``routes``, the replica's (None:
    none of the requests is its own); ``key``, what the acceptor gave the connection for
    ("<model>/<version>"); ``run_left``: the rest of a rollout run carried over from another
    replica; ``reconnects``: its runs end with a new connection (gRPC)."""

    __slots__ = ("_routes", "_key", "_turn")

    def __init__(self, routes: ReplicaRoutes | None, key: str, run_left: int = 0, reconnects: bool = False) -> None:
        self._routes = routes
        self._key = key
        self._turn = ConnectionTurn(run_left, reconnects)

    def http(self, method: str, path: str, headers: Headers) -> bool:
        """Whether an HTTP request is this replica's (else it is relayed to the front)."""
        return self._routes is not None and self._routes.serves(method, path, self._key, self._turn, headers)

    def grpc(self, model: str, version: str, headers: Headers) -> GrpcPlace:
        """Where a model RPC naming ``model`` and ``version`` goes."""
        routes = self._routes
        if routes is None:
            return GrpcPlace(False)
        if routes.serves_grpc(model, version, self._key, headers, self._turn):
            return GrpcPlace(True, leave=bool(self._turn.move_to))
        target = "" if version else routes.split_target(model, self._key)
        return GrpcPlace(False, target, bool(self._turn.move_to or (target and not self._turn.left)))

    @property
    def run_ended(self) -> bool:
        """A rollout's run at this version ended on this connection: it goes to the other one."""
        return bool(self._turn.move_to)

    def next_place(self) -> str:
        """What the acceptor is told as the connection goes back: "" (place it by its next
        request), or where its next version-less request goes ("<key><version>", or
        "<key><version> <requests left in its run>")."""
        place = self._turn.next_place()
        return f"{self._key}{place}" if place else ""
