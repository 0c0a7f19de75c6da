"""Hostile clients against the shared server: one connection misbehaves (illegal HTTP/2
settings, a CONTINUATION flood, rapid resets, pipelined HTTP/1.1 requests it never reads) while
unmodified tritonclients on connections of their own are answered within 2 s over HTTP and gRPC;
the misbehaving connection is closed with RFC 9113's error. The limits' timeouts are covered
with small values in tests/unit/deployments/test_h2_limits.py and test_listener_limits.py."""

from __future__ import annotations

import contextlib
import socket
import time

import hpack
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from hyperframe.frame import Frame
from tritonclient.grpc import service_pb2 as pb

from conftest import GRPC_PORT, HTTP_PORT
from rayinfer.protocol.grpc_wire import (
    CONTINUATION, DATA, END_HEADERS, END_STREAM, ENHANCE_YOUR_CALM, GOAWAY, HEADERS, PREFACE, PROTOCOL_ERROR,
    RST_STREAM, SETTINGS_MAX_FRAME_SIZE, WINDOW_UPDATE, frame, settings,
)

_INPUT = np.arange(16, dtype=np.int32).reshape(1, 16)


def _simple_request() -> bytes:
    request = pb.ModelInferRequest(model_name="simple", id="hostile")
    for name in ("INPUT0", "INPUT1"):
        tensor = request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        del tensor  # the data goes in raw_input_contents
        request.raw_input_contents.append(_INPUT.tobytes())
    body = request.SerializeToString()
    return b"\0" + len(body).to_bytes(4, "big") + body


def _grpc_connection(first: bytes = settings({})) -> tuple[socket.socket, hpack.Encoder]:
    """A raw gRPC connection: ``first`` (its SETTINGS), then one ModelInfer for ``simple``."""
    encoder = hpack.Encoder()
    block = encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", "/inference.GRPCInferenceService/ModelInfer"),
                            (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")])
    client = socket.create_connection(("127.0.0.1", GRPC_PORT), timeout=30)
    client.sendall(PREFACE + first + frame(HEADERS, END_HEADERS, 1, block) + frame(DATA, END_STREAM, 1, _simple_request()))
    return client, encoder


def _goaway_code(client: socket.socket, timeout_s: float = 30.0) -> int | None:
    """The error code of the GOAWAY the server closes ``client`` with (None: no error code)."""
    data, deadline = b"", time.monotonic() + timeout_s
    with client:
        while time.monotonic() < deadline:
            client.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                chunk = client.recv(1 << 16)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
        else:
            raise AssertionError("the server did not close the connection")
    at, view, code = 0, memoryview(data), None
    while at + 9 <= len(data) and at + 9 + int.from_bytes(data[at:at + 3], "big") <= len(data):
        parsed, length = Frame.parse_frame_header(view[at:at + 9])
        parsed.parse_body(view[at + 9:at + 9 + length])
        if parsed.type == GOAWAY and parsed.error_code:
            code = parsed.error_code
        at += 9 + length
    return code


def _others_are_answered() -> None:
    """tritonclient over HTTP and over gRPC, each on a new connection, answered within 2 s."""
    for client, module in ((httpclient.InferenceServerClient(f"127.0.0.1:{HTTP_PORT}"), httpclient),
                           (grpcclient.InferenceServerClient(f"127.0.0.1:{GRPC_PORT}"), grpcclient)):
        inputs = [module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(_INPUT)
        try:
            started = time.monotonic()
            result = client.infer("simple", inputs, client_timeout=2.0) if module is grpcclient else \
                client.infer("simple", inputs, timeout=2)
            assert (result.as_numpy("OUTPUT0") == _INPUT * 2).all()
            assert time.monotonic() - started < 2.0
        finally:
            client.close()


def test_an_illegal_max_frame_size_closes_that_connection_and_others_are_served(server):
    """SETTINGS_MAX_FRAME_SIZE = 0 (RFC 9113 allows 16,384 to 2^24-1), then a call."""
    client, _ = _grpc_connection(settings({SETTINGS_MAX_FRAME_SIZE: 0}))
    assert _goaway_code(client) == PROTOCOL_ERROR
    _others_are_answered()


def test_a_continuation_flood_closes_that_connection_and_others_are_served(server):
    client, encoder = _grpc_connection()
    block = encoder.encode([(":method", "POST"), (":path", "/inference.GRPCInferenceService/ModelInfer")])
    with contextlib.suppress(OSError):  # the server closes while the flood is sent
        client.sendall(frame(HEADERS, 0, 3, block))
        for _ in range(5_000):
            client.sendall(frame(CONTINUATION, 0, 3, b"\x40\x01a\x01b" * 200))
    assert _goaway_code(client) == ENHANCE_YOUR_CALM
    _others_are_answered()


def test_rapid_resets_close_that_connection_and_others_are_served(server):
    client, encoder = _grpc_connection()
    block = encoder.encode([(":method", "POST"), (":scheme", "http"), (":authority", "x"),
                            (":path", "/inference.GRPCInferenceService/ModelInfer"), ("content-type", "application/grpc")])
    with contextlib.suppress(OSError):
        for stream in range(3, 4_001, 2):
            client.sendall(frame(HEADERS, END_HEADERS, stream, block) + frame(RST_STREAM, 0, stream, b"\0\0\0\x08"))
    assert _goaway_code(client) == ENHANCE_YOUR_CALM
    _others_are_answered()


def test_a_header_that_would_split_a_relayed_call_is_refused_and_others_are_served(server):
    """A call the replica would relay to the front as HTTP/1.1 (ServerLive) with CR LF in a
    header value: its stream is reset with PROTOCOL_ERROR and nothing is relayed; the
    connection's next call and other clients are answered."""
    client, encoder = _grpc_connection()
    block = encoder.encode([(":method", "POST"), (":scheme", "http"), (":authority", "x"),
                            (":path", "/inference.GRPCInferenceService/ServerLive"), ("content-type", "application/grpc"),
                            ("te", "trailers"), ("x-note", "a\r\ncontent-length: 0\r\n\r\nGET /v2 HTTP/1.1")])
    second = encoder.encode([(":method", "POST"), (":scheme", "http"), (":authority", "x"),
                             (":path", "/inference.GRPCInferenceService/ModelInfer"), ("content-type", "application/grpc"),
                             ("te", "trailers")])
    client.sendall(frame(HEADERS, END_HEADERS | END_STREAM, 3, block)
                   + frame(HEADERS, END_HEADERS, 5, second) + frame(DATA, END_STREAM, 5, _simple_request()))
    resets, ended, data, decoder = {}, set(), b"", hpack.Decoder()
    deadline = time.monotonic() + 30
    with client:
        while not (3 in resets and 5 in ended) and time.monotonic() < deadline:
            client.settimeout(max(deadline - time.monotonic(), 0.01))
            chunk = client.recv(1 << 16)
            assert chunk, "the server closed the connection"
            data += chunk
            at, view = 0, memoryview(data)
            while at + 9 <= len(data) and at + 9 + int.from_bytes(data[at:at + 3], "big") <= len(data):
                parsed, length = Frame.parse_frame_header(view[at:at + 9])
                parsed.parse_body(view[at + 9:at + 9 + length])
                at += 9 + length
                if parsed.type == RST_STREAM:
                    resets[parsed.stream_id] = parsed.error_code
                elif parsed.type == HEADERS:
                    decoder.decode(parsed.data)
                    if "END_STREAM" in parsed.flags:
                        ended.add(parsed.stream_id)
            data = data[at:]
    assert resets.get(3) == PROTOCOL_ERROR and 3 not in ended and 5 in ended
    _others_are_answered()


def test_a_window_update_flood_closes_that_connection_and_others_are_served(server):
    """WINDOW_UPDATEs for nothing the server sent count as control frames."""
    client, _ = _grpc_connection()
    with contextlib.suppress(OSError):
        for _ in range(200):
            client.sendall(frame(WINDOW_UPDATE, 0, 0, (1).to_bytes(4, "big")) * 50)
    assert _goaway_code(client) == ENHANCE_YOUR_CALM
    _others_are_answered()


def test_pipelined_requests_never_read_do_not_slow_others(server):
    """A client sends thousands of pipelined infer requests and reads none of the answers."""
    body = (b'{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"INT32","data":[%s]},'
            b'{"name":"INPUT1","shape":[1,16],"datatype":"INT32","data":[%s]}]}') % ((b",".join([b"1"] * 16),) * 2)
    request = (b"POST /v2/models/simple/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%b" % (len(body), body))
    hostile = socket.socket()
    hostile.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 12)
    hostile.connect(("127.0.0.1", HTTP_PORT))
    hostile.settimeout(1)  # the server stops reading it: the send times out
    with hostile:
        with contextlib.suppress(OSError):
            hostile.sendall(request * 20_000)
        _others_are_answered()


def _big_identity_body(size: int) -> bytes:
    return b'{"inputs":[{"name":"INPUT0","shape":[1,1],"datatype":"BYTES","data":["%b"]}]}' % (b"x" * size)


def test_clients_that_leave_mid_answer_do_not_disturb_others(server):
    """Clients ask for large answers (a 4 MB string through simple_identity, over HTTP and
    gRPC) and close their connections without reading them."""
    body = _big_identity_body(4 << 20)
    request = (b"POST /v2/models/simple_identity/infer HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%b" % (len(body), body))
    message = pb.ModelInferRequest(model_name="simple_identity", id="leaving")
    message.inputs.add(name="INPUT0", datatype="BYTES", shape=[1, 1])
    message.raw_input_contents.append((4 << 20).to_bytes(4, "little") + b"x" * (4 << 20))
    payload = message.SerializeToString()
    framed = b"\0" + len(payload).to_bytes(4, "big") + payload
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", HTTP_PORT), timeout=30) as client:
            client.sendall(request)
            client.recv(1)  # the answer has begun: leave in the middle of it
        encoder = hpack.Encoder()
        block = encoder.encode([(":method", "POST"), (":scheme", "http"), (":authority", "x"),
                                (":path", "/inference.GRPCInferenceService/ModelInfer"),
                                ("content-type", "application/grpc"), ("te", "trailers")])
        with socket.create_connection(("127.0.0.1", GRPC_PORT), timeout=30) as client:
            client.sendall(PREFACE + settings({}) + frame(HEADERS, END_HEADERS, 1, block)
                           + b"".join(frame(DATA, END_STREAM if at + 16_384 >= len(framed) else 0, 1, framed[at:at + 16_384])
                                      for at in range(0, len(framed), 16_384)))
            client.recv(1)
    _others_are_answered()
