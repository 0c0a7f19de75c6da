"""The front's HAProxy configuration: the routing rules of :mod:`front` as text.

:func:`render` writes the whole configuration for one front's folder (its admin socket, its
route maps and the Lua fetches of :file:`front_sequences.lua` live there); :class:`front.Front`
starts HAProxy on it and replaces the maps at run time.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from rayinfer.transport.acceptor import HANDOFF_FD_VARIABLES
from rayinfer.transport.front_maps import MapPaths
from rayinfer.transport.front_paths import FrontPaths
from rayinfer.protocol.front_key import FRONT_KEY_HEADER, is_front_key
from rayinfer.protocol.grpc_wire import ROUTED_RPCS, SERVICE
from rayinfer.protocol.limits import (
    DEFAULT_CONNECTION_LIMITS,
    ConnectionLimits,
    HEAD_TOO_LARGE,
    MAX_REQUEST_HEAD_BYTES,
    MAX_REQUEST_HEADERS,
    TOO_MANY_HEADERS,
    body_limit_message,
    load_limit_message,
    inflight_limit_message,
    malformed_head_message,
)
from rayinfer.protocol.restricted_api import (
    GRPC_HEADER_PREFIX,
    GRPC_METHODS,
    HTTP_EXCLUDED,
    HTTP_PATHS,
    OPENAI_PATHS,
    Restrictions,
    grpc_message,
    http_message,
    openai_restricted_document,
)
from rayinfer.protocol.listener_client import STREAM_HEADER, TRACE_PARENT_HEADER
from rayinfer.serving.routes import UNROUTED_PREFIX
from rayinfer.serving.sequence_routing import FORWARDED_HEADER

# HAProxy's Lua fetches reading a sequence request's correlation id (copied to the front's folder).
LUA = Path(__file__).with_name("front_sequences.lua")
# The maps of the rollouts' splits (transport/router.py), each "<model> <value>".
# (address, port) a front port binds to, and (host, port) of Serve's ingress behind it.
Endpoint = tuple[str, int, str, int]


@dataclass(frozen=True)
class TlsSettings:
    """TLS on one of the front's ports, terminated by its HAProxy (tritonserver's
    ``--grpc-use-ssl`` family: PEM files; ``mutual``: clients must present a certificate signed
    by ``root_cert``)."""

    cert: str
    key: str
    root_cert: str = ""
    mutual: bool = False

    def pem(self) -> bytes:
        """The certificate and its key in one PEM, as HAProxy's ``crt`` reads them."""
        cert, key = Path(self.cert).read_bytes(), Path(self.key).read_bytes()
        return cert.rstrip(b"\n") + b"\n" + key

    def digest(self) -> str:
        """Of the files' contents: a front whose files changed is not taken over."""
        parts = [self.pem(), Path(self.root_cert).read_bytes() if self.root_cert else b"", b"mutual" if self.mutual else b""]
        return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def tls_pem_path(folder: Path, kind: str) -> Path:
    """Where a front keeps a port's certificate and key (mode 0600)."""
    return folder / f"{kind}-tls.pem"


def _ssl(folder: Path, kind: str, tls: TlsSettings | None) -> str:
    """A bind line's TLS options (HTTP/2 by ALPN for gRPC, HTTP/1.1 for HTTP)."""
    if tls is None:
        return ""
    alpn = "h2" if kind == "grpc" else "http/1.1"
    options = f" ssl crt {tls_pem_path(folder, kind)} alpn {alpn}"
    if tls.mutual:
        options += f" ca-file {tls.root_cert} verify required"
    return options + f"  # tls {tls.digest()}"

# The ring in HAProxy's memory that keeps the front's latest abnormal sessions, as ``option
# dontlog-normal`` counts them (an answer of 500 or more, a retry, a connection either side ended
# early, a timeout), read with
# ``show events abnormal`` on the admin socket: bounded, and empty while all goes well.
EVENTS_RING = "abnormal"

_GLOBAL = """\
global
    stats socket {admin} mode 600 level admin
    log ring@{ring} len 2048 local0
    lua-load {lua}
    nbthread {threads}
    maxconn {max_connections}
    # Request heads up to the limits of :mod:`limits` (16 KB, 100 headers) are answered by the
    # rules below with Triton's JSON 400; HAProxy's parser answers what its buffer cannot take
    # (a head over about 63 KB, or over 999 headers) with its own HTML page.
    tune.bufsize 65536
    tune.http.maxhdr 1000

ring {ring}
    description "the front's latest abnormal sessions"
    format iso
    maxlen 2048
    size 1048576

defaults
    mode http
    timeout connect 5s
    # A call, stream or relayed connection with nothing on it for --stream-idle-timeout; an idle
    # keep-alive connection after --http-keepalive-timeout, a request head after --http-request-timeout.
    timeout client {idle_s:g}s
    timeout server {idle_s:g}s
    timeout tunnel {idle_s:g}s
    timeout client-fin 5s
    timeout http-keep-alive {keepalive_s:g}s
    timeout http-request {head_s:g}s
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
    # HTTP/1.1 to the replica's listener, to the address the frontend set, with the server's
    # front key: the listener serves only the server's own parts over its port.
    http-reuse always
    http-request set-header {front_key_header} {front_key}
    # A listener that refuses the connection belongs to a replica that died (its route goes when
    # Serve reports it): one retry, after HAProxy's pause of min(timeout connect, 1 s), then 503 /
    # UNAVAILABLE, instead of three retries a second apart.
    retries 1
    timeout connect 1s
    server listener 0.0.0.0:0
"""

# Each HTTP-mode frontend logs its abnormal sessions only (to the ring :data:`EVENTS_RING`), with
# HAProxy's HTTP log line: its termination state, timers, server, status and retries.
_LOG = """\
    log global
    option httplog
    option dontlog-normal
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

# A model in a rollout (map "splits": "<model>" -> the candidate's weight in percent,
# "split_versions": -> the candidate's version, "split_headers": -> the header whose value picks
# the version): a {what} naming no version goes to the candidate when its bucket (CRC-32 of that
# header's value, or chance, modulo 100) is below the weight, else on to "<model>/", the stable
# version (transport/router.py picks alike for the Python paths).
_SPLIT = """\
    http-request set-var(txn.weight) var(txn.model),map_str_int({splits},0) if {condition}
    http-request set-var(txn.split_header) var(txn.model),map({split_headers}) if {{ var(txn.weight) -m int gt 0 }}
    http-request set-var(txn.split_key) lua.rayinfer_split_key if {{ var(txn.split_header) -m found }}
    http-request set-var(txn.bucket) var(txn.split_key),crc32,mod(100) if {{ var(txn.split_key) -m len gt 0 }}
    http-request set-var(txn.bucket) rand(100) if {{ var(txn.weight) -m int gt 0 }} !{{ var(txn.bucket) -m found }}
    http-request set-var(txn.split_version) var(txn.model),map({split_versions}) if {{ var(txn.bucket),sub(txn.weight) -m int lt 0 }}
    http-request set-var(txn.key) var(txn.model),concat(/,txn.split_version) if {{ var(txn.split_version) -m found }}
"""


_GRPC = """\
frontend triton_grpc
{binds}\
{log}{internal}{restricted}\
    acl model_rpc path {paths}
    http-request set-header application {server_app}
    # The first 64 bytes hold the model name and version; bytes(5) skips the gRPC frame header.
    http-request wait-for-body time 1s at-least 64 if model_rpc
    http-request set-var(txn.model) req.body,bytes(5),protobuf(1) if model_rpc
    http-request set-var(txn.version) req.body,bytes(5),protobuf(2) if model_rpc
    http-request set-var(txn.key) var(txn.model),concat(/,txn.version) if model_rpc
{split}{pick}\
    # Over --max-inflight-requests (calls relayed to replicas, both ports): UNAVAILABLE at once.
    http-request return status 200 content-type application/grpc hdr grpc-status 14 hdr grpc-message "{busy}" if {{ var(txn.listener) -m found }} {{ be_conn(replica) ge {max_inflight} }}
{use_replica}\
    default_backend serve_grpc

backend serve_grpc
    # Every call here is the /v2 application's. "v2" is the /v2 replica's own gRPC server on
    # this machine (:data:`V2_SERVER`: its port is set at run time, by the replica that owns the
    # front), so that streams and the repository API do not cross Serve's ingress HAProxy: Serve
    # replaces that process on every change of applications, and a stream sent across a
    # replacement was refused (UNAVAILABLE, "RST_STREAM ... error code 7").
    # Serve's ingress takes the calls while v2 has no port yet, and once it refuses a connection
    # or fails its check (a /v2 replica that stopped): the call that found it refusing goes there
    # on its retry.
    # A connection of this client connection's own, never one another client opened earlier.
    http-reuse never
    retries 1
    option redispatch 1
    server v2 127.0.0.1:1 proto h2 disabled check inter 2s fall 1 rise 1 observe layer4 error-limit 1 on-error mark-down
    server serve {upstream_host}:{upstream_port} proto h2 backup
"""
# The server of backend serve_grpc that :meth:`front.Front.use_v2_port` points at the ``/v2``
# replica's gRPC server.
V2_SERVER = "serve_grpc/v2"

_HTTP = """\
frontend triton_http
{binds}\
{log}{internal}\
    # A request head over the limits: Triton's 400 with a JSON error, as the acceptor and the
    # replicas' listeners answer it (the request line counts with the headers). A request a
    # replica relays was checked by the replica, before the relay added its two headers.
    acl relayed so_name replica
    http-request set-var(txn.head_bytes) req.hdrs,length
    http-request return status 400 content-type application/json string "{too_large_head}" if {{ url,length,add(txn.head_bytes) gt {max_head} }} !relayed
    http-request return status 400 content-type application/json string "{too_many_headers}" if {{ req.fhdr_cnt gt {max_headers} }} !relayed
{restricted}\
    # POST /v2/models/<model>[/versions/<version>]/infer (or generate, generate_stream), and a GET of a model's metadata,
    # readiness, config or statistics; the model name may be %-encoded.
    # A body over --http-max-input-size is refused before it is read (one sent in chunks, with no
    # Content-Length, is counted by whoever reads it). HAProxy reads a header's value as a 32-bit
    # integer: a length that does not fit is over the limit too.
    acl length_given req.hdr(content-length) -m found
    acl length_read req.hdr_val(content-length) -m found
    acl too_large req.hdr_val(content-length) gt {max_input_size}
    acl too_large req.hdr_val(content-length) lt 0
    # A model load's body (its files inline) over the limit is an internal error, as Triton's is.
    http-request return status 500 content-type application/json lf-string "{{\\"error\\":\\"Load request JSON size of %[req.hdr(content-length)] bytes {load_too_large}\\"}}" if too_large {{ path_reg ^/v2/repository/models/[^/]+/load$ }}
    http-request return status 400 content-type application/json lf-string "{{\\"error\\":\\"Request JSON size of %[req.hdr(content-length)] bytes {too_large}\\"}}" if too_large || length_given !length_read
    acl post method POST
    acl get method GET
    acl infer_path path_reg ^/v2/models/[^/]+(/versions/[^/]*)?/(infer|generate|generate_stream)$
    acl model_get path_reg ^/v2/models/[^/]+(/versions/[^/]+)?(/ready|/config|/stats)?/?$
    acl versioned path,field(5,/) -m str versions
    http-request set-var(txn.model) path,field(4,/),url_dec if post infer_path || get model_get
    http-request set-var(txn.version) path,field(6,/) if post infer_path versioned || get model_get versioned
    http-request set-var(txn.key) var(txn.model),concat(/,txn.version) if post infer_path || get model_get
{split}{pick}\
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


def _internal_headers() -> str:
    """Rules dropping the server's own headers (a stream's, a sequence's request sent on, a
    trace's parent, the front key) from a client's request, first thing: only the server's parts
    set them (the backend sets the key again)."""
    names = (STREAM_HEADER, TRACE_PARENT_HEADER, FORWARDED_HEADER, FRONT_KEY_HEADER)
    return ("    # The server's own headers: never a client's.\n"
            + "".join(f"    http-request del-header {name.decode()}\n" for name in names))


def _http_errors() -> str:
    return "".join(f'    http-error status {status} content-type application/json string "{{\\"error\\":\\"{text}\\"}}"\n'
                   for status, text in _HTTP_ERRORS.items())


def _json_string(error: str) -> str:
    """Triton's JSON error body for ``error``, quoted for an HAProxy string argument."""
    return _escaped(json.dumps({"error": error}, separators=(",", ":")))


def _escaped(text: str) -> str:
    """``text`` quoted for an HAProxy string argument."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _http_restrictions(restrictions: Restrictions) -> str:
    """HAProxy rules answering 403 to a restricted group's paths without its header (its whole
    value: ``fhdr``, not split at commas, as a replica's listener and tritonserver compare it)."""
    lines = []
    for group, (key, value) in restrictions.items():
        name = group.replace("-", "_")
        lines.append(f"    acl api_{name} path_reg {' '.join(HTTP_PATHS[group])}\n")
        excluded = HTTP_EXCLUDED.get(group)
        unless = f" !{{ path_reg {excluded} }}" if excluded else ""
        body = _json_string(http_message(key))
        lines.append(f'    http-request return status 403 content-type application/json string "{body}" '
                     f"if api_{name}{unless} !{{ req.fhdr({key}) -m str {value} }}\n")
        if group in OPENAI_PATHS:
            lines.append(f"    acl openai_{name} path_reg {' '.join(OPENAI_PATHS[group])}\n")
            body = _escaped(json.dumps(openai_restricted_document(key), separators=(",", ":")))
            lines.append(f'    http-request return status 401 content-type application/json string "{body}" '
                         f"if openai_{name} !{{ req.fhdr({key}) -m str {value} }}\n")
    return "".join(lines)


def _grpc_restrictions(restrictions: Restrictions) -> str:
    """HAProxy rules failing a restricted group's RPCs without its header: UNAVAILABLE (14) in
    a headers-only gRPC response."""
    lines = []
    for group, (key, value) in restrictions.items():
        name = group.replace("-", "_")
        lines.append(f"    acl rpc_{name} path {' '.join(SERVICE + m for m in GRPC_METHODS[group])}\n")
        lines.append(f'    http-request return status 200 content-type application/grpc hdr grpc-status 14 '
                     f'hdr grpc-message "{grpc_message(key)}" '
                     f"if rpc_{name} !{{ req.fhdr({GRPC_HEADER_PREFIX}{key}) -m str {value} }}\n")
    return "".join(lines)


def _http_binds(folder: Path, address: str, port: int, acceptor: bool, tls: TlsSettings | None = None) -> str:
    if not acceptor:
        return f"    bind {address}:{port}{_ssl(folder, 'http', tls)}\n"
    # The supervisor's acceptor (acceptor.py) owns the port and passes HAProxy the connections it does
    # not give a model replica (on the first socket); a replica relays a request of a connection
    # it holds that is not its own to the second.
    paths = FrontPaths(folder)
    return (f"    bind unix@{paths.relay_socket} mode 600\n"
            f"    bind unix@{paths.replica_relay_socket} mode 600 name replica\n")


def _grpc_binds(folder: Path, address: str, port: int, acceptor: bool, tls: TlsSettings | None = None) -> str:
    if not acceptor:
        return f"    bind {address}:{port} proto h2{_ssl(folder, 'grpc', tls)}\n"
    # As for HTTP; a replica relays a call here as HTTP/1.1, a connection from the acceptor speaks
    # HTTP/2 (HAProxy tells them apart by the HTTP/2 preface).
    return f"    bind unix@{FrontPaths(folder).grpc_relay_socket} mode 600\n"


# The connections the acceptor passes to HAProxy. HAProxy cannot set the destination of a
# connection it received over a socket pair (the pair's family has no addresses), which routing
# to a listener needs: their bytes go on to the frontend's Unix socket.
_ACCEPTOR = """\
frontend {name}
    mode tcp
    bind "sockpair@${{{variable}}}"
    default_backend {name}_relay

backend {name}_relay
    mode tcp
    server relay unix@{relay}
"""


def render(folder: Path, http: Endpoint | None, grpc: Endpoint | None, server_app: str, threads: int,
           max_input_size: int, http_restricted: Restrictions | None, grpc_restricted: Restrictions | None,
           max_inflight: int, acceptor: bool = False, grpc_acceptor: bool = False,
           tls: dict[str, TlsSettings] | None = None, *, front_key: str,
           limits: ConnectionLimits = DEFAULT_CONNECTION_LIMITS) -> str:
    """The configuration of a front whose files are in ``folder`` (see :class:`front.Front`);
    ``acceptor``, ``grpc_acceptor``: HTTP, gRPC connections arrive through the supervisor's acceptor
    (:mod:`acceptor`); ``tls``: TLS by port kind ("http", "grpc"), on ports without an acceptor;
    ``front_key``: the server's (:mod:`rayinfer.protocol.front_key`), sent with every request to
    a replica's listener (the configuration holds it: keep it readable by the server's user only);
    ``limits``: the front's timeouts and connections (:class:`~rayinfer.protocol.limits.ConnectionLimits`)."""
    if not is_front_key(front_key):
        raise ValueError("the front key must be 32 to 128 hex digits")
    busy = inflight_limit_message(max_inflight)
    tls = tls or {}
    maps = MapPaths.of(folder)
    paths = {"counts": maps.counts, "listeners": maps.listeners, "sequences": maps.sequences}
    split_maps = {"splits": maps.splits, "split_versions": maps.split_versions, "split_headers": maps.split_headers}
    parts = [_GLOBAL.format(ring=EVENTS_RING, admin=FrontPaths(folder).admin_socket, threads=threads, http_errors=_http_errors(),
                            lua=folder / LUA.name, front_key_header=FRONT_KEY_HEADER.decode(), front_key=front_key,
                            max_connections=limits.front_max_connections, idle_s=limits.stream_idle_timeout_s,
                            keepalive_s=limits.keepalive_timeout_s, head_s=limits.request_head_timeout_s)]
    if http is not None:
        pick = _PICK_REPLICA.format(**paths, sequence_fetch="rayinfer_http_sequence")
        split = _SPLIT.format(**split_maps, condition="post infer_path !versioned")
        parts.append(_HTTP.format(
            log=_LOG, split=split, internal=_internal_headers(),
            binds=_http_binds(folder, http[0], http[1], acceptor, tls.get("http")), pick=pick, upstream_host=http[2], upstream_port=http[3],
            use_replica=_USE_REPLICA, unrouted=UNROUTED_PREFIX, max_input_size=max_input_size,
            too_large=body_limit_message(max_input_size), load_too_large=load_limit_message(max_input_size), max_inflight=max_inflight, busy=busy,
            restricted=_http_restrictions(http_restricted or {}), max_head=MAX_REQUEST_HEAD_BYTES,
            max_headers=MAX_REQUEST_HEADERS, too_large_head=_json_string(malformed_head_message(HEAD_TOO_LARGE)),
            too_many_headers=_json_string(malformed_head_message(TOO_MANY_HEADERS)),
        ))
        if acceptor:
            parts.append(_ACCEPTOR.format(name="acceptor", variable=HANDOFF_FD_VARIABLES["http"], relay=FrontPaths(folder).relay_socket))
    if grpc is not None:
        pick = _PICK_REPLICA.format(**paths, sequence_fetch="rayinfer_grpc_sequence")
        split = _SPLIT.format(**split_maps, condition=f"{{ path {SERVICE}ModelInfer }} !{{ var(txn.version) -m len gt 0 }}")
        parts.append(_GRPC.format(
            log=_LOG, split=split, internal=_internal_headers(),
            binds=_grpc_binds(folder, grpc[0], grpc[1], grpc_acceptor, tls.get("grpc")), pick=pick, upstream_host=grpc[2], upstream_port=grpc[3],
            paths=" ".join(SERVICE + rpc for rpc in ROUTED_RPCS), server_app=server_app,
            use_replica=_USE_REPLICA, restricted=_grpc_restrictions(grpc_restricted or {}),
            max_inflight=max_inflight, busy=busy,
        ))
        if grpc_acceptor:
            parts.append(_ACCEPTOR.format(name="grpc_acceptor", variable=HANDOFF_FD_VARIABLES["grpc"],
                                      relay=FrontPaths(folder).grpc_relay_socket))
    return "\n".join(parts)
