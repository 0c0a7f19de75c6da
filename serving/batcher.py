"""Triton's dynamic batcher for one model instance, on the replica's event loop (no Ray).

Requests queue in arrival order; a batch is formed when the queued rows reach
``max_batch_size``, when they reach one of the ``preferred_batch_sizes`` (the batch is then cut at
the largest preferred size the queue can fill), or when the oldest request has waited
``max_queue_delay``. One batch executes at a time; requests arriving meanwhile form the next.
Batch size counts rows (the first dimension), not requests.

With priority levels, each level has its own queue and queue policy, and a batch takes the
requests of level 1 (the highest) first, then level 2, and so on. A policy may bound its queue
(a request that finds it full is refused) and give requests a timeout: one still queued when it
expires is rejected, or, with the DELAY action, moved behind the level's requests that have not
expired.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections import deque
from typing import Generic, TypeVar
from collections.abc import Awaitable, Callable, Sequence

from rayinfer.protocol.errors import UnavailableError
from rayinfer.repository.model_config import QueuePolicy

logger = logging.getLogger(__name__)

# uvloop (libuv) timers fire on whole milliseconds.
_TIMER_RESOLUTION_S = 0.001
# Triton's message for a request whose queue timeout expired (UNAVAILABLE).
TIMEOUT_MESSAGE = "Request timeout expired"

T = TypeVar("T")
R = TypeVar("R")


class QueueFullError(Exception):
    """A request found its priority level's queue at ``max_queue_size`` (the serving core answers
    it with Triton's UNAVAILABLE error, naming the request)."""


class _Entry:
    """One queued submission."""

    __slots__ = ("item", "rows", "arrived", "future", "timer", "level")

    def __init__(self, item: object, rows: int, arrived: float, future: asyncio.Future, level: _Level) -> None:
        self.item = item
        self.rows = rows
        self.arrived = arrived
        self.future = future
        self.timer: asyncio.TimerHandle | None = None
        self.level = level


class _Level:
    """One priority level: its policy, its queue, and its requests delayed past their timeout."""

    __slots__ = ("policy", "queue", "delayed")

    def __init__(self, policy: QueuePolicy) -> None:
        self.policy = policy
        self.queue: deque[_Entry] = deque()
        self.delayed: deque[_Entry] = deque()


class DynamicBatcher(Generic[T, R]):
    """Merges concurrent submissions into batches of rows and executes them one at a time."""

    def __init__(
        self,
        execute: Callable[[list[T]], Awaitable[Sequence[R]]],
        *,
        max_batch_size: int,
        max_queue_delay_s: float = 0.0,
        preferred_batch_sizes: Sequence[int] = (),
        priority_levels: int = 0,
        default_priority_level: int = 0,
        default_policy: QueuePolicy = QueuePolicy(),
        level_policies: dict[int, QueuePolicy] | None = None,
        on_reject: Callable[[T], None] | None = None,
    ):
        """``priority_levels``: 0 for one queue, else levels 1 (highest) to that; a request's
        priority 0 or out of range means ``default_priority_level``. ``on_reject``: called with
        each request rejected because its queue timeout expired."""
        self._execute = execute
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_s
        self.preferred_batch_sizes = tuple(sorted(preferred_batch_sizes))
        self.priority_levels = priority_levels
        self.default_priority_level = default_priority_level if priority_levels else 0
        self._default_policy = default_policy
        self._level_policies = dict(level_policies or {}) if priority_levels else {}
        self._on_reject = on_reject
        self._levels: dict[int, _Level] = {}
        self._order: list[int] = []  # the levels' numbers, highest priority (lowest number) first
        self._count = 0
        self._queued_rows = 0
        self._arrived: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None

    @property
    def pending_requests(self) -> int:
        """Submissions waiting for a batch (not yet executing)."""
        return self._count

    def _level(self, priority: int) -> _Level:
        number = priority if 0 < priority <= self.priority_levels else self.default_priority_level
        level = self._levels.get(number)
        if level is None:
            level = self._levels[number] = _Level(self._level_policies.get(number, self._default_policy))
            bisect.insort(self._order, number)
        return level

    async def submit(self, item: T, rows: int = 1, priority: int = 0, timeout_us: int = 0) -> R:
        """Queue ``item`` (``rows`` rows, at most ``max_batch_size``) and wait for its result.

        ``priority`` and ``timeout_us`` are the request's own (0: the defaults). Raises
        :class:`QueueFullError` when the level's queue is full, and Triton's UNAVAILABLE error
        when the request's queue timeout expires before it is batched."""
        loop = asyncio.get_running_loop()
        if self._arrived is None:
            self._arrived = asyncio.Event()
        level = self._level(priority)
        policy = level.policy
        if policy.max_queue_size and len(level.queue) + len(level.delayed) >= policy.max_queue_size:
            self._forget_gone(level)
            if len(level.queue) + len(level.delayed) >= policy.max_queue_size:
                raise QueueFullError("Exceeds maximum queue size")
        future = loop.create_future()
        entry = _Entry(item, rows, time.monotonic(), future, level)
        level.queue.append(entry)
        self._count += 1
        self._queued_rows += rows
        timeout = policy.timeout_us(timeout_us)
        if timeout:
            entry.timer = loop.call_later(timeout / 1e6, self._expire, entry)
        self._arrived.set()
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._run())
        return await future

    def _expire(self, entry: _Entry) -> None:
        """A queued request's timeout expired: delay it behind its level's other requests, or
        reject it."""
        entry.timer = None
        level = entry.level
        try:
            level.queue.remove(entry)  # by identity: entries define no equality
        except ValueError:  # already taken into a batch
            return
        if level.policy.delay_on_timeout:
            level.delayed.append(entry)
            return
        self._forget(entry)
        if not entry.future.done():
            entry.future.set_exception(UnavailableError(TIMEOUT_MESSAGE))
            if self._on_reject is not None:
                self._on_reject(entry.item)  # type: ignore[arg-type]

    def _forget_gone(self, level: _Level) -> None:
        """Drop a level's queued requests whose callers went away (before judging it full)."""
        for queue in (level.queue, level.delayed):
            for entry in [e for e in queue if e.future.done()]:
                queue.remove(entry)
                self._forget(entry)

    def _forget(self, entry: _Entry) -> None:
        """Account for an entry that left its queue."""
        self._count -= 1
        self._queued_rows -= entry.rows
        if entry.timer is not None:
            entry.timer.cancel()

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

    def _oldest(self) -> float:
        """When the longest-waiting queued request arrived."""
        return min(q[0].arrived for n in self._order for q in (self._levels[n].queue, self._levels[n].delayed) if q)

    def _take(self, limit: int) -> list[tuple[T, asyncio.Future]]:
        """The next batch: whole requests in priority order, up to ``limit`` rows."""
        batch: list[tuple[T, asyncio.Future]] = []
        rows = 0
        for number in self._order:
            level = self._levels[number]
            for queue in (level.queue, level.delayed):
                while queue:
                    entry = queue[0]
                    if batch and rows + entry.rows > limit:
                        return batch
                    queue.popleft()
                    self._forget(entry)
                    if entry.future.done():  # the caller went away (cancelled)
                        continue
                    batch.append((entry.item, entry.future))  # type: ignore[arg-type]
                    rows += entry.rows
        return batch

    async def _run(self) -> None:
        # Deadlines use time.monotonic(): uvloop's loop.time() only advances in whole milliseconds.
        loop = asyncio.get_running_loop()
        arrived = self._arrived
        assert arrived is not None
        while True:
            while not self._count:
                arrived.clear()
                await arrived.wait()
            deadline = self._oldest() + self.max_queue_delay_s
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

