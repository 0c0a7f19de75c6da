"""The executor contract: what the serving core needs from a loaded model version.

An executor validates a decoded request against its model (``prepare``) and runs batches of
prepared requests (``execute``, blocking, called off the event loop when executions are long).
Each request gets its own answer, never a batch-wide one:

- a non-decoupled executor returns one :class:`InferResponse` or :class:`ServingError` per
  request, in order (the ONNX Runtime runner, :class:`rayinfer.adapters.model_runner.ModelRunner`);
- a decoupled executor (``decoupled = True``) returns None and answers through each request's
  :class:`ResponseSender` (``prepared.sender``), zero to many responses and then ``final``,
  from any thread and possibly after ``execute`` returned.

Executors know nothing of Ray, HTTP or gRPC.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeAlias

from rayinfer.protocol.errors import ServingError
from rayinfer.protocol.statistics import ModelStatistics
from rayinfer.protocol.types import InferRequest, InferResponse
from rayinfer.repository.model_config import ModelSpec

Result: TypeAlias = "InferResponse | ServingError"


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
    """``send`` for both senders below: responses in order, nothing after ``final``."""

    __slots__ = ("closed", "_put")

    def __init__(self, put: Callable[[tuple[Result | None, bool]], object]) -> None:
        self.closed = False
        self._put = put

    def send(self, response: Result | None = None, final: bool = False) -> None:
        """Queue one response (or none, with ``final`` only); nothing may follow ``final``."""
        if self.closed:
            raise ServingError("a response was sent after the final flag")
        self.closed = final
        self._put((response, final))


class ResponseSender(_Sender):
    """Carries a decoupled request's responses from any thread to the waiting coroutine.

    ``send`` may be called from the model's own threads; responses are queued on the event loop
    that created the sender, in the order sent, and the stream ends after ``final``.
    """

    __slots__ = ("_loop", "_queue", "final_yielded")

    def __init__(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        responses: asyncio.Queue[tuple[Result | None, bool]] = asyncio.Queue()
        self._queue = responses
        # Whether the response :meth:`responses` yielded last came with the final flag.
        self.final_yielded = False

        def put(item: tuple[Result | None, bool]) -> None:  # not over self: no reference cycle per stream
            loop.call_soon_threadsafe(responses.put_nowait, item)

        super().__init__(put)

    async def responses(self) -> Any:
        """The responses sent, in order, until the final flag."""
        while True:
            response, final = await self._queue.get()
            if response is not None:
                self.final_yielded = final
                yield response
            if final:
                return


class BlockingSender(_Sender):
    """A :class:`ResponseSender` for a thread that waits for the responses itself (a model's
    call to itself, executed on its own thread): no event loop involved."""

    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Result | None, bool]] = queue.SimpleQueue()
        super().__init__(self._queue.put)

    def responses(self) -> Iterator[Result]:
        """The responses sent, in order, until the final flag."""
        while True:
            response, final = self._queue.get()
            if response is not None:
                yield response
            if final:
                return
