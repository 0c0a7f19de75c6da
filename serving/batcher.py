"""Triton's dynamic batcher for one model instance, on the replica's event loop (no Ray).

Requests queue in arrival order; a batch is formed when the queued rows reach
``max_batch_size``, when they reach one of the ``preferred_batch_sizes`` (the batch is then cut at
the largest preferred size the queue can fill), or when the oldest request has waited
``max_queue_delay``. One batch executes at a time; requests arriving meanwhile form the next.
Batch size counts rows (the first dimension), not requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Generic, TypeVar
from collections.abc import Awaitable, Callable, Sequence

logger = logging.getLogger(__name__)

# uvloop (libuv) timers fire on whole milliseconds.
_TIMER_RESOLUTION_S = 0.001

T = TypeVar("T")
R = TypeVar("R")


class DynamicBatcher(Generic[T, R]):
    """Merges concurrent submissions into batches of rows and executes them one at a time."""

    def __init__(
        self,
        execute: Callable[[list[T]], Awaitable[Sequence[R]]],
        *,
        max_batch_size: int,
        max_queue_delay_s: float = 0.0,
        preferred_batch_sizes: Sequence[int] = (),
    ):
        self._execute = execute
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_s
        self.preferred_batch_sizes = tuple(sorted(preferred_batch_sizes))
        self._pending: deque[tuple[T, int, float, asyncio.Future]] = deque()
        self._queued_rows = 0
        self._arrived: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None

    @property
    def pending_requests(self) -> int:
        """Submissions waiting for a batch (not yet executing)."""
        return len(self._pending)

    async def submit(self, item: T, rows: int = 1) -> R:
        """Queue ``item`` (``rows`` rows, at most ``max_batch_size``) and wait for its result."""
        loop = asyncio.get_running_loop()
        if self._arrived is None:
            self._arrived = asyncio.Event()
        future = loop.create_future()
        self._pending.append((item, rows, time.monotonic(), future))
        self._queued_rows += rows
        self._arrived.set()
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._run())
        return await future

    def _should_dispatch(self) -> bool:
        if self._queued_rows >= self.max_batch_size:
            return True
        return bool(self.preferred_batch_sizes) and self._queued_rows >= self.preferred_batch_sizes[0]

    def _row_limit(self, expired: bool) -> int:
        """Rows to take: up to max_batch_size, or the largest reachable preferred size."""
        if expired or not self.preferred_batch_sizes or self._queued_rows >= self.max_batch_size:
            return self.max_batch_size
        reachable = [p for p in self.preferred_batch_sizes if p <= self._queued_rows]
        return reachable[-1] if reachable else self.max_batch_size

    def _take(self, limit: int) -> list[tuple[T, asyncio.Future]]:
        batch: list[tuple[T, asyncio.Future]] = []
        rows = 0
        while self._pending:
            item, item_rows, _, future = self._pending[0]
            if batch and rows + item_rows > limit:
                break
            self._pending.popleft()
            self._queued_rows -= item_rows
            if future.done():  # the caller went away (cancelled)
                continue
            batch.append((item, future))
            rows += item_rows
        return batch

    async def _run(self) -> None:
        # Deadlines use time.monotonic(): uvloop's loop.time() only advances in whole milliseconds.
        loop = asyncio.get_running_loop()
        arrived = self._arrived
        assert arrived is not None
        while True:
            while not self._pending:
                arrived.clear()
                await arrived.wait()
            deadline = self._pending[0][2] + self.max_queue_delay_s
            while not self._should_dispatch() and time.monotonic() < deadline:
                remaining = deadline - time.monotonic()
                if remaining < _TIMER_RESOLUTION_S:
                    # The loop's timers round up to whole milliseconds; a shorter wait is kept
                    # by yielding to the loop (which still serves I/O) until the deadline.
                    await asyncio.sleep(0)
                    continue
                arrived.clear()
                timer = loop.call_later(remaining - _TIMER_RESOLUTION_S, arrived.set)
                await arrived.wait()
                timer.cancel()
            batch = self._take(self._row_limit(time.monotonic() >= deadline))
            if batch:
                await self._dispatch(batch)

    async def _dispatch(self, batch: list[tuple[T, asyncio.Future]]) -> None:
        try:
            results = await self._execute([item for item, _ in batch])
        except Exception as exc:  # reported to every caller in the batch; the batcher lives on
            logger.exception("batch execution failed")
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), result in zip(batch, results):
            if not future.done():
                future.set_result(result)
