"""Every file of a front's folder, named in one place.

A node's front keeps its files in one private folder: HAProxy's configuration, its admin socket
and log, the PID files its supervisor checks, the Unix sockets by which HAProxy relays what the
acceptor and the replicas give back, and the route maps (:mod:`rayinfer.transport.front_maps`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The relay sockets by protocol: the HTTP requests replicas relay, the gRPC calls they relay.
REPLICA_RELAY_SOCKET = "replica-relay.sock"
GRPC_RELAY_SOCKET = "grpc-relay.sock"
RELAY_SOCKETS = {"http": REPLICA_RELAY_SOCKET, "grpc": GRPC_RELAY_SOCKET}


@dataclass(frozen=True, slots=True)
class FrontPaths:
    """The files of the front whose folder is ``folder``."""

    folder: Path

    @property
    def config(self) -> Path:
        """HAProxy's configuration (it holds the front key)."""
        return self.folder / "haproxy.cfg"

    @property
    def admin_socket(self) -> Path:
        """HAProxy's runtime API."""
        return self.folder / "admin.sock"

    @property
    def acceptor_ports(self) -> Path:
        """The ports the front's acceptor owns (a line "<protocol> <address> <port>" each) and
        its limits (a line "limits ..."), written by the front, read by its supervisor."""
        return self.folder / "acceptor"

    @property
    def haproxy_log(self) -> Path:
        return self.folder / "haproxy.log"

    @property
    def supervisor_pid(self) -> Path:
        return self.folder / "supervisor.pid"

    @property
    def raylet_pid(self) -> Path:
        """The raylet the front's supervisor outlives no longer than."""
        return self.folder / "raylet.pid"

    @property
    def relay_socket(self) -> Path:
        """Where the acceptor gives HAProxy the HTTP connections it does not hand off."""
        return self.folder / "relay.sock"

    @property
    def replica_relay_socket(self) -> Path:
        return self.folder / REPLICA_RELAY_SOCKET

    @property
    def grpc_relay_socket(self) -> Path:
        return self.folder / GRPC_RELAY_SOCKET

    def relay_sockets(self) -> dict[str, Path]:
        """The relay socket of each protocol (:data:`RELAY_SOCKETS`)."""
        return {kind: self.folder / name for kind, name in RELAY_SOCKETS.items()}

    def map_file(self, name: str) -> Path:
        """A route map (``<name>.map``)."""
        return self.folder / f"{name}.map"
