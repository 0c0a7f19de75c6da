"""What a hostile gRPC client may send on a connection the front's acceptor gives a replica, beyond
test_h2_limits.py: malformed header fields, messages over --grpc-max-message-size (compressed
ones too), unbudgeted WINDOW_UPDATE and HEADERS frames, a connection kept open with PINGs, an
idle stream, streams past --max-inflight-requests and a stream whose client does not read. Each
abuse runs on one raw connection while tritonclient.grpc is answered on a connection of its own.
A real supervisor, acceptor and HAProxy; the listeners of tests/front_stand_ins.py as replicas."""

from __future__ import annotations

import contextlib
import gzip
import socket
import time
from dataclasses import replace

import hpack
import pytest
from hyperframe.frame import Frame

from rayinfer.protocol.grpc_wire import (
    DATA, END_HEADERS, END_STREAM, ENHANCE_YOUR_CALM, HEADERS, PING, PRIORITY, PROTOCOL_ERROR, RST_STREAM, STREAM_CLOSED,
    WINDOW_UPDATE, frame, settings,
)
from rayinfer.protocol.limits import DEFAULT_CONNECTION_LIMITS
from test_h2_limits import (  # the same front, raw client and checks
    _block, _connect, _first_answer, _frames_until_closed, _goaway_code, _message, _others_are_answered, acceptor,
    replica,
)
from waiting import wait_until

__all__ = ["acceptor", "replica"]  # fixtures
_SERVICE = "/inference.GRPCInferenceService/"
_STREAM = _SERVICE + "ModelStreamInfer"


class _Reader:
    """The server's frames on a raw connection, with each stream's decoded header fields."""

    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.decoder = hpack.Decoder()
        self.data = b""
        self.resets: dict[int, int] = {}
        self.status: dict[int, str] = {}
        self.ended: set[int] = set()
        self.frames: list = []
        self.closed = False

    def until(self, done, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done(self):
            left = deadline - time.monotonic()
            assert left > 0 and not self.closed, f"not done: resets {self.resets}, status {self.status}"
            self.client.settimeout(left)
            try:
                chunk = self.client.recv(1 << 16)
            except TimeoutError:
                continue
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                self.closed = True
                return
            self._parse(chunk)

    def _parse(self, chunk: bytes) -> None:
        self.data += chunk
        at, view = 0, memoryview(self.data)
        while at + 9 <= len(self.data) and at + 9 + int.from_bytes(self.data[at:at + 3], "big") <= len(self.data):
            parsed, length = Frame.parse_frame_header(view[at:at + 9])
            parsed.parse_body(view[at + 9:at + 9 + length])
            at += 9 + length
            self.frames.append(parsed)
            if parsed.type == RST_STREAM:
                self.resets[parsed.stream_id] = parsed.error_code
            elif parsed.type == HEADERS:
                fields = dict(self.decoder.decode(parsed.data))
                if "grpc-status" in fields:
                    self.status[parsed.stream_id] = fields["grpc-status"]
                if "END_STREAM" in parsed.flags:
                    self.ended.add(parsed.stream_id)
        self.data = self.data[at:]


_GOOD = [(":method", "POST"), (":scheme", "http"), (":path", _SERVICE + "ServerLive"), (":authority", "x"),
         ("content-type", "application/grpc"), ("te", "trailers")]


@pytest.mark.parametrize("fields", [
    _GOOD + [("x-note", "a\r\nx-injected: 1")],  # CR LF: a header of its own once relayed as HTTP/1.1
    _GOOD + [("x-note", "a\0b")],
    _GOOD + [("X-Upper", "1")],
    _GOOD + [("x-note", " padded")],
    _GOOD + [("connection", "keep-alive")],
    _GOOD + [("te", "gzip")],
    [(":method", "POST"), (":scheme", "http"), (":path", _SERVICE + "ServerLive"), (":protocol", "x")],
    [(":method", "POST"), ("content-type", "application/grpc"), (":scheme", "http"), (":path", _SERVICE + "ServerLive")],
    [(":method", "POST"), (":scheme", "http")],  # no :path
], ids=["crlf", "nul", "upper-case", "white-space", "connection", "te", "unknown-pseudo", "pseudo-after", "no-path"])
def test_a_malformed_request_is_reset_and_nothing_is_relayed(acceptor, replica, fields):
    """RFC 9113 section 8.1.1: a malformed request's stream is reset with PROTOCOL_ERROR before
    anything reads or relays it; the connection and its other calls go on."""
    _, port = acceptor
    client, encoder = _connect(port)
    reader = _Reader(client)
    reader.until(lambda r: 1 in r.ended)
    client.sendall(frame(HEADERS, END_HEADERS | END_STREAM, 3, encoder.encode(fields))
                   + frame(HEADERS, END_HEADERS, 5, _block(encoder)) + frame(DATA, END_STREAM, 5, _message()))
    reader.until(lambda r: 5 in r.ended and 3 in r.resets)
    assert reader.resets[3] == PROTOCOL_ERROR and 3 not in reader.status
    assert reader.status[5] == "0"
    client.close()
    _others_are_answered(port)


def test_trailers_that_do_not_end_the_call_reset_it(acceptor, replica):
    _, port = acceptor
    client, encoder = _connect(port)
    reader = _Reader(client)
    client.sendall(frame(HEADERS, END_HEADERS, 3, _block(encoder))
                   + frame(HEADERS, END_HEADERS, 3, encoder.encode([("x-more", "1")])))
    reader.until(lambda r: 3 in r.resets)
    assert reader.resets[3] == PROTOCOL_ERROR
    client.close()


def _gzip_message(size: int) -> bytes:
    body = gzip.compress(b"\0" * size)
    return b"\1" + len(body).to_bytes(4, "big") + body


@pytest.mark.parametrize("path", ["ModelInfer", "ModelStreamInfer"])
@pytest.mark.parametrize("message", [_message(2 << 20), _gzip_message(8 << 20)], ids=["plain", "gzip-bomb"])
def test_a_message_over_the_limit_ends_its_call(acceptor, replica, path, message):
    """--grpc-max-message-size bounds a message as it arrives, and a compressed one while it is
    inflated: RESOURCE_EXHAUSTED (8) for that call only."""
    _, port = acceptor
    replica.listener.limits = replace(DEFAULT_CONNECTION_LIMITS, max_message_bytes=1 << 20, stream_window_bytes=4 << 20)
    client, encoder = _connect(port, settings({0x4: 1 << 30}))
    reader = _Reader(client)
    reader.until(lambda r: 1 in r.ended)
    block = encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", _SERVICE + path), (":authority", "x"),
                            ("content-type", "application/grpc"), ("te", "trailers"), ("grpc-encoding", "gzip")])
    client.sendall(frame(HEADERS, END_HEADERS, 3, block))
    with contextlib.suppress(OSError):
        for at in range(0, len(message), 16_384):
            last = at + 16_384 >= len(message)
            client.sendall(frame(DATA, END_STREAM if last else 0, 3, message[at:at + 16_384]))
    reader.until(lambda r: 3 in r.ended)
    assert reader.status[3] == "8"
    client.close()
    wait_until(lambda: replica.listener.held_bytes == 0, "the call's bytes released", 5)
    _others_are_answered(port)


@pytest.mark.parametrize("flood", [
    lambda block: frame(WINDOW_UPDATE, 0, 0, (1).to_bytes(4, "big")),
    lambda block: frame(WINDOW_UPDATE, 0, 1, (1).to_bytes(4, "big")),  # a call already answered
], ids=["connection", "closed-stream"])
def test_window_updates_for_nothing_sent_are_control_frames(acceptor, replica, flood):
    _, port = acceptor
    replica.listener.limits = replace(DEFAULT_CONNECTION_LIMITS, max_control_frames=100)
    client, encoder = _connect(port)
    _first_answer(client)
    one = flood(_block(encoder))
    with contextlib.suppress(OSError):
        for _ in range(200):
            client.sendall(one * 50)
    assert _goaway_code(_frames_until_closed(client)) == ENHANCE_YOUR_CALM
    _others_are_answered(port)


def test_pings_do_not_keep_an_idle_connection_open(acceptor, replica):
    """--http-keepalive-timeout counts from the client's last call bytes, not its PINGs."""
    _, port = acceptor
    replica.listener.limits = replace(DEFAULT_CONNECTION_LIMITS, keepalive_timeout_s=0.5)
    client, _ = _connect(port)
    reader = _Reader(client)
    deadline = time.monotonic() + 5
    while not any(f.type == 7 for f in reader.frames) and time.monotonic() < deadline:  # GOAWAY
        client.sendall(frame(PING, 0, 0, b"keepopen"))
        reader.until(lambda r: True, 0.1)
        with contextlib.suppress(AssertionError):
            reader.until(lambda r: False, 0.1)
    assert any(f.type == 7 for f in reader.frames), "no GOAWAY while the client only sent PINGs"
    client.close()


def test_an_idle_stream_ends_with_deadline_exceeded(acceptor, replica):
    _, port = acceptor
    replica.listener.limits = replace(DEFAULT_CONNECTION_LIMITS, stream_idle_timeout_s=0.5)
    client, encoder = _connect(port)
    reader = _Reader(client)
    client.sendall(frame(HEADERS, END_HEADERS, 3, _block(encoder, _STREAM)))
    started = time.monotonic()
    with contextlib.suppress(AssertionError):
        reader.until(lambda r: 3 in r.ended, 5)
    assert reader.status.get(3) == "4", "the idle stream did not end with DEADLINE_EXCEEDED"
    assert time.monotonic() - started < 3
    wait_until(lambda: replica.streams_open == 0, "the stream's handler ended", 5)
    client.close()


def test_open_streams_count_against_max_inflight_requests(acceptor, replica):
    _, port = acceptor
    listener = replica.listener
    before, listener.max_inflight = listener.max_inflight, 2
    try:
        client, encoder = _connect(port)
        reader = _Reader(client)
        reader.until(lambda r: 1 in r.ended)
        client.sendall(b"".join(frame(HEADERS, END_HEADERS, stream, _block(encoder, _STREAM)) for stream in (3, 5, 7)))
        reader.until(lambda r: 7 in r.ended)
        assert reader.status[7] == "14" and 3 not in reader.ended and 5 not in reader.ended
        assert listener.in_flight == 2
        client.close()
        wait_until(lambda: listener.in_flight == 0, "the streams counted out", 5)
    finally:
        listener.max_inflight = before


def test_a_stream_whose_client_does_not_read_holds_one_buffer(acceptor, replica):
    """A stream's answers go out no faster than the connection's write buffer drains
    (--connection-buffer-bytes), whatever windows the client grants; a client that reads none
    of them is disconnected after --client-send-timeout."""
    _, port = acceptor
    buffer = 1 << 18
    replica.listener.limits = replace(DEFAULT_CONNECTION_LIMITS, send_timeout_s=1.0, connection_buffer_bytes=buffer,
                                      stream_window_bytes=8 << 20)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 12)
    client.connect(("127.0.0.1", port))
    encoder = hpack.Encoder()
    client.sendall(PREFACE_AND_LARGE_WINDOWS + frame(HEADERS, END_HEADERS, 1, _block(encoder, _STREAM)))
    request = _message(1 << 19)
    most = 0
    with contextlib.suppress(OSError):
        for _ in range(24):  # 12 MiB of echoed answers
            client.sendall(b"".join(frame(DATA, 0, 1, request[at:at + 16_384]) for at in range(0, len(request), 16_384)))
            most = max(most, _write_buffered(replica))
            time.sleep(0.02)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and replica.listener._connections:
        most = max(most, _write_buffered(replica))
        time.sleep(0.05)
    assert most <= buffer + (1 << 20), f"{most} bytes waited in the replica's write buffer"
    wait_until(lambda: not any(c.direct for c in replica.listener._connections), "the reader cut off", 5)
    client.close()
    _others_are_answered(port)


PREFACE_AND_LARGE_WINDOWS = (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + settings({0x4: (1 << 31) - 1})
                             + frame(WINDOW_UPDATE, 0, 0, ((1 << 31) - 1 - 65_535).to_bytes(4, "big")))


def _write_buffered(replica) -> int:
    sizes = [c._transport.get_write_buffer_size() for c in list(replica.listener._connections)
             if getattr(c, "_transport", None) is not None]
    return max(sizes, default=0)


@pytest.mark.parametrize("frames", [
    frame(DATA, 0, 41, b"x"),  # DATA on a stream never opened
    frame(RST_STREAM, 0, 41, b"\0\0\0\x08"),  # RST_STREAM on a stream never opened
], ids=["data", "rst-stream"])
def test_frames_on_an_idle_stream_close_the_connection(acceptor, replica, frames):
    """RFC 9113 section 5.1: a frame other than HEADERS or PRIORITY on an idle stream is a
    connection error of type PROTOCOL_ERROR."""
    _, port = acceptor
    client, _ = _connect(port)
    _first_answer(client)
    client.sendall(frames)
    assert _goaway_code(_frames_until_closed(client)) == PROTOCOL_ERROR
    _others_are_answered(port)


def test_data_after_the_clients_end_of_stream_resets_that_stream(acceptor, replica):
    """A stream half-closed by its client takes no more DATA (STREAM_CLOSED); its neighbours go on."""
    _, port = acceptor
    client, encoder = _connect(port)
    reader = _Reader(client)
    client.sendall(frame(HEADERS, END_HEADERS | END_STREAM, 3, _block(encoder, _STREAM)) + frame(DATA, 0, 3, b"x")
                   + frame(HEADERS, END_HEADERS, 5, _block(encoder)) + frame(DATA, END_STREAM, 5, _message()))
    reader.until(lambda r: 3 in r.resets and 5 in r.ended)
    assert reader.resets[3] == STREAM_CLOSED and reader.status[5] == "0"
    client.close()


def test_a_stream_that_depends_on_itself_is_reset(acceptor, replica):
    """RFC 9113 section 5.3.1: a PRIORITY frame making a stream depend on itself is a stream error."""
    _, port = acceptor
    client, encoder = _connect(port)
    reader = _Reader(client)
    client.sendall(frame(HEADERS, END_HEADERS, 3, _block(encoder)) + frame(PRIORITY, 0, 3, (3).to_bytes(4, "big") + b"\x10"))
    reader.until(lambda r: 3 in r.resets)
    assert reader.resets[3] == PROTOCOL_ERROR
    client.close()


def test_a_compressed_message_is_refused_before_it_is_inflated_while_the_replica_is_full(acceptor, replica):
    """Past --max-inflight-requests a compressed call is answered UNAVAILABLE without inflating
    it (a message that would inflate past the limit gets UNAVAILABLE, not RESOURCE_EXHAUSTED)."""
    _, port = acceptor
    listener = replica.listener
    before, listener.max_inflight = listener.max_inflight, 0
    listener.limits = replace(DEFAULT_CONNECTION_LIMITS, max_message_bytes=1 << 20)
    try:
        client, encoder = _connect(port)
        reader = _Reader(client)
        block = encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", _SERVICE + "ModelInfer"),
                                (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers"),
                                ("grpc-encoding", "gzip")])
        message = _gzip_message(8 << 20)  # 8 KiB compressed, 8 MiB inflated: past the limit
        client.sendall(frame(HEADERS, END_HEADERS, 3, block)
                       + b"".join(frame(DATA, END_STREAM if at + 16_384 >= len(message) else 0, 3, message[at:at + 16_384])
                                  for at in range(0, len(message), 16_384)))
        reader.until(lambda r: 3 in r.ended)
        assert reader.status[3] == "14"
        client.close()
    finally:
        listener.max_inflight = before
