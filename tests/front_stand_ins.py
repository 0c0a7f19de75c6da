"""Stand-ins for the front's unit tests: replica listeners that answer from plain handlers
(on the event loop of tests/conftest.py's ``loop`` fixture) and raw HTTP/1.1 requests; no Ray."""

from __future__ import annotations

import asyncio
import socket
import threading

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb

from rayinfer.deployments.front import Front
from rayinfer.transport.replica_listener import ReplicaListener
from rayinfer.protocol.errors import NotFoundError

UNICODE_ERROR = "Request for unknown model: 'm\u00fc' is not found (100% sure)"
# The front key of the fronts and stand-in listeners of the unit tests (a real one is random:
# deployments/cluster_records.py).
TEST_FRONT_KEY = "0123456789abcdef" * 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _IngressListener(ReplicaListener):
    """A listener standing in for Serve's ingress too, to which the front's requests carry no key."""

    def front_key_matches(self, given: bytes | None) -> bool:
        return True


class Replica:
    """A listener whose handler echoes ModelInfer inputs and names itself in the response
    (``ingress``: it stands in for Serve's ingress behind the front too, and takes requests
    without the front key; the others take only requests with :data:`TEST_FRONT_KEY`).

    A call for the model "slow" is held in flight: ``slow_arrived`` is set when it reaches the
    handler, which answers once the test calls ``release_slow()``. Its streams echo each request
    as ``<name>-stream``; a request with id "fail" ends the stream with NOT_FOUND, one with id
    "hold" waits for ``release_slow()`` before the stream takes its next request.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str, ingress: bool = False) -> None:
        self.name = name
        self.loop = loop
        self.slow_arrived = threading.Event()
        self.slow_calls = 0
        self._release = asyncio.Event()
        self.streams_open = 0
        self.listener = (_IngressListener if ingress else ReplicaListener)(self.handle, self.handle_http)
        self.listener.front_key = TEST_FRONT_KEY
        self.listener.stream_grpc = self.stream
        self.port = asyncio.run_coroutine_threadsafe(self.listener.start("127.0.0.1"), loop).result(5)

    def release_slow(self) -> None:
        self.loop.call_soon_threadsafe(self._release.set)

    async def handle(self, method: str, message: bytes) -> bytes:
        if method == "ModelInfer":
            request = pb.ModelInferRequest.FromString(message)
            if request.model_name == "slow":
                self.slow_calls += 1
                self.slow_arrived.set()
                await self._release.wait()
            response = pb.ModelInferResponse(model_name=self.name, id=request.id)
            response.raw_output_contents.extend(request.raw_input_contents)
            return response.SerializeToString()
        if method == "ModelReady":
            raise NotFoundError(UNICODE_ERROR)
        raise RuntimeError(f"no {method} here")

    async def stream(self, requests, headers):
        self.streams_open += 1
        try:
            async for request in requests:
                if request.id == "fail":
                    raise NotFoundError("Request for unknown model: 'fail' is not found")
                if request.id == "hold":
                    self.slow_arrived.set()
                    await self._release.wait()
                response = pb.ModelInferResponse(model_name=f"{self.name}-stream", id=request.id)
                response.raw_output_contents.extend(request.raw_input_contents)
                yield pb.ModelStreamInferResponse(infer_response=response).SerializeToString()
        finally:
            self.streams_open -= 1

    async def handle_http(self, method: str, path: str, headers: dict[bytes, bytes], body: bytes):
        if path.endswith("/slow"):  # held like a "slow" model call
            self.slow_arrived.set()
            await self._release.wait()
        if b"x-fail" in body:
            raise NotFoundError("Request for unknown model: 'x' is not found")
        return 200, [(b"content-type", b"text/plain")], f"{self.name} {method} {path} {len(body)}".encode()


def refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
    except OSError:
        return True
    return False


def publish(loop, front: Front, routes) -> None:
    asyncio.run_coroutine_threadsafe(front.publish(routes), loop).result(10)


def infer(client, model: str, data: np.ndarray, request_id: str = ""):
    tensor = grpcclient.InferInput("X", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    return client.infer(model, [tensor], request_id=request_id).get_response()


def http_exchange(port: int, request: bytes) -> bytes:
    """Send one HTTP/1.1 request on a fresh connection; the whole reply (the front closes it)."""
    with socket.create_connection(("127.0.0.1", port), 5) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return b"POST %b HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: %d\r\n%b\r\n%b" % (
        path.encode(), len(body), extra, body
    )


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode()
