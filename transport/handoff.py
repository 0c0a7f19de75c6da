"""The handoff of client connections between the front's acceptor and model replicas.

The acceptor (:mod:`rayinfer.transport.acceptor`) passes a client's connection to the replica
whose listener will read it (``SCM_RIGHTS`` over an abstract Unix socket named after the
listener: :func:`handoff_name`, :class:`ReplicaHandoff`); a replica gives connections back to the
acceptor between two requests and when it stops (:func:`give_back` to :func:`return_name`).
Every channel is checked to come from the server's own user (``SO_PEERCRED``: :func:`same_user`),
as a filesystem socket with mode 0600 would be.

A replica's end: the acceptor keeps one channel open to each replica it passes connections to;
each message carries one connection and says which socket of the front's HAProxy takes the
requests the replica does not answer, and the route key the acceptor gave it for.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from collections.abc import Callable

from rayinfer.transport.handoff_messages import GiveBack, HandOff, Splice

logger = logging.getLogger(__name__)

# HAProxy's HTTP and gRPC frontends listen on Unix sockets in the front's folder
# (:class:`rayinfer.transport.front_paths.FrontPaths`): the connections the acceptor passes HAProxy
# arrive on the first (HAProxy's socket pair is relayed to it), the requests replicas relay on the
# others. A replica has read and checked the head of each request it relays (as the acceptor
# checks a connection's first), so HAProxy does not count the two headers a relay adds against the
# client's limits.


def handoff_name(host: str, port: int) -> str:
    """The abstract Unix socket a replica whose listener is ``host``:``port`` takes connections on."""
    return f"\0rayinfer-acceptor-{host}-{port}"


def same_user(channel: socket.socket) -> bool:
    """Whether the process at the other end of a Unix socket runs as this one's user
    (``SO_PEERCRED``): the acceptor's abstract sockets take connections and messages only from the
    server's own processes, as a filesystem socket with mode 0600 would."""
    try:
        _, uid, _ = struct.unpack("3i", channel.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except OSError:
        return False
    return uid == os.getuid()


def return_name(folder_name: str) -> str:
    """The abstract Unix socket the acceptor of the front whose folder is named ``folder_name``
    takes connections back on."""
    return f"\0rayinfer-acceptor-back-{folder_name}"


# The channel to each front's acceptor (by its folder's name) a process gave connections back
# on: kept open, as the acceptor keeps its channels to replicas (a rollout's split moves
# connections between replicas every few requests).
_RETURN_CHANNELS: dict[str, socket.socket] = {}


def _return_channel(folder_name: str) -> socket.socket | None:
    channel = _RETURN_CHANNELS.get(folder_name)
    if channel is None:
        channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        channel.settimeout(1.0)
        try:
            channel.connect(return_name(folder_name))
        except OSError:
            channel.close()
            raise
        if not same_user(channel):  # another user's process holds the name: not the acceptor
            channel.close()
            return None
        _RETURN_CHANNELS[folder_name] = channel
    return channel


def give_back(folder_name: str, connections: list[int], message: GiveBack | Splice) -> bool:
    """Give connections (descriptors of this process, not closed here) back to the acceptor of the
    front whose folder is named ``folder_name``, with ``message`` (a :class:`Splice` with the
    client's connection and HAProxy's)."""
    data = message.encode()
    if not connections:
        return True
    sent = 0
    for attempt in range(2):  # a kept channel may have closed (the front restarted)
        try:
            channel = _return_channel(folder_name)
            if channel is None:
                return False
            while sent < len(connections):
                socket.send_fds(channel, [data], connections[sent:sent + 16])
                sent += 16
            return True
        except OSError:
            stale = _RETURN_CHANNELS.pop(folder_name, None)
            if stale is not None:
                stale.close()
            if attempt or stale is None:
                return False
    return False


# (the client's connection, what the acceptor said with it)
TakeConnection = Callable[[socket.socket, HandOff], None]


class ReplicaHandoff:
    """Takes the connections the acceptor passes to ``name`` (:func:`handoff_name`) and hands
    each to ``take`` on the running event loop."""

    def __init__(self, name: str, take: TakeConnection) -> None:
        self.name = name
        self._take = take
        self._socket: socket.socket | None = None
        self._channels: set[socket.socket] = set()

    def open(self) -> bool:
        listening = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            listening.bind(self.name)
            listening.listen(16)
        except OSError as exc:  # no handoff then: the front relays every request, as without one
            logger.warning("the listener takes no connections from the front's acceptor: %s", exc)
            listening.close()
            return False
        listening.setblocking(False)
        self._socket = listening
        asyncio.get_running_loop().add_reader(listening, self._accept_channel)
        return True

    def stop_accepting(self) -> None:
        """No new channels (the replica stops); those open still deliver."""
        if self._socket is not None:
            asyncio.get_running_loop().remove_reader(self._socket)
            self._socket.close()
            self._socket = None

    def close(self) -> None:
        self.stop_accepting()
        loop = asyncio.get_running_loop()
        for channel in self._channels:
            loop.remove_reader(channel)
            channel.close()
        self._channels.clear()

    def _accept_channel(self) -> None:
        try:
            channel, _ = self._socket.accept()  # type: ignore[union-attr]
        except OSError:
            return
        if not same_user(channel):  # only the server's own acceptor passes connections
            logger.warning("refused a channel to the replica's handoff socket from another user's process")
            channel.close()
            return
        channel.setblocking(False)
        self._channels.add(channel)
        asyncio.get_running_loop().add_reader(channel, self._receive, channel)

    def _receive(self, channel: socket.socket) -> None:
        try:
            message, fds, _, _ = socket.recv_fds(channel, 4096, 4)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            message, fds = b"", []
        if not message and not fds:  # the acceptor closed the channel
            asyncio.get_running_loop().remove_reader(channel)
            self._channels.discard(channel)
            channel.close()
            return
        handoff = HandOff.decode(message)
        for fd in fds:
            self._take(socket.socket(fileno=fd), handoff)
