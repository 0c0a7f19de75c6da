"""The acceptor's abstract Unix sockets take channels only from the server's own user
(``SO_PEERCRED``): a process of another user can neither pass a replica connections nor give
the acceptor connections back. The other user's process is real (``subprocess`` with ``user=``)."""

from __future__ import annotations

import asyncio
import os
import socket
import signal
import uuid
from pathlib import Path

import pytest

from rayinfer.transport.acceptor import Acceptor
from rayinfer.transport.handoff import ReplicaHandoff, give_back, return_name, same_user
from rayinfer.transport.handoff_messages import GiveBack, HandOff
from waiting import wait_until

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to start a process as another user")

_NOBODY = 65534


def _as_nobody(action) -> int:
    """Fork a child that runs ``action()`` as user nobody; the child's pid. Its exit status
    (:func:`_outcome`) is 0 when ``action`` returned True."""
    pid = os.fork()
    if pid == 0:  # the child: no exec, so no interpreter file the other user must be able to read
        code = 1
        try:
            os.setgid(_NOBODY)
            os.setuid(_NOBODY)
            code = 0 if action() else 1
        finally:
            os._exit(code)
    return pid


def _outcome(pid: int, serve=None) -> bool:
    """Whether the child ``pid`` succeeded; ``serve()`` runs until it has exited."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG if serve is not None else 0)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        serve()


def _pass_a_connection(name: str, message: bytes):
    """Connect to the abstract socket ``name``, pass one descriptor, True if the other end then
    closed the channel."""
    def action() -> bool:
        channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        channel.connect(name)
        mine, _ = socket.socketpair()
        try:
            socket.send_fds(channel, [message], [mine.fileno()])
            channel.settimeout(5)
            return channel.recv(16) == b""
        except OSError:
            return True
    return action


def test_peer_credentials_name_the_user():
    one, two = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with one, two:
        assert same_user(one) and same_user(two)


def test_another_users_process_cannot_pass_connections_to_a_replica(loop):
    taken: list[str] = []
    handoff = ReplicaHandoff(f"\0rayinfer-test-{uuid.uuid4().hex}", lambda client, given: taken.append(given.route_key))

    async def open_handoff() -> bool:
        return handoff.open()

    assert asyncio.run_coroutine_threadsafe(open_handoff(), loop).result(5)
    try:
        assert _outcome(_as_nobody(_pass_a_connection(handoff.name, HandOff("/relay", "m/").encode())))
        assert taken == []
        # The server's own user (the front's acceptor) still can.
        channel = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        channel.connect(handoff.name)
        mine, theirs = socket.socketpair()
        with channel, mine, theirs:
            socket.send_fds(channel, [HandOff("/relay", "m/").encode()], [mine.fileno()])
            wait_until(lambda: taken == ["m/"], "the connection taken", 5)
    finally:
        async def close_handoff() -> None:
            handoff.close()

        asyncio.run_coroutine_threadsafe(close_handoff(), loop).result(5)


def test_another_users_process_cannot_give_the_acceptor_connections(tmp_path: Path):
    folder = tmp_path / f"front-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    acceptor = Acceptor({}, {}, folder)
    try:
        # The acceptor accepts the channel, checks its peer and closes it.
        child = _as_nobody(_pass_a_connection(return_name(folder.name), GiveBack("x", False).encode()))
        assert _outcome(child, lambda: acceptor.serve(0.1))
        client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        client.connect(return_name(folder.name))
        acceptor.serve(0.2)
        with client:  # a channel of the server's own user stays open
            client.setblocking(False)
            with pytest.raises(BlockingIOError):
                client.recv(16)
        # give_back does not hand connections to a name another user holds.
        squatter_name = f"{folder.name}-squatted"
        ready_read, ready_write = os.pipe()

        def squat() -> bool:
            squatter = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            squatter.bind(return_name(squatter_name))
            squatter.listen(1)
            os.write(ready_write, b"r")
            signal.pause()  # holds the name until the test kills it
            return True

        child = _as_nobody(squat)
        try:
            assert os.read(ready_read, 1) == b"r"
            mine, _ = socket.socketpair()
            with mine:
                assert not give_back(squatter_name, [mine.fileno()], GiveBack("x", False))
        finally:
            os.kill(child, 9)
            os.waitpid(child, 0)
            os.close(ready_read)
            os.close(ready_write)
    finally:
        acceptor.close()
