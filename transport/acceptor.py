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
and the start of its message (:mod:`request_heads`; the acceptor first sends the server's
preface, which a gRPC client waits for); a replica answers its version's model calls on them
(:mod:`replica_h2`), and its streams (by the model their first message names; any replica here
for a stream whose first message has not come within :data:`_PEEK_WAIT_S`), and never gives one
back: it closes it gracefully when it is due to be rebalanced (or its run at a rollout's split
ends), and the client's gRPC library opens a new one, which the acceptor places again.

The acceptor runs in the front's supervisor (:mod:`front_supervisor`), and reads the
front's route maps from disk (:mod:`front_maps`, written after each change by :meth:`front.Front.publish`).
A replica's handoff socket is an abstract Unix socket named after its listener's address, so it is
private to the network namespace, like the listener.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rayinfer.protocol.grpc_wire import INCOMPLETE, PREFACE, settings
from rayinfer.protocol.limits import MAX_REQUEST_HEAD_BYTES
from rayinfer.transport.front_maps import RouteMaps
from rayinfer.transport.front_paths import FrontPaths
from rayinfer.transport.handoff import handoff_name, return_name, same_user
from rayinfer.transport.handoff_messages import HandOff, Splice, decode_returned
from rayinfer.transport.request_heads import bad_request_head, grpc_route_key, head_fields, protocol_of, refuse, route_key
from rayinfer.transport.router import ConnectionPlacement

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
# HAProxy's environment variables holding the descriptors of its ends of the socket pairs.
HANDOFF_FD_VARIABLES = {"http": "RAYINFER_ACCEPTOR_FD", "grpc": "RAYINFER_GRPC_ACCEPTOR_FD"}
# Answers to relayed requests copied to their clients by threads of their own at once, at most.
_MAX_SPLICES = 64
# A refusal (a connection closed for a bound) is logged at most this often.
_WARN_EVERY_S = 5.0


@dataclass(frozen=True)
class AcceptorLimits:
    """What the acceptor holds for its clients, with the flags that set each."""

    max_connections: int = 4096  # --front-max-connections: connections waiting for their first request
    idle_timeout_s: float = 300.0  # --stream-idle-timeout: a relayed answer copied to its client
    send_timeout_s: float = 60.0  # --client-send-timeout: a client not taking that answer

    @classmethod
    def parse(cls, line: str) -> AcceptorLimits:
        """The limits from the acceptor file's line ``limits <connections> <idle s> <send s>``."""
        connections, idle, send = line.split()[1:4]
        return cls(int(connections), float(idle), float(send))

    def line(self) -> str:
        return f"limits {self.max_connections} {self.idle_timeout_s:g} {self.send_timeout_s:g}\n"


class Acceptor:
    """Accepts on ``listening`` (protocol, "http" or "grpc" -> its non-blocking listening socket)
    and passes each connection to a model replica or, over ``haproxy`` (protocol -> the acceptor's
    end of HAProxy's socket pair), to HAProxy. A replica sends a request that is not its own to
    the protocol's Unix socket of HAProxy in ``folder`` (:meth:`FrontPaths.relay_sockets`)."""

    def __init__(self, listening: dict[str, socket.socket], haproxy: dict[str, socket.socket], folder: Path,
                 limits: AcceptorLimits = AcceptorLimits()) -> None:
        self._limits = limits
        # Never blocks: a HAProxy that takes no more connections gets none (they are closed),
        # instead of stalling both ports.
        for channel in haproxy.values():
            channel.setblocking(False)
        self._haproxy = haproxy
        self._splices = threading.BoundedSemaphore(_MAX_SPLICES)
        self._warned_at = 0.0
        self._relays = {kind: str(path) for kind, path in FrontPaths(folder).relay_sockets().items()}
        self._routes = RouteMaps(folder)
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
        self._placement = ConnectionPlacement(_PLACED_FOR_S)  # the runs of connections at rollouts' splits

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
            if len(self._waiting) >= self._limits.max_connections:
                self._warn("closed a new connection: %d connections are waiting for their first request "
                           "(--front-max-connections)", len(self._waiting))
                connection.close()
                continue
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
        kind = self._kinds[connection] = self._kinds[connection] or protocol_of(head)
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
                refuse(connection, refusal)
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
                kind = protocol_of(connection.recv(len(PREFACE), socket.MSG_PEEK))
            except OSError:
                kind = "http"
        return kind

    def _to_replica(self, connection: socket.socket, key: str, kind: str, head: bytes = b"",
                    directed: str = "") -> bool:
        """Pass ``connection`` (its first request ``head``, for ``key``) to a replica of this
        machine (``directed``: where a run at a rollout's split goes on); False: HAProxy takes it."""
        self._routes.refresh()
        given_for, run_left = key, 0  # the route key the replica is told, and its run there
        split = self._routes.splits.get(key[:-1]) if key.endswith("/") else None
        if split is not None:  # a rollout's version-less request: the router places the connection
            key, run_left = self._placement.place(
                key, split, kind != "http", head.startswith(b"POST "), lambda: head_fields(head), directed,
                _client_address(connection), lambda routed: bool(self._routes.listeners.get(routed)),
                time.monotonic())
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
        if not self._send(name, connection, HandOff(self._relays[kind], given_for, run_left)):
            self._refused[name] = now + _REFUSED_FOR_S
            return False
        connection.close()  # the replica holds its own descriptor of it now
        return True

    def _send(self, name: str, connection: socket.socket, handoff: HandOff) -> bool:
        """Pass ``connection`` to the replica handoff socket ``name``: False if it is not there or full."""
        message = handoff.encode()
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
        except (BlockingIOError, InterruptedError):
            self._warn("closed a connection: the front's HAProxy takes no more connections")
        except (OSError, KeyError):
            pass  # HAProxy is gone: the supervisor stops; the client sees its connection close
        connection.close()

    def _warn(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            logger.warning(message, *args)

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
        returned = decode_returned(message)
        if isinstance(returned, Splice):
            if len(fds) != 2:
                for fd in fds:
                    os.close(fd)
                return
            client, upstream = (socket.socket(fileno=fd) for fd in fds)
            if not self._splices.acquire(blocking=False):
                self._warn("closed a relayed answer's connection: %d are being copied already", _MAX_SPLICES)
                client.close()
                upstream.close()
                return
            threading.Thread(target=_splice, args=(client, upstream, returned.answered, self._limits,
                                                   self._splices), daemon=True).start()
            return
        if returned.stopping:  # no more connections for it, even before its route goes
            self._refused[returned.replica] = time.monotonic() + _STOPPING_S
        move_to = returned.move_to
        for fd in fds:
            connection = socket.socket(fileno=fd)
            if self._routes.splits:  # it counts at no version while it waits for its next request
                self._placement.leaves(_client_address(connection))
            self._wait_for_request(connection, _RETURNED_WAIT_S)
            if move_to:  # a run at a rollout's split: the other version's turn, or the rest of it
                self._directed[connection] = move_to


def _client_address(connection: socket.socket) -> tuple | None:
    """The client's address of ``connection`` (which names it while it passes between replicas)."""
    try:
        return connection.getpeername()
    except OSError:  # the client is gone
        return None


def _splice(client: socket.socket, upstream: socket.socket, first: bytes, limits: AcceptorLimits,
            splices: threading.BoundedSemaphore) -> None:
    """Copy HAProxy's answer to a relayed request to the client, then close both (the answer
    says ``connection: close``); an answer silent for ``idle_timeout_s``, or a client that takes
    none of it for ``send_timeout_s``, ends the copy."""
    with client, upstream:
        try:
            client.settimeout(limits.send_timeout_s)
            upstream.settimeout(limits.idle_timeout_s)
            client.sendall(first)
            while data := upstream.recv(1 << 16):
                client.sendall(data)
        except OSError:
            pass  # the client or HAProxy went away, or a timeout: both connections close
        finally:
            splices.release()


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

