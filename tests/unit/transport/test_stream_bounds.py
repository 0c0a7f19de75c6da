"""What a stream's responses may hold while its client does not read them (--max-queued-responses,
--connection-buffer-bytes, --client-send-timeout): a decoupled Python model served by a real
listener behind the front's acceptor, the streamed response's own bound on a connection that does
not pause its writer (the front's), and a gRPC stream's per-request queues. No Ray."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import service_pb2 as pb

from rayinfer.adapters.loader import load_runner
from rayinfer.adapters.python_backend import triton_python_backend_utils as pb_utils
from rayinfer.protocol.errors import ServingError
from rayinfer.protocol.limits import DEFAULT_CONNECTION_LIMITS, ConnectionLimits
from rayinfer.protocol.types import InferOutput, InferResponse
from rayinfer.serving import model_http
from rayinfer.serving.executor import ResponseSender
from rayinfer.transport.listener_responses import StreamedResponse
from rayinfer.serving.model_core import ModelCore
from rayinfer.transport.replica_listener import ReplicaListener
from rayinfer.serving.routes import parse_model_route
from rayinfer.serving.stream_infer import answer_stream
from front_stand_ins import publish
from test_acceptor import _serves_model, acceptor  # noqa: F401  (acceptor: the front's acceptor, a fixture)
from test_listener_limits import _closed_by_server, _connect
from waiting import wait_until

FLOOD = '''
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

# What the model's sending threads saw, for the test (by request id).
STATE = {}


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)[0])
            state = STATE[request.request_id()] = {"sent": 0, "error": None, "cancelled": None,
                                                  "done": threading.Event()}
            threading.Thread(target=self._send, args=(request, request.get_response_sender(), count, state),
                             daemon=True).start()
        return None

    def _send(self, request, sender, count, state):
        payload = np.arange(2048, dtype=np.int32)  # an event of about 10 KB
        try:
            for _ in range(count):
                if request.is_cancelled():
                    break
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", payload)]))
                state["sent"] += 1
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except pb_utils.TritonModelException as exc:
            state["error"] = str(exc)
        finally:
            state["cancelled"] = request.is_cancelled()
            state["done"].set()
'''
CONFIG = ('name: "flood"\nbackend: "python"\nmax_batch_size: 0\n'
          'input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
          'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]\n'
          'model_transaction_policy { decoupled: true }\n')
_MB = 1 << 20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _generate_stream(count: int, request_id: str, close: bool = False) -> bytes:
    body = b'{"IN": %d, "id": "%b"}' % (count, request_id.encode())
    return (b"POST /v2/models/flood/generate_stream HTTP/1.1\r\nhost: x\r\n%bcontent-length: %d\r\n\r\n%b"
            % (b"connection: close\r\n" if close else b"", len(body), body))


class _Served:
    """The flood model in a ModelCore behind a real listener, reachable through the acceptor."""

    def __init__(self, loop: asyncio.AbstractEventLoop, front: Any, root: Path, limits: ConnectionLimits) -> None:
        root.joinpath("flood", "1").mkdir(parents=True)
        root.joinpath("flood", "config.pbtxt").write_text(CONFIG)
        root.joinpath("flood", "1", "model.py").write_text(FLOOD)
        self.loop = loop
        runner, entry = load_runner(root, "flood", 1)

        async def start() -> tuple[ModelCore, ReplicaListener]:
            core = ModelCore(runner, entry.versions)
            core.max_queued_responses = limits.max_queued_responses  # as the replica sets it from its limits

            async def http(method: str, path: str, headers: dict[bytes, bytes], body: bytes) -> Any:
                return await model_http.respond(core, method, parse_model_route(path, encoded=True), headers, body)

            listener = ReplicaListener(_no_grpc, http, model="flood")
            listener.limits = limits
            listener.routes = _serves_model("flood")
            await listener.start("127.0.0.1")
            return core, listener

        self.core, self.listener = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
        publish(loop, front, {"flood/": [("127.0.0.1", self.listener.port)]})

    def state(self, request_id: str) -> dict[str, Any]:
        return wait_until(lambda: sys.modules["rayinfer_python_model_flood_1"].STATE.get(request_id),
                          f"request {request_id} to reach the model", 10, 0.01)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.listener.close(0), self.loop).result(10)
        self.core.close()


async def _no_grpc(method: str, message: bytes) -> bytes:
    raise RuntimeError("no gRPC here")


def _read_whole_stream(port: int, count: int, request_id: str) -> bytes:
    """A well-behaved client's whole generate_stream answer (the connection closes after it)."""
    with socket.create_connection(("127.0.0.1", port), 5) as sock:
        sock.settimeout(5)
        sock.sendall(_generate_stream(count, request_id, close=True))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def _settled(state: dict[str, Any], quiet_s: float = 0.5) -> int:
    """The model's sent count once it stopped growing for ``quiet_s``."""
    last, since = -1, time.monotonic()
    while True:
        sent = state["sent"]
        if sent != last:
            last, since = sent, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return sent
        if state["done"].is_set():
            return state["sent"]
        time.sleep(0.02)


def test_a_decoupled_model_waits_for_a_client_that_reads_none_of_its_responses(loop, acceptor, tmp_path):  # noqa: F811
    """10,000 responses to a client that reads none: the model's sending thread blocks once
    --max-queued-responses of them wait (beside what the connection's buffers hold), the
    process does not grow with them, and once the client goes away the blocked send raises
    the cancelled request's error."""
    front, port = acceptor
    limits = dataclasses.replace(DEFAULT_CONNECTION_LIMITS, max_queued_responses=16, connection_buffer_bytes=1 << 16,
                                 send_timeout_s=30.0)
    served = _Served(loop, front, tmp_path, limits)
    try:
        assert _read_whole_stream(port, 3, "warm").count(b"data: ") == 3
        before = _rss_bytes()
        reader = _connect(port, rcvbuf=16384)
        try:
            reader.sendall(_generate_stream(10_000, "flood"))
            state = served.state("flood")
            sent = _settled(state)
            grown = _rss_bytes() - before
            assert not state["done"].is_set(), state  # blocked in send, not finished
            # 16 queued, a few in the chain of generators, 64 KiB of events in the write buffer
            # and what the kernel's socket buffers hold: far from 10,000.
            assert sent < 1_000, sent
            assert grown < 8 * _MB, grown
        finally:
            reader.close()
        assert state["done"].wait(5), "the blocked send did not end when the client went away"
        assert state["cancelled"] and "cancelled" in (state["error"] or ""), state
    finally:
        served.close()


def test_a_stream_not_read_is_disconnected_and_its_request_cancelled(loop, acceptor, tmp_path):  # noqa: F811
    """A generate_stream client that stops reading is disconnected after --client-send-timeout
    and the model's request is cancelled; another client of the same listener is answered
    within 1 s meanwhile."""
    front, port = acceptor
    limits = dataclasses.replace(DEFAULT_CONNECTION_LIMITS, max_queued_responses=16, connection_buffer_bytes=1 << 16,
                                 send_timeout_s=0.5)
    served = _Served(loop, front, tmp_path, limits)
    try:
        reader = _connect(port, rcvbuf=16384)
        try:
            reader.sendall(_generate_stream(10_000, "slow"))
            state = served.state("slow")
            start = time.monotonic()
            answer = _read_whole_stream(port, 2, "other")
            assert time.monotonic() - start < 1.0
            assert answer.count(b"data: ") == 2
            wait_until(lambda: _closed_by_server(reader), "the non-reading connection to be closed", 5, 0.05)
            assert state["done"].wait(5), state
            assert state["cancelled"] and state["sent"] < 10_000, state
        finally:
            reader.close()
    finally:
        served.close()


def test_an_open_generate_stream_counts_in_flight(loop, acceptor, tmp_path):  # noqa: F811
    """--max-inflight-requests counts a generate_stream while its events are being written."""
    front, port = acceptor
    limits = dataclasses.replace(DEFAULT_CONNECTION_LIMITS, max_queued_responses=16, connection_buffer_bytes=1 << 16)
    served = _Served(loop, front, tmp_path, limits)
    try:
        reader = _connect(port, rcvbuf=16384)
        try:
            reader.sendall(_generate_stream(10_000, "open"))
            _settled(served.state("open"))
            assert served.listener.in_flight == 1
        finally:
            reader.close()
        wait_until(lambda: served.listener.in_flight == 0, "the stream to stop counting", 5, 0.02)
    finally:
        served.close()


def test_a_streamed_response_bounds_a_connection_that_does_not_pause_it(loop):
    """On a connection whose protocol does not pause its writer (the front's), a streamed
    response stops taking chunks past --connection-buffer-bytes, and resets the connection
    when its reader takes nothing for --client-send-timeout; what made the chunks is closed."""
    limits = dataclasses.replace(DEFAULT_CONNECTION_LIMITS, connection_buffer_bytes=1 << 16, send_timeout_s=0.5)
    made = {"chunks": 0, "closed": False}

    async def chunks() -> Any:
        try:
            for _ in range(100_000):
                made["chunks"] += 1
                yield b"x" * 8192
        finally:
            made["closed"] = True

    server, peer = socket.socketpair()
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)

    async def write() -> tuple[bool, float]:
        transport, _ = await asyncio.get_running_loop().connect_accepted_socket(asyncio.Protocol, server)
        start = time.monotonic()
        written = await StreamedResponse(200, [], chunks(), limits).write(transport)
        return written, time.monotonic() - start

    try:
        written, elapsed = asyncio.run_coroutine_threadsafe(write(), loop).result(10)
    finally:
        peer.close()
    assert not written and made["closed"]
    assert made["chunks"] < 200, made  # 1.6 MB of 800 MB, most of it in the kernel's buffers
    assert 0.5 <= elapsed < 3.0, elapsed


def _response(n: int) -> InferResponse:
    return InferResponse("m", "1", [InferOutput("OUT", "INT32", (1,), np.array([n], dtype=np.int32))])


def test_a_grpc_streams_request_queues_at_most_max_queued_responses() -> None:
    """answer_stream's queue of one request's responses holds at most the bound; what forwards
    them waits while the stream's writer takes none."""
    made = []

    async def main() -> None:
        async def requests() -> Any:
            yield pb.ModelInferRequest(model_name="m")

        async def forward(request: Any, read: tuple[int, int]) -> Any:
            for n in range(10_000):
                made.append(n)
                yield n

        stream = answer_stream(requests(), forward, lambda message: message, lambda token, stamps: None,
                               max_queued_responses=16)
        assert await anext(stream) == 0
        await asyncio.sleep(0.2)  # the forwarding runs on while the writer takes nothing
        # the bound, and one each in the hands of the forwarder, the relay, the writer's queue and the writer
        assert len(made) <= 16 + 4, len(made)
        assert [await anext(stream) for _ in range(100)] == list(range(1, 101))
        await stream.aclose()

    asyncio.run(main())


def test_a_send_past_the_bound_from_the_loop_that_takes_the_responses_is_refused() -> None:
    """The event loop that takes a request's responses cannot wait for room: a send there past
    the bound raises an error naming the model and the flag; the final one always goes."""

    async def main() -> None:
        sender = ResponseSender("m", 4)
        for n in range(4):
            sender.send(_response(n))
        with pytest.raises(ServingError, match="'m'.*--max-queued-responses"):
            sender.send(_response(4))
        sender.send(None, final=True)
        assert [int(r.outputs[0].data[0]) async for r in sender.responses()] == [0, 1, 2, 3]

    asyncio.run(main())


def test_a_blocked_send_raises_the_cancelled_error_once_the_request_is_cancelled() -> None:
    """A model thread blocked in ``send`` (the bound reached) gets Triton's cancelled error, as a
    TritonModelException, once its request is cancelled."""

    async def main() -> str:
        sender = ResponseSender("m", 2)
        pb_sender = pb_utils.InferenceResponseSender(lambda response, final: sender.send(response, final))

        def send_many() -> str:
            try:
                for n in range(10):
                    pb_sender.send(_response(n))
            except pb_utils.TritonModelException as exc:
                return str(exc)
            return "sent all"

        thread = asyncio.ensure_future(asyncio.to_thread(send_many))
        await _until(lambda: sender._queued == 2)  # two sent, the third waiting for room
        assert not thread.done()  # blocked in its third send
        sender.cancel()
        return await asyncio.wait_for(thread, 5)

    assert "cancelled" in asyncio.run(main())


def test_a_send_from_a_coroutine_on_the_senders_loop_waits_for_room() -> None:
    """An ensemble's decoupled step emits from the event loop that takes the responses: past the
    bound it waits (without stopping the loop) instead of being refused, and every response
    arrives in order."""
    async def main() -> tuple[int, list[str]]:
        sender = ResponseSender("ensemble", limit=2)
        most = 0

        async def produce() -> None:
            nonlocal most
            for n in range(10):
                await sender.send_async(InferResponse("ensemble", "1", [], str(n)))
                most = max(most, sender._queued)
            sender.send(None, final=True)

        producer = asyncio.ensure_future(produce())
        await _until(lambda: sender._queued == 2)  # nothing taken yet: the producer waits at the bound
        assert not producer.done()
        ids = []
        async for response in sender.responses():
            ids.append(response.id)
            await asyncio.sleep(0)  # a reader slower than the producer: the producer runs in between
        await producer
        return most, ids

    most, ids = asyncio.run(main())
    assert most <= 2 and ids == [str(n) for n in range(10)]


async def _until(condition, timeout_s: float = 5.0) -> None:
    """Yield to the event loop until ``condition()`` holds (fails after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        await asyncio.sleep(0.005)
