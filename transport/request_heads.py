"""What the first bytes of a new client connection say, read without consuming them (the front's
acceptor peeks at them, :mod:`acceptor`): the protocol it speaks, the route key of its first
request (an HTTP/1.1 request line, or a gRPC call's headers and the start of its message), the
header fields of an HTTP request head, and whether the head is refused before HAProxy's parser
would answer it with an HTML page. Request lines and heads are parsed by httptools, gRPC calls by
:func:`rayinfer.protocol.grpc_wire.first_call`.
"""

from __future__ import annotations

import contextlib
import re
import socket

import httptools

from rayinfer.protocol.grpc_wire import INCOMPLETE, NOT_DIRECT_RPCS, PREFACE, ROUTED_RPCS, STREAM_RPC, first_call
from rayinfer.protocol.limits import HEAD_TOO_LARGE, MAX_REQUEST_HEAD_BYTES, MAX_REQUEST_HEADERS, TOO_MANY_HEADERS, bad_head_answer
from rayinfer.serving.routes import front_routed

# An HTTP/1.x request line, as leniently as HAProxy reads one (a token, a target, the version).
_REQUEST_LINE = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+ +[^ ]+ +HTTP/1\.\d *")


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


def head_fields(head: bytes) -> list[tuple[bytes, bytes]]:
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


def bad_request_head(head: bytes) -> str | None:
    """Why the request head ``head`` starts (the most the acceptor peeks) is refused, or None: a
    request line that is not HTTP/1.x (HAProxy's parser would answer it with an HTML page), a
    line or head longer than the peek, more headers than the limit (:mod:`limits`). A head not
    all arrived yet is judged by what has."""
    if head[:len(PREFACE)] == PREFACE[:len(head)]:  # HTTP/2 with prior knowledge: HAProxy's
        return None
    end = head.find(b"\r\n")
    if end < 0:
        return "request line too long" if len(head) >= MAX_REQUEST_HEAD_BYTES else None
    if _REQUEST_LINE.fullmatch(head[:end]) is None:
        return "malformed request line"
    head_end = head.find(b"\r\n\r\n")
    if head_end < 0 and len(head) >= MAX_REQUEST_HEAD_BYTES:
        return HEAD_TOO_LARGE
    headers = head.count(b"\r\n", 0, head_end if head_end >= 0 else len(head))  # the line ends before it
    if headers > MAX_REQUEST_HEADERS:
        return TOO_MANY_HEADERS
    return None


def refuse(connection: socket.socket, reason: str) -> None:
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


def protocol_of(head: bytes) -> str:
    """The protocol of a connection given back (it has no port of its own), by its first bytes."""
    return "grpc" if head and head[:len(PREFACE)] == PREFACE[:len(head)] else "http"
