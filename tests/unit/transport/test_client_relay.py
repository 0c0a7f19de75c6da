"""gRPC calls a replica relays to the front as HTTP/1.1 (transport/client_relay.py: relay_grpc):
one after another on one kept connection; a kept connection that closes before it answers is
replaced (the call is sent again on a new one); one that closes mid-answer fails the call with
UNAVAILABLE, never sent twice. An asyncio Unix-socket server stands in for HAProxy's relay socket,
its requests read by httptools."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import httptools

from rayinfer.transport import client_relay

_ANSWER = (b"HTTP/1.1 200 OK\r\ncontent-type: application/grpc\r\ntransfer-encoding: chunked\r\n\r\n"
           b"5\r\nhello\r\n0\r\ngrpc-status: 0\r\n\r\n")


class _Upstream(asyncio.Protocol):
    """A connection to the stand-in: answers each whole request, or as ``behaviour`` says for
    the request numbered ``at`` (counted over all connections)."""

    def __init__(self, server: "_Server") -> None:
        self._server = server
        self._parser = httptools.HttpRequestParser(self)
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self._server.connections += 1

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_message_complete(self) -> None:
        server = self._server
        server.requests += 1
        if server.requests == server.at and server.behaviour == "close":
            self.transport.close()
        elif server.requests == server.at and server.behaviour == "half":
            self.transport.write(_ANSWER[:70])
            self.transport.close()
        else:
            self.transport.write(_ANSWER)


class _Server:
    def __init__(self, behaviour: str = "", at: int = 0) -> None:
        self.behaviour, self.at = behaviour, at
        self.connections = self.requests = 0


async def _calls(behaviour: str, at: int, count: int) -> tuple[list, _Server]:
    server = _Server(behaviour, at)
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "relay.sock")
        listening = await asyncio.get_running_loop().create_unix_server(lambda: _Upstream(server), path)
        try:
            answers = [await client_relay.relay_grpc(path, b"/inference.GRPCInferenceService/ModelInfer",
                                                     [(b":authority", b"x"), (b"content-type", b"application/grpc")],
                                                     b"\0\0\0\0\0") for _ in range(count)]
        finally:
            listening.close()
            for upstream in client_relay._IDLE.pop(path, []):
                upstream.transport.close()
    return answers, server


def test_calls_go_one_after_another_on_one_kept_connection():
    answers, server = asyncio.run(_calls("", 0, 5))
    assert answers == [(b"hello", [(b"grpc-status", b"0")])] * 5
    assert (server.connections, server.requests) == (1, 5)


def test_a_kept_connection_that_closes_before_answering_is_replaced():
    answers, server = asyncio.run(_calls("close", 3, 5))
    assert answers == [(b"hello", [(b"grpc-status", b"0")])] * 5
    # The stand-in closed the kept connection at the third call with no byte of answer (HAProxy
    # does so only with a connection it closes before reading the call): sent again on a new one.
    assert (server.connections, server.requests) == (2, 6)


def test_a_connection_that_closes_mid_answer_fails_the_call_once():
    answers, server = asyncio.run(_calls("half", 2, 3))
    assert answers[0] == answers[2] == (b"hello", [(b"grpc-status", b"0")])
    assert answers[1][1][0] == (b"grpc-status", b"14")
    assert (server.connections, server.requests) == (2, 3)


class _Recorder(asyncio.Protocol):
    """Records the bytes of the requests relayed to it and answers each one."""

    def __init__(self, received: bytearray) -> None:
        self._received = received
        self._parser = httptools.HttpRequestParser(self)
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._received += data
        self._parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.transport.write(_ANSWER)


def test_no_client_byte_becomes_framing_on_the_relay_connection():
    """A relayed call's fields: hop-by-hop names dropped whatever their case, the server's own
    headers dropped, and a field holding CR, LF or NUL (or a name that is no token) not copied,
    so that nothing a client sends can start a header or a request of its own on a connection
    that other clients' calls share."""
    received = bytearray()

    async def relay() -> None:
        with tempfile.TemporaryDirectory() as folder:
            path = str(Path(folder) / "relay.sock")
            listening = await asyncio.get_running_loop().create_unix_server(lambda: _Recorder(received), path)
            try:
                headers = [(b":authority", b"x"), (b"content-type", b"application/grpc"),
                           (b"x-note", b"a\r\nx-injected: 1\r\n\r\nPOST /smuggled HTTP/1.1"), (b"x-nul", b"a\0b"),
                           (b"Connection", b"close"), (b"TE", b"trailers"), (b"Transfer-Encoding", b"chunked"),
                           (b"x-rayinfer-stream", b"1"), (b"rayinfer-sequence-forwarded", b"1"),
                           (b"Rayinfer-Front-Key", b"guessed"),
                           (b"bad name", b"1"), (b"x-kept", b"yes")]
                data, fields = await client_relay.relay_grpc(path, b"/inference.GRPCInferenceService/ServerLive",
                                                             headers, b"\0\0\0\0\0")
                assert (data, fields[0]) == (b"hello", (b"grpc-status", b"0"))
            finally:
                listening.close()

    asyncio.run(relay())
    raw_head = bytes(received).split(b"\r\n\r\n", 1)[0]
    head = raw_head.lower().split(b"\r\n")
    assert head[0] == b"post /inference.grpcinferenceservice/serverlive http/1.1"
    names = [line.split(b":", 1)[0] for line in head[1:]]
    assert sorted(names) == [b"content-length", b"content-type", b"host", b"te", b"x-kept"]
    assert b"smuggled" not in received and b"x-injected" not in received and b"\0" not in raw_head
