"""The front's acceptor: accepts HTTP and gRPC connections and gives each to the process that will
read it.

HAProxy (:mod:`front`) reads every request and writes every answer a second time, which costs a
model call about a quarter of the server's CPU on small machines (docs/dev/benchmark-log.md). The acceptor
takes that hop out of the steady state. It owns the HTTP port, peeks at the request line of a new
connection (``MSG_PEEK``: nothing is consumed), and when that request is a model call or a
model GET whose version has a replica on this machine, it passes the connection itself
(``SCM_RIGHTS``) to that replica's listener, which then reads the client's requests and answers
them with no process in between (:mod:`replica_listener`). A connection whose first request is
not a model's (readiness, metadata, the repository API) goes to any replica here, which relays
that request to HAProxy and gives the connection back, to be placed by its next request. Every
other connection (a model with no replica here, the calls of a sequence model with several
replicas, which the front routes one by one by correlation id, no replica here at all, a request
line that has not arrived within :data:`_PEEK_WAIT_S`) is passed to HAProxy over the socket pair
it reads connections from (``bind sockpair@``), where it is served as before. A replica that
cannot take a connection (gone, or not reading) gets none: HAProxy does. Replicas give their
connections back between two requests every few seconds and when they stop (:func:`give_back`);
the acceptor passes each on again by its next request, so connections spread over replicas that
started since and outlive the replica that held them.

gRPC connections (HTTP/2) are placed the same way by their first call, read from its headers
and the start of its message (:func:`grpc_route_key`; the acceptor first sends the server's preface,
which a gRPC client waits for); a replica answers its version's model calls on them
(:mod:`replica_h2`), and its streams (by the model their first message names; any replica here
for a stream whose first message has not come within :data:`_PEEK_WAIT_S`), and never gives one
back: it closes it gracefully when it is due to be rebalanced, and the client's gRPC library opens
a new one, which the acceptor places again.

The acceptor runs in the front's supervisor (:mod:`front_supervisor`), and reads the
front's route maps from disk (written after each change by :meth:`front.Front.publish`).
A replica's handoff socket is an abstract Unix socket named after its listener's address, so it is
private to the network namespace, like the listener.
"""

from __future__ import annotations

import contextlib
import logging
import re
import selectors
import socket
import threading
import time
from pathlib import Path

import httptools

from rayinfer.protocol.grpc_wire import INCOMPLETE, NOT_DIRECT_RPCS, PREFACE, ROUTED_RPCS, STREAM_RPC, first_call, settings
from rayinfer.protocol.limits import HEAD_TOO_LARGE, MAX_REQUEST_HEAD_BYTES, MAX_REQUEST_HEADERS, TOO_MANY_HEADERS, bad_head_answer
from rayinfer.serving.handoff import RELAY_SOCKETS, SPLICE, handoff_name, return_name, same_user
from rayinfer.serving.routes import front_routed
from rayinfer.serving.version_split import SplitPlacement, VersionSplit, pick_version, sticky_value

logger = logging.getLogger(__name__)

# How long a new connection may take to send its request line before it goes to HAProxy, which
# applies its own timeouts to it.
_PEEK_WAIT_S = 0.5
# A connection a replica gave back waits this long for its client's next request (an idle
# keep-alive client may send it much later) before it goes to HAProxy.
_RETURNED_WAIT_S = 30.0
# The most of a connection's first bytes the acceptor looks at: an HTTP request line, or a gRPC
# call's headers and the start of its message.
_PEEK_BYTES = MAX_REQUEST_HEAD_BYTES
_SERVER_PREFACE = settings({})
# A gRPC connection whose first call has not all arrived is looked at again this much later.
_PEEK_AGAIN_S = 0.002
# A replica whose acceptor refused a connection is not tried again for this long.
_REFUSED_FOR_S = 2.0
# A replica that gave its connections back because it stops gets none for this long (its route
# goes within about 2 s).
_STOPPING_S = 30.0
# A client connection at a rollout's split that has not been placed again for this long counts at its
# version no more (a replica gives a connection back between two requests every 2 s).
_PLACED_FOR_S = 10.0
# An HTTP/1.x request line, as leniently as HAProxy reads one (a token, a target, the version).
_REQUEST_LINE = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+ +[^ ]+ +HTTP/1\.\d *")
# HAProxy's environment variables holding the descriptors of its ends of the socket pairs.
HANDOFF_FD_VARIABLES = {"http": "RAYINFER_ACCEPTOR_FD", "grpc": "RAYINFER_GRPC_ACCEPTOR_FD"}


class _RequestTarget:
    """The request target httptools reads from a request line."""

    def __init__(self) -> None:
        self.url = b""
        self.ended = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_headers_complete(self) -> None:
        self.ended = True


def route_key(request: bytes) -> str | None:
    """``<model>/<version>`` of a request line that is a model call or a model GET, "" for
    another HTTP/1.x request, None for what is not one (the line parsed by httptools)."""
    line, found, _ = request.partition(b"\r\n")
    if not found:
        return None
    target = _RequestTarget()
    parser = httptools.HttpRequestParser(target)
    try:
        parser.feed_data(line + b"\r\n\r\n")  # the line alone, as a whole head
    except httptools.HttpParserError:
        return None
    if not target.ended or not parser.get_http_version().startswith("1."):
        return None
    route = front_routed(parser.get_method().decode("latin-1"), target.url.partition(b"?")[0].decode("latin-1"))
    return "" if route is None else f"{route.model}/{route.version}"


class _HeadFields:
    """The header fields httptools reads from a request head."""

    def __init__(self) -> None:
        self.fields: list[tuple[bytes, bytes]] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))


def _head_fields(head: bytes) -> list[tuple[bytes, bytes]]:
    """The header fields of the request head ``head`` starts (as many as have arrived whole)."""
    fields = _HeadFields()
    end = head.find(b"\r\n\r\n")
    if end < 0:
        end = head.rfind(b"\r\n")  # a head still arriving: its whole lines
    with contextlib.suppress(httptools.HttpParserError):  # what was read before the error stays
        httptools.HttpRequestParser(fields).feed_data(head[:end] + b"\r\n\r\n")
    return fields.fields


def grpc_route_key(head: bytes, stream_message: bool = True) -> str | None:
    """``<model>/<version>`` of a gRPC connection's first call (its first bytes ``head``) that is
    a model RPC or a stream, "" for another unary call of the service a replica relays, None for a
    connection HAProxy takes (a model load or unload, another service, a compressed message, not
    HTTP/2); :data:`INCOMPLETE` when more bytes are needed (a stream's first message, unless
    ``stream_message`` is False: then "" for a stream without it)."""
    call = first_call(head, stream_message=stream_message)
    if call is INCOMPLETE:
        return INCOMPLETE  # type: ignore[return-value]
    if call is None or not call.method or "/" in call.method or call.method in NOT_DIRECT_RPCS:
        return None
    if call.method == STREAM_RPC:
        return f"{call.model}/{call.version}" if call.model else ""
    if call.method not in ROUTED_RPCS:
        return ""
    return f"{call.model}/{call.version}" if call.model else None


def routes_on_disk(folder: Path) -> tuple[dict[str, list[tuple[str, int]]], frozenset[str]]:
    """The routes the front in ``folder`` was last given (its maps, as written after each
    change): ``<model>/<version>`` -> its listeners, and the keys routed by sequence slot."""
    addresses = {}
    for line in (folder / "listeners.map").read_text().splitlines():
        entry, _, listener = line.partition(" ")
        host, _, port = listener.rpartition("|")
        addresses[entry] = (host, int(port))
    routes = {}
    for line in (folder / "replicas.map").read_text().splitlines():
        key, _, count = line.partition(" ")
        routes[key] = [addresses[f"{key}/{n}"] for n in range(int(count)) if f"{key}/{n}" in addresses]
    sequences = frozenset(line.partition(" ")[0] for line in (folder / "sequences.map").read_text().splitlines())
    return routes, sequences


def splits_on_disk(folder: Path) -> dict[str, tuple[int, str, str]]:
    """The rollouts' splits the front in ``folder`` was last given: model -> (the candidate's
    weight, its version, the sticky header or "")."""
    def read(name: str) -> dict[str, str]:
        path = folder / f"{name}.map"
        lines = path.read_text().splitlines() if path.exists() else []
        return dict(line.partition(" ")[::2] for line in lines if line)

    weights, versions, headers = read("splits"), read("split_versions"), read("split_headers")
    return {model: (int(weight), versions[model], headers.get(model, ""))
            for model, weight in weights.items() if model in versions}


class _Routes:
    """The front's route maps as last written to disk."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._paths = [folder / "replicas.map", folder / "listeners.map", folder / "sequences.map",
                       folder / "splits.map"]
        self._stamps: list[int] = []
        self.listeners: dict[str, list[tuple[str, int]]] = {}
        self.sequences: frozenset[str] = frozenset()
        # Models in a rollout: their version-less requests are split between two versions.
        self.splits: dict[str, VersionSplit] = {}

    def refresh(self) -> None:
        """Read the maps again if they changed (three stat calls per new connection)."""
        try:
            stamps = [path.stat().st_mtime_ns if path.exists() else 0 for path in self._paths]
            if stamps != self._stamps:
                self.listeners, self.sequences = routes_on_disk(self._folder)
                self.splits = {model: VersionSplit("", candidate, weight, header)
                               for model, (weight, candidate, header) in splits_on_disk(self._folder).items()}
                self._stamps = stamps
        except (OSError, ValueError):  # a map being written: the last one read stays
            return


class Acceptor:
    """Accepts on ``listening`` (protocol, "http" or "grpc" -> its non-blocking listening socket)
    and passes each connection to a model replica or, over ``haproxy`` (protocol -> the acceptor's
    end of HAProxy's socket pair), to HAProxy. A replica sends a request that is not its own to
    the protocol's Unix socket of HAProxy in ``folder`` (:data:`RELAY_SOCKETS`)."""

    def __init__(self, listening: dict[str, socket.socket], haproxy: dict[str, socket.socket], folder: Path) -> None:
        self._haproxy = haproxy
        self._relays = {kind: str(folder / name).encode() for kind, name in RELAY_SOCKETS.items()}
        self._routes = _Routes(folder)
        self._selector = selectors.DefaultSelector()
        for kind, sock in listening.items():
            self._selector.register(sock, selectors.EVENT_READ, lambda s, kind=kind: self._accept(s, kind))
        self._returns = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._returns.bind(return_name(folder.name))
        self._returns.listen(64)
        self._returns.setblocking(False)
        self._selector.register(self._returns, selectors.EVENT_READ, self._accept_return)
        self._waiting: dict[socket.socket, float] = {}  # connection -> when it goes to HAProxy
        self._kinds: dict[socket.socket, str] = {}  # connection -> the port it came to
        self._again: dict[socket.socket, float] = {}  # connection -> when to look at it again
        self._handoffs: dict[str, socket.socket] = {}  # acceptor name -> a connected channel
        self._refused: dict[str, float] = {}  # acceptor name -> when it may be tried again
        self._next: dict[str, int] = {}  # route key -> the replica the next connection goes to
        self._directed: dict[socket.socket, str] = {}  # connection -> the route key of its next run
        self._placement = SplitPlacement(_PLACED_FOR_S)  # the runs of connections at rollouts' splits

    def serve(self, seconds: float) -> None:
        """Serve for about ``seconds``."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            soonest = min(min(self._waiting.values(), default=deadline), min(self._again.values(), default=deadline))
            for key, _ in self._selector.select(max(min(left, soonest - time.monotonic()), 0)):
                key.data(key.fileobj)
            now = time.monotonic()
            for connection in [c for c, when in self._again.items() if when <= now]:
                del self._again[connection]
                self._selector.register(connection, selectors.EVENT_READ, self._peek)
            for connection in [c for c, until in self._waiting.items() if until <= now]:
                kind = self._stop_waiting(connection)
                self._place_late(connection, kind)

    def close(self) -> None:
        for connection in list(self._waiting):
            self._stop_waiting(connection)
            connection.close()
        for channel in self._handoffs.values():
            channel.close()
        self._selector.close()
        self._returns.close()

    def _accept(self, listening: socket.socket, kind: str) -> None:
        for _ in range(64):
            try:
                connection, _ = listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, a connection reset before accept: the next one
                return
            if kind == "grpc":
                # The server's preface (a SETTINGS frame, defaults unchanged): a gRPC client sends
                # its first call only once it has it. Whoever takes the connection sends its own.
                try:
                    connection.send(_SERVER_PREFACE)
                except OSError:
                    connection.close()
                    continue
            self._wait_for_request(connection, _PEEK_WAIT_S, kind)

    def _wait_for_request(self, connection: socket.socket, seconds: float, kind: str = "") -> None:
        connection.setblocking(False)
        self._waiting[connection] = time.monotonic() + seconds
        self._kinds[connection] = kind
        self._selector.register(connection, selectors.EVENT_READ, self._peek)

    def _peek(self, connection: socket.socket) -> None:
        try:
            head = connection.recv(_PEEK_BYTES, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            head = b""
        kind = self._kinds[connection] = self._kinds[connection] or _speaks(head)
        if kind == "grpc":
            key = grpc_route_key(head) if head else None
            if key is INCOMPLETE and len(head) < _PEEK_BYTES:  # the rest of its first call is on its way
                self._selector.unregister(connection)
                self._again[connection] = time.monotonic() + _PEEK_AGAIN_S
                return
            key = None if key is INCOMPLETE else key
        else:
            key = route_key(head) if b"\r\n" in head else None
        directed = self._directed.get(connection, "")
        self._stop_waiting(connection)
        if not head:  # closed before it sent anything
            connection.close()
            return
        if kind == "http" and not key:  # not a model's request: HAProxy answers it, directly or relayed
            refusal = bad_request_head(head)
            if refusal is not None:
                _refuse(connection, refusal)
                return
        if key is None or not self._to_replica(connection, key, kind, head, directed):
            self._to_haproxy(connection, kind)

    def _place_late(self, connection: socket.socket, kind: str) -> None:
        """A connection whose first request did not arrive within :data:`_PEEK_WAIT_S`: a gRPC
        stream whose client has not sent its first message (it may wait for its user) goes to
        any replica here, which answers it; anything else to HAProxy."""
        if kind == "grpc":
            try:
                head = connection.recv(_PEEK_BYTES, socket.MSG_PEEK)
            except OSError:
                head = b""
            if head and grpc_route_key(head, stream_message=False) == "" and self._to_replica(connection, "", kind):
                return
        self._to_haproxy(connection, kind)

    def _stop_waiting(self, connection: socket.socket) -> str:
        """Stop waiting for ``connection``'s request; the protocol it speaks."""
        self._waiting.pop(connection, None)
        self._directed.pop(connection, None)
        if self._again.pop(connection, None) is None:
            self._selector.unregister(connection)
        kind = self._kinds.pop(connection, "")
        if not kind:
            try:
                kind = _speaks(connection.recv(len(PREFACE), socket.MSG_PEEK))
            except OSError:
                kind = "http"
        return kind

    def _to_replica(self, connection: socket.socket, key: str, kind: str, head: bytes = b"",
                    directed: str = "") -> bool:
        """Pass ``connection`` (its first request ``head``, for ``key``) to a replica of this
        machine (``directed``: where a run at a rollout's split goes on); False: HAProxy takes it."""
        self._routes.refresh()
        given_for = key  # the route key the replica is told
        split = self._routes.splits.get(key[:-1]) if key.endswith("/") else None
        if split is not None:
            # A rollout's version-less request: an HTTP/1.1 connection goes to the version its
            # sticky value picks, or for a run of version-less requests at the version and of the
            # length the placement says (version_split.py). gRPC's calls share a connection: it
            # goes to the version with the larger weight, whose replica relays the other's calls,
            # picked one by one.
            sticky = sticky_value(split, _head_fields(head)) if split.sticky_header and kind == "http" else None
            directed, _, left = directed.partition(" ")
            if kind != "http":
                key = f"{key}{split.candidate}" if split.weight > 50 else key
            elif head.startswith(b"POST "):  # an inference (a model GET stays the stable version's)
                client = _client_address(connection)
                if sticky:
                    key = f"{key}{split.candidate}" if pick_version(split, sticky) == split.candidate else key
                elif directed.startswith(key) and left.isdigit() and self._routes.listeners.get(directed):
                    # The rest of a run (its connection was rebalanced, or its replica stops).
                    version = directed[len(key):]
                    self._placement.at(key, version if version == split.candidate else "", client, time.monotonic())
                    key, given_for = directed, f"{given_for}\n{left}"
                else:  # a new run: the replica of its last one named the other version
                    version = directed[len(key):] if directed.startswith(key) else ""
                    version, length = self._placement.place(key, split, client, time.monotonic(),
                                                            version if version == split.candidate else "")
                    key, given_for = f"{key}{version}", f"{given_for}\n{length}"
        if not key:
            # Not a model's request (health, metadata, the repository API): a replica of this
            # machine relays it to HAProxy, then gives the connection back, which its next
            # request then places (a client asking for readiness first, then for inferences).
            key = next(iter(self._routes.listeners), "")
        listeners = self._routes.listeners.get(key)
        # A sequence model's calls go to the replica of their correlation id's slot, which the
        # front reads from each request: a connection only where one replica holds every slot.
        if not listeners or (key in self._routes.sequences and len(listeners) > 1):
            return False
        # The replicas in turn. One on another machine (no acceptor here), or one that cannot take
        # the connection, leaves it to HAProxy, which balances its requests over all replicas.
        n = self._next.get(key, 0) % len(listeners)
        self._next[key] = n + 1
        name = handoff_name(*listeners[n])
        now = time.monotonic()
        if self._refused.get(name, 0.0) > now:
            return False
        if not self._send(name, connection, given_for, self._relays[kind]):
            self._refused[name] = now + _REFUSED_FOR_S
            return False
        connection.close()  # the replica holds its own descriptor of it now
        return True

    def _send(self, name: str, connection: socket.socket, key: str, relay: bytes) -> bool:
        """Pass ``connection`` to the replica handoff socket ``name``: False if it is not there or full."""
        message = b"%b\n%b" % (relay, key.encode())
        for attempt in range(2):  # a kept channel may have closed (the replica restarted)
            channel = self._handoffs.get(name)
            try:
                if channel is None:
                    channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                    channel.setblocking(False)
                    self._handoffs[name] = channel
                    channel.connect(name)
                    if not same_user(channel):  # another user's process holds the replica's name
                        raise OSError(f"{name[1:]!r} is not the server's")
                socket.send_fds(channel, [message], [connection.fileno()])
                return True
            except OSError:
                self._handoffs.pop(name, None)
                if channel is not None:
                    channel.close()
                if attempt:
                    return False
        return False

    def _to_haproxy(self, connection: socket.socket, kind: str) -> None:
        try:
            socket.send_fds(self._haproxy[kind], [b"c"], [connection.fileno()])
        except (OSError, KeyError):
            pass  # HAProxy is gone: the supervisor stops; the client sees its connection close
        connection.close()

    def _accept_return(self, returns: socket.socket) -> None:
        try:
            channel, _ = returns.accept()
        except OSError:
            return
        if not same_user(channel):
            logger.warning("refused a connection to the acceptor's return socket from another user's process")
            channel.close()
            return
        channel.setblocking(False)
        self._selector.register(channel, selectors.EVENT_READ, self._take_back)

    def _take_back(self, channel: socket.socket) -> None:
        """Connections a replica gives back between two requests (it stops, or its connections
        are rebalanced: see :func:`give_back`): each goes where its next request says."""
        try:
            message, fds, _, _ = socket.recv_fds(channel, 1 << 17, 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            message, fds = b"", []
        if not fds:
            self._selector.unregister(channel)
            channel.close()
            return
        if message.startswith(SPLICE) and len(fds) == 2:
            client, upstream = (socket.socket(fileno=fd) for fd in fds)
            threading.Thread(target=_splice, args=(client, upstream, message[len(SPLICE):]), daemon=True).start()
            return
        stopping, _, name = message.decode("utf-8", "replace").partition(" ")
        name, _, move_to = name.partition(" ")
        if stopping == "stopping":  # no more connections for it, even before its route goes
            self._refused[name] = time.monotonic() + _STOPPING_S
        for fd in fds:
            connection = socket.socket(fileno=fd)
            self._placement.leaves(_client_address(connection))
            self._wait_for_request(connection, _RETURNED_WAIT_S)
            if move_to:  # a run at a rollout's split: the other version's turn, or the rest of it
                self._directed[connection] = move_to


def bad_request_head(head: bytes) -> str | None:
    """Why the request head ``head`` starts (the most the acceptor peeks) is refused, or None: a
    request line that is not HTTP/1.x (HAProxy's parser would answer it with an HTML page), a
    line or head longer than the peek, more headers than the limit (:mod:`limits`). A head not
    all arrived yet is judged by what has."""
    if head[:len(PREFACE)] == PREFACE[:len(head)]:  # HTTP/2 with prior knowledge: HAProxy's
        return None
    end = head.find(b"\r\n")
    if end < 0:
        return "request line too long" if len(head) >= _PEEK_BYTES else None
    if _REQUEST_LINE.fullmatch(head[:end]) is None:
        return "malformed request line"
    head_end = head.find(b"\r\n\r\n")
    if head_end < 0 and len(head) >= _PEEK_BYTES:
        return HEAD_TOO_LARGE
    headers = head.count(b"\r\n", 0, head_end if head_end >= 0 else len(head))  # the line ends before it
    if headers > MAX_REQUEST_HEADERS:
        return TOO_MANY_HEADERS
    return None


def _refuse(connection: socket.socket, reason: str) -> None:
    """Answer a request head refused for ``reason`` with Triton's form of a 400, then close."""
    # (a short answer on a new connection: its send buffer takes it at once). OSError: nothing
    # more to read now, or the client is gone.
    with contextlib.suppress(OSError):
        connection.send(bad_head_answer(reason))
        connection.shutdown(socket.SHUT_WR)
        # What the client sent so far: closing with it unread would reset the answer away.
        while connection.recv(65536, socket.MSG_DONTWAIT):
            continue
    connection.close()


def _client_address(connection: socket.socket) -> tuple | None:
    """The client's address of ``connection`` (which names it while it passes between replicas)."""
    try:
        return connection.getpeername()
    except OSError:  # the client is gone
        return None


def _speaks(head: bytes) -> str:
    """The protocol of a connection given back (it has no port of its own), by its first bytes."""
    return "grpc" if head and head[:len(PREFACE)] == PREFACE[:len(head)] else "http"


def _splice(client: socket.socket, upstream: socket.socket, first: bytes) -> None:
    """Copy HAProxy's answer to a relayed request to the client, then close both (the answer
    says ``connection: close``)."""
    with client, upstream:
        try:
            client.setblocking(True)
            upstream.settimeout(3600.0)
            client.sendall(first)
            while data := upstream.recv(1 << 16):
                client.sendall(data)
        except OSError:
            pass  # the client or HAProxy went away: both connections close


def listening_socket(address: str, port: int) -> socket.socket:
    """The HTTP port's listening socket (non-blocking)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listening = socket.socket(family, socket.SOCK_STREAM)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Inherited by every accepted connection. HAProxy sets it on the connections it accepts
    # itself, not on those it is given (``sockpair@``): without it, the frames of a gRPC answer
    # after the first waited for the client's delayed acknowledgement, about 40 ms a call.
    listening.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    listening.bind((address, port))
    listening.listen(1024)
    listening.setblocking(False)
    return listening

