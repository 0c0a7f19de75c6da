"""A model replica's end of the front's acceptor (:mod:`acceptor`): the abstract Unix socket, named
after the replica's listener, over which the acceptor passes clients' HTTP connections. Only a
process of the server's own user may open a channel to it (``SO_PEERCRED``).

The acceptor keeps one channel open to each replica it passes connections to; each message carries
one connection (``SCM_RIGHTS``) and says which socket of the front's HAProxy takes the requests
the replica does not answer, and the route key the acceptor gave it for.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from rayinfer.deployments.acceptor import same_user

logger = logging.getLogger(__name__)

# (the client's connection, HAProxy's Unix socket for relayed requests, the route key)
TakeConnection = Callable[[socket.socket, str, str], None]


class ReplicaHandoff:
    """Takes the connections the acceptor passes to ``name`` (:func:`acceptor.handoff_name`) and hands
    each to ``take`` on the running event loop."""

    def __init__(self, name: str, take: TakeConnection) -> None:
        self.name = name
        self._take = take
        self._socket: socket.socket | None = None
        self._channels: set[socket.socket] = set()

    def open(self) -> bool:
        acceptor = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            acceptor.bind(self.name)
            acceptor.listen(16)
        except OSError as exc:  # no acceptor then: the front relays every request, as without one
            logger.warning("the listener takes no connections from the front's acceptor: %s", exc)
            acceptor.close()
            return False
        acceptor.setblocking(False)
        self._socket = acceptor
        asyncio.get_running_loop().add_reader(acceptor, self._accept_channel)
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
        relay, _, key = message.decode("utf-8", "replace").partition("\n")
        for fd in fds:
            self._take(socket.socket(fileno=fd), relay, key)
