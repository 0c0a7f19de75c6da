"""One gRPC stream (``ModelStreamInfer``): each of its requests sent to its model, the answers
written back in request order (a decoupled model's as they come).

Two servers answer streams with this: a model replica, for a stream on a client's connection it
holds (:mod:`replica_h2`: its own model's requests in the replica, another model's by deployment
handle), and the ``/v2`` replica's gRPC service, for a stream the front sends there. What differs
between them is how one request reaches its model (``forward``); the rest is Triton's stream:
requests answered in order (a decoupled model's responses written as they come, between
them), several in flight at once, an error a response's ``error_message`` (the stream stays open), the requests of one sequence (``sequence_id``) sent to the model one
after another (in flight together, a later one could reach the sequence batcher first). A
client that sends the ``triton_grpc_error: true`` header asks for Triton's other rule: the
first error ends the stream with its gRPC status.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from rayinfer.protocol.errors import UNPARSABLE_REQUEST, InternalError, ServingError, as_serving_error
from rayinfer.protocol.limits import DEFAULT_CONNECTION_LIMITS

class AsTheyCome(NamedTuple):
    """What a request's ``forward`` yields first when its responses are written as they come (a
    decoupled model's), not in request order."""

    decoupled: bool = True


AS_THEY_COME = AsTheyCome()
# Requests of a stream in flight ahead of the one being answered (answered in order all the same).
STREAM_WINDOW = 64
# The call header with which a client asks that an error end the stream (Triton's name).
GRPC_ERROR_HEADER = "triton_grpc_error"


def ends_on_error(headers: Any) -> bool:
    """Whether a stream's call headers (name-value pairs, bytes or str) carry ``triton_grpc_error: true``."""
    for name, value in headers:
        name = name.decode("latin-1") if isinstance(name, bytes) else name
        if name.lower() == GRPC_ERROR_HEADER:
            value = value.decode("latin-1") if isinstance(value, bytes) else str(value)
            return value.strip().lower() == "true"
    return False


class Unparsable:
    """What a request that does not parse is read as: it is answered with Triton's INTERNAL
    "Unable to parse request" (gRPC's server would answer UNKNOWN with protobuf's message)."""


class Traced(NamedTuple):
    """After a traced request's responses (Triton's trace file): its trace's ``token``, and how
    far the clock of the replica that traced it is ahead of this process's (0 on one node), for
    the send stamps taken where the responses are written."""

    token: str
    offset: int


# One request of the stream and when its read began and ended (perf_counter ns) -> its responses
# (a decoupled model's: zero to many), then a Traced when it was traced.
Forward = Callable[[pb.ModelInferRequest, tuple[int, int]], AsyncIterator[Any]]
# A response carrying an error message, as ``forward`` yields responses.
ErrorResponse = Callable[[str], Any]
# A traced request's send stamps (GRPC_SEND_START and _END of each response, on its replica's clock).
SendStamps = Callable[[str, list[tuple[str, int]]], None]


class _Responses:
    """One request's responses on their way to the stream's writer, in order: at most ``limit``
    of them not yet taken (then what forwards them waits, and with it the model's sender); its
    error and its end never wait. ``sends``: its responses' GRPC_SEND_START and _END stamps."""

    __slots__ = ("_queue", "_room", "sends")

    def __init__(self, limit: int) -> None:
        self._queue: asyncio.Queue[tuple[Any, bool]] = asyncio.Queue()  # (item, counted against the bound)
        self._room = asyncio.Semaphore(max(1, limit))
        self.sends: list[tuple[str, int]] = []

    async def put(self, response: Any) -> None:
        await self._room.acquire()
        self._queue.put_nowait((response, True))

    def end(self, last: Any) -> None:
        """The request's error or its end (None): queued at once, past the bound."""
        self._queue.put_nowait((last, False))

    async def get(self) -> Any:
        item, counted = await self._queue.get()
        if counted:
            self._room.release()
        return item


def parse_request(payload: bytes) -> pb.ModelInferRequest | Unparsable:
    try:
        return pb.ModelInferRequest.FromString(payload)
    except DecodeError:
        return Unparsable()


async def answer_stream(requests: AsyncIterator[pb.ModelInferRequest | Unparsable], forward: Forward,
                        error: ErrorResponse, sent: SendStamps, end_on_error: bool = False,
                        max_queued_responses: int = DEFAULT_CONNECTION_LIMITS.max_queued_responses,
                        ) -> AsyncIterator[Any]:
    """The responses to a stream's ``requests``: in request order, but those of a request whose
    ``forward`` yields :data:`AS_THEY_COME` first (a decoupled model's) as they come, between
    the others, once the requests before it are answered or written as they come too (as Triton
    writes a decoupled model's responses). An error (a ServingError ``forward`` yields
    or raises) is a response made by ``error``, or, with ``end_on_error``, raised: the stream
    ends with its status, the requests after it unanswered. At most STREAM_WINDOW requests are
    in flight; each request's responses not yet taken by the caller are at most
    ``max_queued_responses`` (--max-queued-responses); past it its ``forward`` is not read on."""
    in_flight = asyncio.Semaphore(STREAM_WINDOW)
    ordered: asyncio.Queue[_Responses | None] = asyncio.Queue()  # bounded by in_flight
    # To the writer, one (request's responses, item) at a time; (None, exception or None) ends.
    ready: asyncio.Queue[tuple[_Responses | None, Any]] = asyncio.Queue(1)
    tasks: set[asyncio.Task] = set()
    relays: list[asyncio.Task] = []
    # (model, sequence id) -> the task of that sequence's latest request in this stream
    sequences: dict[tuple[str, str], asyncio.Task] = {}

    def started(coroutine: Any) -> asyncio.Task:
        task = asyncio.ensure_future(coroutine)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return task

    async def send_on(request: Any, out: _Responses, after: asyncio.Task | None, read: tuple[int, int]) -> None:
        error: ServingError | None = None
        try:
            if isinstance(request, Unparsable):
                raise InternalError(UNPARSABLE_REQUEST)
            if after is not None:
                await asyncio.wait([after])
            async for response in forward(request, read):
                if isinstance(response, AsTheyCome):
                    out.end(AS_THEY_COME)
                else:
                    await out.put(response)
        except Exception as exc:
            error = as_serving_error(exc)
        finally:
            if error is not None:
                out.end(error)
            out.end(None)

    async def relay(out: _Responses) -> None:
        """One request's responses to the writer, its end (None) last."""
        while True:
            item = await out.get()
            await ready.put((out, item))
            if item is None:
                return

    async def in_order() -> None:
        while (out := await ordered.get()) is not None:
            first = await out.get()
            if isinstance(first, AsTheyCome):
                relays.append(started(relay(out)))
                continue
            await ready.put((out, first))
            if first is not None:
                await relay(out)

    async def submit() -> None:
        try:
            # When each request's read began (the previous one's was done) and ended: its
            # trace's GRPC_WAITREAD_START and _END, as Triton stamps a stream's requests.
            reading = time.perf_counter_ns()
            async for request in requests:
                read = (reading, time.perf_counter_ns())
                await in_flight.acquire()
                out = _Responses(max_queued_responses)
                key = sequence_key(request)
                task = started(send_on(request, out, sequences.get(key) if key else None, read))
                if key is not None:
                    sequences[key] = task
                    task.add_done_callback(functools.partial(_forget, sequences, key))
                ordered.put_nowait(out)
                reading = time.perf_counter_ns()
        finally:
            ordered.put_nowait(None)

    async def finish() -> None:
        """The end of the stream, once every request's responses went to the writer."""
        try:
            await feeder
            await writer_order
            await asyncio.gather(*relays)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the requests' iterator failed (the client reset the stream)
            await ready.put((None, exc))
            return
        await ready.put((None, None))

    feeder = started(submit())
    writer_order = started(in_order())
    started(finish())
    try:
        while True:
            out, response = await ready.get()
            if out is None:
                if response is not None:
                    raise response
                return
            if response is None:  # a request answered
                in_flight.release()
                continue
            if isinstance(response, Traced):
                sent(response.token, [(name, ns + response.offset) for name, ns in out.sends])
                continue
            if isinstance(response, ServingError):
                if end_on_error:
                    raise response
                response = error(response.message)
            send_start = time.perf_counter_ns()
            yield response
            out.sends += (("GRPC_SEND_START", send_start), ("GRPC_SEND_END", time.perf_counter_ns()))
    finally:
        for task in list(tasks):
            task.cancel()


def _forget(sequences: dict[tuple[str, str], asyncio.Task], key: tuple[str, str], done: asyncio.Task) -> None:
    """A sequence's request is answered: unless a later one of that sequence came, none waits."""
    if sequences.get(key) is done:
        del sequences[key]


def sequence_key(request: pb.ModelInferRequest | Unparsable) -> tuple[str, str] | None:
    """(model, sequence id) of a stream request that belongs to a sequence, else None."""
    if isinstance(request, Unparsable) or "sequence_id" not in request.parameters:
        return None
    parameter = request.parameters["sequence_id"]
    value = str(getattr(parameter, parameter.WhichOneof("parameter_choice") or "string_param"))
    return None if value in ("", "0") else (request.model_name, value)
