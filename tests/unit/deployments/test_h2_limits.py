"""Hostile gRPC (HTTP/2) clients on connections the front's acceptor gives a replica: each abuse is
sent on one raw connection while tritonclient.grpc, on a connection of its own, is answered
within 2 s; the abusing connection is closed with RFC 9113's error, and what the replica holds
stays within the limits (:class:`~rayinfer.protocol.limits.ConnectionLimits`). A real supervisor,
acceptor and HAProxy; the listeners of tests/front_stand_ins.py as replicas."""

from __future__ import annotations

import contextlib
import socket
import time
from dataclasses import replace

import hpack
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hyperframe.frame import Frame
from tritonclient.grpc import service_pb2 as pb

from front_stand_ins import TEST_FRONT_KEY, Replica, free_port, infer, publish
from rayinfer.transport.replica_routes import ReplicaRoutes
from rayinfer.deployments.front import Front
from rayinfer.protocol.grpc_wire import (
    CONTINUATION, DATA, END_HEADERS, END_STREAM, ENHANCE_YOUR_CALM, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, GOAWAY, HEADERS, PING,
    PREFACE, PROTOCOL_ERROR, REFUSED_STREAM, RST_STREAM, SETTINGS_MAX_FRAME_SIZE, WINDOW_UPDATE, frame, settings,
)
from rayinfer.protocol.limits import DEFAULT_CONNECTION_LIMITS
from waiting import wait_until

_INFER = "/inference.GRPCInferenceService/ModelInfer"


@pytest.fixture(scope="module")
def acceptor(loop):
    port = free_port()
    front = Front(None, ("127.0.0.1", port, "127.0.0.1", free_port()), "v2", direct=True, front_key=TEST_FRONT_KEY)
    replica = Replica(loop, "one")
    replica.listener.routes = ReplicaRoutes("m", "1")
    publish(loop, front, {"m/": [("127.0.0.1", replica.port)]})
    yield replica, port
    front.stop()


@pytest.fixture
def replica(acceptor):
    replica, _ = acceptor
    yield replica
    replica.listener.limits = DEFAULT_CONNECTION_LIMITS


def _block(encoder: hpack.Encoder, path: str = _INFER) -> bytes:
    return encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "x"),
                           ("content-type", "application/grpc"), ("te", "trailers")])


def _message(size: int = 0) -> bytes:
    request = pb.ModelInferRequest(model_name="m", id="hostile")
    if size:
        request.raw_input_contents.append(b"\1" * size)
    body = request.SerializeToString()
    return b"\0" + len(body).to_bytes(4, "big") + body


def _connect(port: int, first: bytes = settings({})) -> tuple[socket.socket, hpack.Encoder]:
    """A raw client connection whose first call (a ModelInfer for "m") takes it to the replica;
    ``first``: what it sends before that call (its SETTINGS)."""
    encoder = hpack.Encoder()
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    client.sendall(PREFACE + first + frame(HEADERS, END_HEADERS, 1, _block(encoder)) + frame(DATA, END_STREAM, 1, _message()))
    return client, encoder


def _frames_until_closed(client: socket.socket, timeout_s: float = 10.0) -> list:
    """The frames the server sends until it closes the connection (fails after ``timeout_s``)."""
    data, deadline = b"", time.monotonic() + timeout_s
    while True:
        client.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            chunk = client.recv(1 << 16)
        except TimeoutError:
            raise AssertionError("the server did not close the connection") from None
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            break
        data += chunk
    frames, at, view = [], 0, memoryview(data)
    while at + 9 <= len(data):
        parsed, length = Frame.parse_frame_header(view[at:at + 9])
        parsed.parse_body(view[at + 9:at + 9 + length])
        frames.append(parsed)
        at += 9 + length
    client.close()
    return frames


def _first_answer(client: socket.socket) -> None:
    """Read until the first call (stream 1) is answered."""
    data = b""
    while True:
        data += client.recv(1 << 16)
        at, view = 0, memoryview(data)
        while at + 9 <= len(data) and at + 9 + int.from_bytes(data[at:at + 3], "big") <= len(data):
            parsed, length = Frame.parse_frame_header(view[at:at + 9])
            parsed.parse_body(view[at + 9:at + 9 + length])
            if parsed.type == HEADERS and parsed.stream_id == 1 and "END_STREAM" in parsed.flags:
                return
            at += 9 + length


def _goaway_code(frames: list) -> int | None:
    return next((f.error_code for f in frames if f.type == GOAWAY and f.error_code), None)


def _others_are_answered(port: int) -> None:
    """A well-behaved client on its own connection is answered within 2 s."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        started = time.monotonic()
        response = infer(client, "m", np.ones((1, 4), dtype=np.float32), request_id="polite")
        assert (response.model_name, response.id) == ("one", "polite")
        assert time.monotonic() - started < 2.0
    finally:
        client.close()


def test_an_illegal_max_frame_size_closes_that_connection_only(acceptor):
    """The 40 bytes that hung a replica: SETTINGS_MAX_FRAME_SIZE = 0, then a call."""
    replica, port = acceptor
    client, _ = _connect(port, settings({SETTINGS_MAX_FRAME_SIZE: 0}))
    assert _goaway_code(_frames_until_closed(client)) == PROTOCOL_ERROR
    _others_are_answered(port)
    assert replica.listener.held_bytes == 0


def test_a_frame_over_the_max_frame_size_closes_the_connection(acceptor):
    replica, port = acceptor
    client, _ = _connect(port)
    client.sendall((20_000).to_bytes(3, "big") + bytes((DATA, 0)) + (3).to_bytes(4, "big") + b"\0" * 20_000)
    assert _goaway_code(_frames_until_closed(client)) == FRAME_SIZE_ERROR
    _others_are_answered(port)


def _continuations(block: bytes):
    yield frame(HEADERS, 0, 3, block)  # a header block that never ends
    for _ in range(10_000):
        yield frame(CONTINUATION, 0, 3, b"\x40\x01a\x01b" * 200)


def _rapid_resets(block: bytes):
    for stream in range(3, 20_000, 2):
        yield frame(HEADERS, END_HEADERS, stream, block) + frame(RST_STREAM, 0, stream, b"\0\0\0\x08")


def _pings(block: bytes):
    for _ in range(20_000):
        yield frame(PING, 0, 0, b"12345678")


@pytest.mark.parametrize(("flood", "limits"), [
    (_continuations, {}),  # bounded by --grpc-max-header-list-size
    (_rapid_resets, {"max_reset_streams": 50}),
    (_pings, {"max_control_frames": 100}),
], ids=["continuation", "rapid-reset", "ping"])
def test_a_flood_is_cut_off_with_enhance_your_calm(acceptor, replica, flood, limits):
    _, port = acceptor
    replica.listener.limits = replace(DEFAULT_CONNECTION_LIMITS, **limits)
    client, encoder = _connect(port)
    with contextlib.suppress(OSError):  # the server closes while it is sent
        for frames in flood(_block(encoder)):
            client.sendall(frames)
    assert _goaway_code(_frames_until_closed(client)) == ENHANCE_YOUR_CALM
    _others_are_answered(port)


def test_streams_past_max_concurrent_streams_are_refused(acceptor, replica):
    _, port = acceptor
    replica.listener.limits = replace(DEFAULT_CONNECTION_LIMITS, max_concurrent_streams=5)
    client, encoder = _connect(port)
    _first_answer(client)
    block = _block(encoder)
    # Seven calls that never end: the last two find five open.
    client.sendall(b"".join(frame(HEADERS, END_HEADERS, stream, block) for stream in range(3, 17, 2)))
    refused: list[int] = []
    data = b""
    deadline = time.monotonic() + 10
    while len(refused) < 2 and time.monotonic() < deadline:
        client.settimeout(1)
        data += client.recv(1 << 16)
        at, view, refused = 0, memoryview(data), []
        while at + 9 <= len(data) and at + 9 + int.from_bytes(data[at:at + 3], "big") <= len(data):
            parsed, length = Frame.parse_frame_header(view[at:at + 9])
            parsed.parse_body(view[at + 9:at + 9 + length])
            if parsed.type == RST_STREAM and parsed.error_code == REFUSED_STREAM:
                refused.append(parsed.stream_id)
            at += 9 + length
    assert refused == [13, 15]
    client.close()
    _others_are_answered(port)


def test_a_header_block_that_does_not_end_times_out(acceptor, replica):
    _, port = acceptor
    replica.listener.limits = replace(DEFAULT_CONNECTION_LIMITS, request_head_timeout_s=0.5)
    client, encoder = _connect(port)
    client.sendall(frame(HEADERS, 0, 3, _block(encoder)))  # no END_HEADERS, no CONTINUATION
    started = time.monotonic()
    assert _goaway_code(_frames_until_closed(client)) == ENHANCE_YOUR_CALM
    assert time.monotonic() - started < 3.0
    _others_are_answered(port)


def test_an_idle_connection_is_closed_gracefully(acceptor, replica):
    _, port = acceptor
    replica.listener.limits = replace(DEFAULT_CONNECTION_LIMITS, keepalive_timeout_s=0.5)
    client, _ = _connect(port)  # it answers nothing (not the PING either): the close ends without it
    frames = _frames_until_closed(client)
    assert any(f.type == GOAWAY for f in frames) and _goaway_code(frames) is None


def test_a_call_whose_client_goes_silent_is_dropped(acceptor, replica):
    """A half-open call (its message never ends, the client sends nothing more)."""
    _, port = acceptor
    replica.listener.limits = replace(DEFAULT_CONNECTION_LIMITS, keepalive_timeout_s=0.5)
    client, encoder = _connect(port)
    client.sendall(frame(HEADERS, END_HEADERS, 3, _block(encoder)) + frame(DATA, 0, 3, _message(1000)[:500]))
    assert _goaway_code(_frames_until_closed(client)) == ENHANCE_YOUR_CALM
    wait_until(lambda: replica.listener.held_bytes == 0, "the call's bytes released", 5)
    _others_are_answered(port)


_LARGE_WINDOWS = settings({0x4: (1 << 31) - 1}) + frame(WINDOW_UPDATE, 0, 0, ((1 << 31) - 1 - 65_535).to_bytes(4, "big"))


class _WindowedSender:
    """A raw client's DATA sent within the server's flow-control windows, as a client must: it
    reads the server's WINDOW_UPDATEs (and records them by stream) whenever a window is spent."""

    def __init__(self, client: socket.socket, stream_window: int) -> None:
        self.client = client
        self.connection_window = 65_535
        self.stream_windows: dict[int, int] = {}
        self.initial = stream_window
        self.granted: dict[int, int] = {}
        self._data = b""

    def send(self, stream: int, data: bytes, end: bool = False) -> None:
        for at in range(0, len(data), 16_384):
            chunk = data[at:at + 16_384]
            while min(self.connection_window, self.stream_windows.setdefault(stream, self.initial)) < len(chunk):
                self.read(5.0)
            last = end and at + 16_384 >= len(data)
            self.client.sendall(frame(DATA, END_STREAM if last else 0, stream, chunk))
            self.connection_window -= len(chunk)
            self.stream_windows[stream] -= len(chunk)

    def read(self, timeout_s: float) -> bool:
        """Read what the server sent within ``timeout_s``; False if nothing came."""
        self.client.settimeout(timeout_s)
        try:
            chunk = self.client.recv(1 << 16)
        except TimeoutError:
            return False
        self._data += chunk
        at, view = 0, memoryview(self._data)
        while at + 9 <= len(self._data) and at + 9 + int.from_bytes(self._data[at:at + 3], "big") <= len(self._data):
            parsed, length = Frame.parse_frame_header(view[at:at + 9])
            parsed.parse_body(view[at + 9:at + 9 + length])
            if parsed.type == WINDOW_UPDATE and not parsed.stream_id:
                self.connection_window += parsed.window_increment
            elif parsed.type == WINDOW_UPDATE:
                self.stream_windows[parsed.stream_id] = self.stream_windows.get(parsed.stream_id, self.initial) \
                    + parsed.window_increment
                self.granted[parsed.stream_id] = self.granted.get(parsed.stream_id, 0) + parsed.window_increment
            at += 9 + length
        self._data = self._data[at:]
        return bool(chunk)


def test_calls_that_do_not_end_hold_at_most_their_windows(acceptor, replica):
    """Past the connection's window, only the oldest call gets more window: the others stop at
    their stream window, and what the replica holds stays bounded."""
    _, port = acceptor
    stream_window, connection_window = 1 << 16, 1 << 18
    replica.listener.limits = replace(DEFAULT_CONNECTION_LIMITS, stream_window_bytes=stream_window,
                                      connection_window_bytes=connection_window)
    # The client takes answers without limit: the oldest call's answer must not wait for it.
    client, encoder = _connect(port, _LARGE_WINDOWS)
    sender = _WindowedSender(client, stream_window)
    block = _block(encoder)
    message = _message(8 * stream_window)  # a message larger than a stream's window
    streams = list(range(3, 3 + 2 * 20, 2))
    for stream in streams:  # each sends its first window, without ending
        client.sendall(frame(HEADERS, END_HEADERS, stream, block))
        sender.send(stream, message[:stream_window])
    bound = connection_window + len(streams) * stream_window
    wait_until(lambda: replica.listener.held_bytes >= len(streams) * stream_window, "the calls' bytes held", 5)
    while sender.read(0.5):
        continue
    # Held past the connection's window: the calls after it got no more window; the oldest did.
    assert sender.granted.get(streams[0])
    assert not any(sender.granted.get(stream) for stream in streams[-10:])
    assert replica.listener.held_bytes <= bound
    # The oldest call ends: it is answered, and its bytes are released.
    sender.send(streams[0], message[stream_window:], end=True)
    wait_until(lambda: replica.listener.held_bytes <= bound - stream_window, "the oldest call's bytes released", 5)
    client.close()
    wait_until(lambda: replica.listener.held_bytes == 0, "every call's bytes released", 5)
    _others_are_answered(port)


def test_data_past_a_held_back_window_closes_the_connection(acceptor, replica):
    """A call held back (the connection holds more than its window) that sends past its stream
    window anyway: FLOW_CONTROL_ERROR, the connection closed and its bytes released."""
    _, port = acceptor
    stream_window = 1 << 16
    replica.listener.limits = replace(DEFAULT_CONNECTION_LIMITS, stream_window_bytes=stream_window,
                                      connection_window_bytes=2 * stream_window)
    client, encoder = _connect(port, _LARGE_WINDOWS)
    sender = _WindowedSender(client, stream_window)
    block = _block(encoder)
    for stream in (3, 5, 7):  # 3 is the oldest; by 7's second half the connection holds over its window
        client.sendall(frame(HEADERS, END_HEADERS, stream, block))
        sender.send(stream, b"\0" * stream_window)
    while sender.read(0.5):
        continue
    assert not sender.granted.get(7)
    with contextlib.suppress(OSError):  # the server closes while it is sent
        client.sendall(frame(DATA, 0, 7, b"\0" * 16_384))
    assert _goaway_code(_frames_until_closed(client)) == FLOW_CONTROL_ERROR
    wait_until(lambda: replica.listener.held_bytes == 0, "the calls' bytes released", 5)
    _others_are_answered(port)


def test_a_client_that_does_not_read_its_answers_is_cut_off(acceptor, replica):
    _, port = acceptor
    replica.listener.limits = replace(DEFAULT_CONNECTION_LIMITS, send_timeout_s=0.5, connection_buffer_bytes=1 << 16)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 12)
    client.connect(("127.0.0.1", port))
    encoder = hpack.Encoder()
    big = _message(1 << 20)
    # A window large enough for every answer, then calls with large answers it never reads.
    client.sendall(PREFACE + settings({0x4: (1 << 31) - 1}) + frame(WINDOW_UPDATE, 0, 0, ((1 << 31) - 1 - 65_535).to_bytes(4, "big")))
    with contextlib.suppress(OSError):  # the server closes while it is sent
        for stream in range(1, 401, 2):
            client.sendall(frame(HEADERS, END_HEADERS, stream, _block(encoder))
                           + b"".join(frame(DATA, END_STREAM if at + 16_384 >= len(big) else 0, stream, big[at:at + 16_384])
                                      for at in range(0, len(big), 16_384)))
    client.close()
    wait_until(lambda: replica.listener.held_bytes == 0, "the calls' bytes released", 10)
    _others_are_answered(port)


def test_a_stream_message_over_the_limit_ends_that_stream_only(acceptor, replica):
    """A stream's message whose length prefix says 4 GiB (past gRPC's maximum message): that
    stream ends with RESOURCE_EXHAUSTED and is reset, nothing of it is kept, and the connection
    goes on serving. A stream that ends within a message ends with INTERNAL."""
    _, port = acceptor
    client, encoder = _connect(port)
    client.sendall(frame(HEADERS, END_HEADERS, 3, _block(encoder, "/inference.GRPCInferenceService/ModelStreamInfer"))
                   + frame(DATA, 0, 3, b"\0\xff\xff\xff\xff" + b"\1" * 1000)
                   + frame(HEADERS, END_HEADERS, 5, _block(encoder)) + frame(DATA, END_STREAM, 5, _message())
                   + frame(HEADERS, END_HEADERS, 7, _block(encoder, "/inference.GRPCInferenceService/ModelStreamInfer"))
                   + frame(DATA, END_STREAM, 7, b"\0\0\0\0\x10abc"))
    decoder, data, at, ended, status = hpack.Decoder(), b"", 0, set(), {}
    client.settimeout(10)
    while not {3, 5, 7} <= ended:
        chunk = client.recv(1 << 16)
        assert chunk, "the server closed the connection"
        data += chunk
        view = memoryview(data)
        while at + 9 <= len(data) and at + 9 + int.from_bytes(data[at:at + 3], "big") <= len(data):
            parsed, length = Frame.parse_frame_header(view[at:at + 9])
            parsed.parse_body(view[at + 9:at + 9 + length])
            at += 9 + length
            if parsed.type == HEADERS:
                fields = dict(decoder.decode(parsed.data))
                status[parsed.stream_id] = fields.get("grpc-status", status.get(parsed.stream_id))
                if "END_STREAM" in parsed.flags:
                    ended.add(parsed.stream_id)
    assert status == {1: "0", 3: "8", 5: "0", 7: "13"}
    client.close()
    wait_until(lambda: replica.listener.held_bytes == 0, "the stream's bytes released", 5)
    _others_are_answered(port)
