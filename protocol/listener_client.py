"""An asyncio HTTP/1.1 client for model replicas' listeners: a request as the v2 protocol's
binary tensor extension (a small JSON header, then the tensors' raw bytes), its response decoded
back to arrays.

Used where one model calls another inside the server (an ensemble's steps): the call takes the
path a client's request takes from the front, one process hop, instead of a Ray handle call.
Connections are kept alive and reused, one request at a time each. Every request carries the
server's front key (:func:`front_key_header`, among the client's ``headers``): a listener serves
only the server's own parts over its port (:mod:`rayinfer.protocol.front_key`).

A request of a decoupled model's sequence held by another replica is *streamed*
(:meth:`ListenerClient.stream`): the listener answers with a chunked body, one chunk per
response (:func:`stream_frame`), on a connection of its own.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

import numpy as np

from rayinfer.protocol.dtypes import array_from_buffer, serialize_bytes_tensor
from rayinfer.protocol.errors import Code, ServingError, UnavailableError
from rayinfer.protocol.front_key import FRONT_KEY_HEADER
from rayinfer.protocol.types import InferOutput, InferRequest, InferResponse

# The request header asking a listener for a decoupled model's responses as a stream.
STREAM_HEADER = b"x-rayinfer-stream"
# The request header carrying a traced sender's trace link (InferRequest.trace_parent).
TRACE_PARENT_HEADER = b"x-rayinfer-trace-parent"
_STATUS_CODES = {400: Code.INVALID_ARG, 404: Code.NOT_FOUND, 501: Code.UNSUPPORTED, 503: Code.UNAVAILABLE}
# Idle connections kept per listener.
_MAX_IDLE = 32

Address = tuple[str, int]
Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class ListenerClient:
    """Sends inference requests to listeners; keeps their connections for the next request."""

    def __init__(self, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        """``headers``: sent with every request (the front key's, :func:`front_key_header`; a
        restricted group's)."""
        self._idle: dict[Address, list[Connection]] = {}
        self.headers = headers

    async def infer(self, address: Address, request: InferRequest,
                    headers: tuple[tuple[bytes, bytes], ...] = ()) -> InferResponse:
        """The listener's response to ``request`` (sent with ``headers`` too); its error
        (Triton's code from the status) raised as :class:`ServingError`;
        :class:`UnavailableError` when it cannot be reached."""
        message = b"".join(encode_request(request, address, (*self.headers, *headers)))  # one send
        for attempt in (0, 1):
            reused = bool(self._idle.get(address))
            try:
                connection = await self._connect(address)
            except ConnectionError as exc:
                raise UnavailableError(f"model '{request.model_name}' could not be reached: {exc}") from None
            try:
                connection[1].write(message)
                status, header_length, payload = await _read_response(connection[0])
            except (ConnectionError, asyncio.IncompleteReadError, OSError) as exc:
                connection[1].close()
                if reused and attempt == 0:  # a kept connection the listener had closed: once more
                    continue
                raise UnavailableError(f"model '{request.model_name}' could not be reached: {exc}") from None
            except BaseException:  # cancelled mid-call: the connection's state is unknown
                connection[1].close()
                raise
            self._release(address, connection)
            return decode_response(status, header_length, payload, request)
        raise AssertionError("unreachable")

    async def stream(self, address: Address, request: InferRequest,
                     headers: tuple[tuple[bytes, bytes], ...] = ()) -> AsyncIterator[InferResponse | ServingError]:
        """Each response of a decoupled model's listener to ``request``, as it comes (an error
        as its :class:`ServingError`), until the listener ends the stream; raises
        :class:`UnavailableError` when it cannot be reached or the stream breaks off. Stopping
        the iteration closes the connection, which cancels the request there."""
        try:
            reader, writer = await asyncio.open_connection(*address)
        except OSError as exc:
            raise UnavailableError(f"model '{request.model_name}' could not be reached: {exc}") from None
        try:
            writer.write(b"".join(encode_request(request, address, (*self.headers, *headers, (STREAM_HEADER, b"1")))))
            try:
                status, fields = await _read_head(reader)
                if fields.get("transfer-encoding") != "chunked":  # refused before the model: one error
                    length = int(fields.get("content-length", "0"))
                    body = await reader.readexactly(length) if length else b""
                    yield _decoded(status, None, body, request)
                    return
                while True:
                    size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
                    chunk = await reader.readexactly(size + 2)
                    if size == 0:
                        return
                    line, _, body = chunk[:-2].partition(b"\n")
                    frame_status, json_length = (int(v) for v in line.split())
                    yield _decoded(frame_status, json_length if json_length >= 0 else None, body, request)
            except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError, ValueError) as exc:
                raise UnavailableError(f"model '{request.model_name}': the stream from its replica broke off: "
                                       f"{exc}") from None
        finally:
            writer.close()

    async def _connect(self, address: Address) -> Connection:
        idle = self._idle.get(address)
        while idle:
            connection = idle.pop()
            if not connection[1].is_closing() and not connection[0].at_eof():
                return connection
        try:
            return await asyncio.open_connection(*address)
        except OSError as exc:
            raise ConnectionError(str(exc)) from None

    def _release(self, address: Address, connection: Connection) -> None:
        idle = self._idle.setdefault(address, [])
        if len(idle) < _MAX_IDLE:
            idle.append(connection)
        else:
            connection[1].close()

    def forget(self, address: Address) -> None:
        """Close the kept connections to a listener that went away."""
        for _, writer in self._idle.pop(address, []):
            writer.close()

    def close(self) -> None:
        for address in list(self._idle):
            self.forget(address)


def front_key_header(key: str) -> tuple[bytes, bytes]:
    """The header carrying the server's front key, which a listener asks of every request over its
    port."""
    return FRONT_KEY_HEADER, key.encode()


def encode_request(request: InferRequest, address: Address,
                   headers: tuple[tuple[bytes, bytes], ...] = ()) -> tuple[bytes, bytes]:
    """(request line and headers, body) of ``request``: every tensor binary, both ways."""
    inputs = []
    chunks = []
    for tensor in request.inputs:
        data = tensor.data
        raw = serialize_bytes_tensor(data) if tensor.datatype == "BYTES" else np.ascontiguousarray(data).tobytes()
        inputs.append({"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
                       "parameters": {"binary_data_size": len(raw)}})
        chunks.append(raw)
    doc: dict[str, Any] = {"inputs": inputs}
    if request.outputs is not None:
        # Outputs come back binary; a classification is computed where the model runs.
        doc["outputs"] = [{"name": o.name, "parameters": {"binary_data": True, **(
            {"classification": o.parameters["classification"]} if "classification" in o.parameters else {})}}
            for o in request.outputs]
    doc["parameters"] = {**request.parameters, "binary_data_output": True}
    if request.id is not None:
        doc["id"] = request.id
    header = json.dumps(doc, separators=(",", ":")).encode()
    body = header + b"".join(chunks)
    version = f"/versions/{request.model_version}" if request.model_version else ""
    path = f"/v2/models/{quote(request.model_name, safe='')}{version}/infer".encode()
    if request.trace_parent is not None:
        headers += ((TRACE_PARENT_HEADER, request.trace_parent.encode()),)
    extra = b"".join(b"%b: %b\r\n" % header for header in headers)
    head = (b"POST %b HTTP/1.1\r\nhost: %s:%d\r\ncontent-length: %d\r\ninference-header-content-length: %d\r\n%b\r\n"
            % (path, address[0].encode(), address[1], len(body), len(header), extra))
    return head, body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, int | None, bytes]:
    """(status, the JSON header's length if binary data follows, body) of one response."""
    status, headers = await _read_head(reader)
    length = int(headers.get("content-length", "0"))
    body = await reader.readexactly(length) if length else b""
    header_length = headers.get("inference-header-content-length")
    return status, int(header_length) if header_length is not None else None, body


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """A response's status and headers (lower-case names)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split(" ", 2)[1]), headers


def stream_frame(status: int, json_length: int | None, body: bytes) -> bytes:
    """One response of a stream (a chunk of the listener's body): "<status> <JSON header length
    or -1>\\n" then the response's body as a unary response carries it."""
    return b"%d %d\n%b" % (status, -1 if json_length is None else json_length, body)


def _decoded(status: int, header_length: int | None, body: bytes, request: InferRequest) -> InferResponse | ServingError:
    try:
        return decode_response(status, header_length, body, request)
    except ServingError as exc:
        return exc


def decode_response(status: int, header_length: int | None, body: bytes, request: InferRequest) -> InferResponse:
    """The response's outputs as arrays, or its error raised with the status's code."""
    if status != 200:
        try:
            message = json.loads(body)["error"]
        except (ValueError, KeyError, TypeError):
            message = body.decode("utf-8", errors="replace") or f"HTTP status {status}"
        raise ServingError(message, _STATUS_CODES.get(status, Code.INTERNAL))
    view = memoryview(body)
    header = bytes(view[:header_length]) if header_length is not None else body
    binary = view[header_length:] if header_length is not None else memoryview(b"")
    doc = json.loads(header)
    outputs = []
    offset = 0
    for raw in doc.get("outputs", []):
        shape = tuple(int(d) for d in raw["shape"])
        size = (raw.get("parameters") or {}).get("binary_data_size")
        if size is None:  # every output was asked for as binary data
            raise ServingError(f"model '{request.model_name}' answered output '{raw['name']}' as JSON", Code.INTERNAL)
        data = array_from_buffer(binary[offset:offset + size], raw["datatype"], shape, raw["name"],
                                 f"output '{raw['name']}'", lambda got, want: f"output size {got} != {want}")
        offset += size
        outputs.append(InferOutput(raw["name"], raw["datatype"], shape, data))
    return InferResponse(model_name=doc.get("model_name", request.model_name),
                         model_version=str(doc.get("model_version", request.model_version)),
                         outputs=outputs, id=doc.get("id"))
