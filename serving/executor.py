"""The executor contract: what the serving core needs from a loaded model version.

An executor validates a decoded request against its model (``prepare``) and runs batches of
prepared requests (``execute``, blocking, called off the event loop when executions are long).
Each request gets its own answer, never a batch-wide one:

- a non-decoupled executor returns one :class:`InferResponse` or :class:`ServingError` per
  request, in order (the ONNX Runtime runner, :class:`rayinfer.adapters.model_runner.ModelRunner`);
- a decoupled executor (``decoupled = True``) returns None and answers through each request's
  :class:`ResponseSender` (``prepared.sender``), zero to many responses and then ``final``,
  from any thread and possibly after ``execute`` returned; at most ``--max-queued-responses``
  of them wait to be taken, then the sender waits (:class:`_Sender`).

Executors know nothing of Ray, HTTP or gRPC.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeAlias

from rayinfer.protocol.errors import Code, ServingError, UnavailableError
from rayinfer.protocol.limits import DEFAULT_CONNECTION_LIMITS
from rayinfer.protocol.statistics import ModelStatistics
from rayinfer.protocol.types import InferRequest, InferResponse
from rayinfer.repository.model_config import ModelSpec

Result: TypeAlias = "InferResponse | ServingError"
# How long a send past the bound from a thread that runs an event loop (a Python model's async
# execute) waits for room before it fails: a client that reads keeps up within it.
_LOOP_GRACE_S = 0.05


class Prepared(Protocol):
    """A validated request (:class:`rayinfer.adapters.model_runner.PreparedRequest`)."""

    request: InferRequest
    rows: int
    sender: Any
    cancelled: bool


class Executor(Protocol):
    """One loaded model version in one replica."""

    spec: ModelSpec
    version: str
    stats: ModelStatistics
    decoupled: bool

    def prepare(self, request: InferRequest) -> Prepared:
        """Check the request against the model (INVALID_ARG naming the input if wrong)."""

    def execute(self, batch: Sequence[Any]) -> list[Result] | None:
        """Run prepared requests; one result per request, or None when decoupled."""

    def close(self) -> None:
        """Unload the model."""


class _Sender:
    """``send`` for both senders below: responses in order, nothing after ``final``, and at most
    ``limit`` of them made and not yet taken (``--max-queued-responses``).

    Past the bound a send waits for room on a model's thread, and raises the cancelled
    request's error once the request is cancelled (:meth:`cancel`: its client went away). The
    final send never waits (one response past the bound at most): the error that ends a stream
    is sent from anywhere. A thread that runs an event loop cannot wait long (every coroutine
    of that loop would stop with it): it waits at most ``_LOOP_GRACE_S`` for room, and the
    thread that takes the responses cannot wait at all; past that the send raises an error
    naming the model and the flag.
    """

    __slots__ = ("closed", "_put", "_room", "_queued", "_limit", "_model", "_cancelled", "_taker")

    def __init__(self, put: Callable[[tuple[Result | None, bool]], object], model: str, limit: int) -> None:
        self.closed = False
        self._put = put
        self._room = threading.Condition(threading.Lock())
        self._queued = 0  # sent and not yet taken
        self._limit = max(1, limit)
        self._model = model
        self._cancelled = False
        self._taker = threading.get_ident()  # the thread that takes the responses

    def send(self, response: Result | None = None, final: bool = False) -> None:
        """Queue one response (or none, with ``final`` only); nothing may follow ``final``."""
        if self.closed:
            raise ServingError("a response was sent after the final flag")
        with self._room:
            if not final and self._queued >= self._limit:
                self._wait_for_room()
            self._queued += 1
            self.closed = final
            self._put((response, final))

    def cancel(self) -> None:
        """The request is cancelled (nothing takes its responses any more): a send waiting for
        room, or one past the bound, raises the cancelled request's error."""
        with self._room:
            self._cancelled = True
            self._room.notify_all()

    def _taken(self) -> None:
        with self._room:
            self._queued -= 1
            self._room.notify()

    def _wait_for_room(self) -> None:
        """Wait (holding ``_room``) until fewer than the bound wait to be taken; see the class."""
        deadline = None
        while self._queued >= self._limit:
            if self._cancelled:
                raise ServingError(f"Request for model '{self._model}' was cancelled", Code.CANCELLED)
            if threading.get_ident() == self._taker:
                if self._taker_waits:
                    raise self._full()
                return
            if _runs_event_loop():
                deadline = deadline if deadline is not None else time.monotonic() + _LOOP_GRACE_S
                if not self._room.wait(deadline - time.monotonic()) and self._queued >= self._limit:
                    raise self._full()
            else:
                self._room.wait()

    _taker_waits = True  # whether the thread that takes the responses is another than the model's own

    def _full(self) -> ServingError:
        return UnavailableError(
            f"model '{self._model}' made more than {self._limit} responses to one request that its client has "
            f"not taken yet (--max-queued-responses), and a response sent from an event loop's thread cannot "
            f"wait for room: send from a thread of the model's, or raise --max-queued-responses")


def _runs_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class ResponseSender(_Sender):
    """Carries a decoupled request's responses from any thread to the waiting coroutine.

    ``send`` may be called from the model's own threads; responses are queued on the event loop
    that created the sender, in the order sent, at most ``limit`` of them not yet taken (then
    ``send`` waits: see :class:`_Sender`), and the stream ends after ``final``.
    """

    __slots__ = ("_loop", "_queue", "final_yielded", "_has_room")

    def __init__(self, model: str = "", limit: int = DEFAULT_CONNECTION_LIMITS.max_queued_responses) -> None:
        loop = self._loop = asyncio.get_running_loop()
        responses: asyncio.Queue[tuple[Result | None, bool]] = asyncio.Queue()
        self._queue = responses
        self._has_room = asyncio.Event()  # set as responses are taken (for :meth:`send_async`)
        # Whether the response :meth:`responses` yielded last came with the final flag.
        self.final_yielded = False

        def put(item: tuple[Result | None, bool]) -> None:  # not over self: no reference cycle per stream
            loop.call_soon_threadsafe(responses.put_nowait, item)

        super().__init__(put, model, limit)

    async def send_async(self, response: Result) -> None:
        """``send`` from a coroutine on the sender's own event loop (an ensemble's steps): past
        the bound it waits for the responses to be taken without stopping the loop."""
        while self._queued >= self._limit and not self._cancelled:
            self._has_room.clear()
            await self._has_room.wait()
        self.send(response)

    async def responses(self) -> Any:
        """The responses sent, in order, until the final flag."""
        while True:
            response, final = await self._queue.get()
            self._taken()
            self._has_room.set()
            if response is not None:
                self.final_yielded = final
                yield response
            if final:
                return


class BlockingSender(_Sender):
    """A :class:`ResponseSender` for a thread that waits for the responses itself (a model's
    call to itself, executed on its own thread): no event loop involved. What that execution
    sends on the calling thread itself (before the thread takes any) is not bounded: that
    thread cannot take them before its execution returns, and no client made them."""

    __slots__ = ("_queue", "final_yielded")
    _taker_waits = False

    def __init__(self, model: str = "", limit: int = DEFAULT_CONNECTION_LIMITS.max_queued_responses) -> None:
        self._queue: queue.SimpleQueue[tuple[Result | None, bool]] = queue.SimpleQueue()
        self.final_yielded = False  # as ResponseSender's
        super().__init__(self._queue.put, model, limit)

    def responses(self) -> Iterator[Result]:
        """The responses sent, in order, until the final flag."""
        while True:
            response, final = self._queue.get()
            self._taken()
            if response is not None:
                self.final_yielded = final
                yield response
            if final:
                return
