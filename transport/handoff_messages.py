"""The messages that travel with client connections between a front's acceptor and the model
replicas of its machine (over the abstract Unix sockets of :mod:`rayinfer.transport.handoff`),
each a dataclass encoded and decoded here only.

- :class:`HandOff`, acceptor to replica, with one client connection.
- :class:`GiveBack`, replica to acceptor, with connections between two requests.
- :class:`Splice`, replica to acceptor, with a client's connection and HAProxy's whose answer
  the acceptor copies to its end (the replica stops while it relays a request).
"""

from __future__ import annotations

from dataclasses import dataclass

_SPLICE = b"splice\n"
_STOPPING, _REBALANCE = "stopping", "rebalance"


@dataclass(frozen=True, slots=True)
class HandOff:
    """A connection for a replica: ``relay``, HAProxy's socket the replica relays the requests
    that are not its own to; ``route_key``, the route (``<model>/<version>``) it was placed for;
    ``run_left``, the version-less requests of its run at a rollout's split it answers there (0:
    none: :mod:`rayinfer.transport.router`)."""

    relay: str
    route_key: str
    run_left: int = 0

    def encode(self) -> bytes:
        run = f"\n{self.run_left}" if self.run_left else ""
        return f"{self.relay}\n{self.route_key}{run}".encode()

    @classmethod
    def decode(cls, data: bytes) -> HandOff:
        relay, _, rest = data.decode("utf-8", "replace").partition("\n")
        key, _, left = rest.partition("\n")
        return cls(relay, key, int(left) if left.isdigit() else 0)


@dataclass(frozen=True, slots=True)
class GiveBack:
    """Connections a replica gives back: ``replica``, its handoff name; ``stopping``, it takes no
    more; ``move_to``, where their next version-less request goes: a route key, and after a
    space the requests left of a run there when it continues one (a rollout's split)."""

    replica: str
    stopping: bool
    move_to: str = ""

    def encode(self) -> bytes:
        move = f" {self.move_to}" if self.move_to else ""
        return f"{_STOPPING if self.stopping else _REBALANCE} {self.replica}{move}".encode()


@dataclass(frozen=True, slots=True)
class Splice:
    """A relayed request's connections (the client's, then HAProxy's): ``answered`` is what
    HAProxy answered so far, which the acceptor writes to the client before copying the rest."""

    answered: bytes = b""

    def encode(self) -> bytes:
        return _SPLICE + self.answered


def decode_returned(data: bytes) -> GiveBack | Splice:
    """What came back to the acceptor with connections."""
    if data.startswith(_SPLICE):
        return Splice(data[len(_SPLICE):])
    kind, _, rest = data.decode("utf-8", "replace").partition(" ")
    replica, _, move_to = rest.partition(" ")
    return GiveBack(replica, kind == _STOPPING, move_to)
