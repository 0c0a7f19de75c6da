"""Triton's sequence batcher for one model instance, on the replica's event loop (no Ray).

A stateful model's requests belong to sequences, named by their correlation id
(``sequence_id``); the first request of a sequence carries ``sequence_start``, the last
``sequence_end``. A sequence holds a *slot* from its start to its end (or until it has been idle
for ``max_sequence_idle_microseconds``); sequences that find every slot taken wait for one, in
arrival order. A batch holds at most one request of each sequence, and a sequence's requests
run in the order they came. A request's ``timeout`` (microseconds) bounds only that wait, as in
Triton's schedule policy for sequences: a sequence still without a slot when the earliest
deadline of its requests passes fails every request it holds (UNAVAILABLE) and is forgotten, so
its next request must START again.

- **direct**: ``max_batch_size`` slots, and a sequence's requests always run in its slot's row
  of the batch, so a model may keep its state per row. The batch has as many rows as the highest
  slot with a request; rows of slots with none carry READY false and zeros.
- **oldest**: ``max_candidate_sequences`` slots; a batch takes the oldest requests of up to
  ``max_batch_size`` sequences, rows in no fixed order (the model tells sequences apart by their
  CORRID control, or keeps its state in the implicit ``state`` tensors).

Either way the batcher gives each row the model's control inputs (START, END, READY, CORRID) and
its sequence's implicit state: the state outputs of the sequence's previous request, or the
initial state on a START.

With ``iterative_sequence``, each request is a sequence of its own, which its model may
*reschedule* (a Python model's ``set_release_flags``) to run again in a later batch, in the
same slot, until it completes: a request without a correlation id gets one (and START), a
rescheduled request runs again with neither START nor END, and the sequence ends when its
request completes, as Triton's iterative sequencer does.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rayinfer.adapters.model_runner import RESCHEDULED
from rayinfer.protocol.dtypes import numpy_dtype
from rayinfer.protocol.errors import InvalidArgError, ServingError, UnavailableError, as_serving_error
from rayinfer.repository.sequence_config import CorrelationId, SequenceSpec, sequence_flags

logger = logging.getLogger(__name__)

# Triton's message for the requests of a sequence whose wait for a slot timed out (UNAVAILABLE).
SEQUENCE_TIMEOUT_MESSAGE = "timeout of the corresponding sequence has been expired"


@dataclass(eq=False)
class _Pending:
    prepared: Any
    start: bool
    end: bool
    arrived: float
    future: asyncio.Future


@dataclass(eq=False)
class _Sequence:
    corrid: CorrelationId
    queue: deque[_Pending] = field(default_factory=deque)
    slot: int | None = None
    state: dict[str, np.ndarray] | None = None
    last_used: float = 0.0
    ended: bool = False  # its END request has come (a request after it must START again)
    # While it waits for a slot: when the earliest timeout of its requests runs out (loop time),
    # and the timer that fails it then.
    expires: float | None = None
    timer: asyncio.TimerHandle | None = None


class SequenceBatcher:
    """Queues the requests of a sequence model and executes them in batches, one at a time."""

    def __init__(self, execute: Callable[[list[Any]], Awaitable[Sequence[Any]]], spec: SequenceSpec, *,
                 model: str, max_batch_size: int, on_reject: Callable[[Any], None] | None = None) -> None:
        """``on_reject``: called with each request failed because its sequence's wait for a
        slot timed out."""
        self._execute = execute
        self._on_reject = on_reject
        self._spec = spec
        self._model = model
        self._batching = max_batch_size > 0
        self._max_rows = max(max_batch_size, 1)
        self._slots: list[_Sequence | None] = [None] * (spec.max_candidate_sequences or 1)
        self._sequences: dict[CorrelationId, _Sequence] = {}
        self._backlog: deque[_Sequence] = deque()
        self._idle_s = spec.max_sequence_idle_us / 1e6
        self._delay_s = spec.max_queue_delay_us / 1e6
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._running: list[_Pending] = []  # the requests of the batch executing now
        self._closed = False
        self._next_id = 1  # the next correlation id for an iterative request that has none

    @property
    def pending_requests(self) -> int:
        return sum(len(s.queue) for s in self._sequences.values())

    @property
    def active_sequences(self) -> int:
        return sum(1 for s in self._slots if s is not None)

    @property
    def open_sequences(self) -> int:
        """Sequences started here and not ended (holding a slot or waiting for one)."""
        return sum(1 for s in self._sequences.values() if not s.ended)

    def holds(self, corrid: CorrelationId) -> bool:
        """Whether a sequence with this correlation id runs here (started, not ended)."""
        sequence = self._sequences.get(corrid)
        return sequence is not None and not sequence.ended

    async def submit(self, prepared: Any) -> Any:
        """Queue one request of a sequence; returns its result once its batch has executed."""
        if self._closed:
            raise UnavailableError(f"model '{self._model}' is unloading")
        corrid, start, end = sequence_flags(prepared.request.parameters)
        if self._spec.iterative and (corrid == 0 or corrid == ""):
            corrid, start = self._new_id(), True
            _set_flags(prepared, start=True, end=end, corrid=corrid)
        self._check(corrid, start, prepared.rows)
        sequence = self._sequences.get(corrid)
        if sequence is None or (sequence.ended and not sequence.queue and start):
            sequence = self._sequences[corrid] = _Sequence(corrid)
            self._assign(sequence)
        elif sequence.ended and not start:
            raise self._not_started(corrid)
        sequence.ended = end
        now = time.monotonic()
        pending = _Pending(prepared, start, end, now, asyncio.get_running_loop().create_future())
        sequence.queue.append(pending)
        sequence.last_used = now
        timeout_us = prepared.request.parameters.get("timeout", 0)
        if timeout_us and sequence.slot is None:  # it waits for a slot: not longer than this
            self._expire_by(sequence, timeout_us / 1e6)
        self._ensure_running()
        self._wake.set()
        try:
            return await pending.future
        except asyncio.CancelledError:
            if pending in sequence.queue:  # not taken into a batch: it never runs
                sequence.queue.remove(pending)
                if pending.end:  # its END never came after all
                    sequence.ended = any(p.end for p in sequence.queue)
                if self._spec.iterative and not sequence.queue and pending not in self._running:
                    self._release(sequence)  # a rescheduled request given up: its sequence ends
            raise

    def _new_id(self) -> int:
        """A correlation id no sequence here holds (Triton counts from 1)."""
        while self._next_id in self._sequences:
            self._next_id += 1
        self._next_id += 1
        return self._next_id - 1

    def _check(self, corrid: CorrelationId, start: bool, rows: int) -> None:
        if corrid == 0 or corrid == "":
            raise InvalidArgError(f"inference request to model '{self._model}' must specify a non-zero or "
                                  "non-empty correlation ID")
        if self._batching and rows != 1:
            raise InvalidArgError(f"inference request to model '{self._model}' must specify batch-size 1 due "
                                  "to requirements of sequence batcher")
        if not start and corrid not in self._sequences:
            raise self._not_started(corrid)
        if start and corrid in self._sequences and not self._sequences[corrid].ended:
            logger.warning("model '%s': sequence %s started again before it ended; the model is given its "
                           "START and the sequence goes on", self._model, corrid)

    def _not_started(self, corrid: CorrelationId) -> ServingError:
        return InvalidArgError(f"inference request for sequence {corrid} to model '{self._model}' must specify "
                               "the START flag on the first request of the sequence")

    # ---- slots --------------------------------------------------------------------------------

    def _assign(self, sequence: _Sequence) -> None:
        """A free slot for a new sequence, else a place in the backlog."""
        for index, holder in enumerate(self._slots):
            if holder is None:
                self._slots[index] = sequence
                sequence.slot = index
                return
        self._backlog.append(sequence)

    def _release(self, sequence: _Sequence) -> None:
        """The sequence ended or went idle: its slot goes to the oldest waiting sequence."""
        if sequence.slot is None and sequence in self._backlog:  # given up before it had a slot
            self._backlog.remove(sequence)
        if sequence.slot is not None:
            index, sequence.slot = sequence.slot, None
            self._slots[index] = None
            if self._backlog:
                waiting = self._backlog.popleft()
                self._slots[index] = waiting
                waiting.slot = index
                waiting.last_used = time.monotonic()
                if waiting.timer is not None:  # it has its slot: its requests' timeouts no longer apply
                    waiting.timer.cancel()
                    waiting.expires = waiting.timer = None
        if self._sequences.get(sequence.corrid) is sequence:
            del self._sequences[sequence.corrid]

    def _reap(self, now: float) -> float | None:
        """Release the sequences idle for too long; the seconds until the next one may be."""
        soonest = None
        for sequence in list(self._slots):
            if sequence is None or sequence.queue:
                continue
            idle_until = sequence.last_used + self._idle_s
            if idle_until <= now:
                logger.debug("model '%s': sequence %s timed out after %.3f s idle; its slot is released",
                             self._model, sequence.corrid, self._idle_s)
                self._release(sequence)
            else:
                soonest = idle_until - now if soonest is None else min(soonest, idle_until - now)
        return soonest

    def _expire_by(self, sequence: _Sequence, delay_s: float) -> None:
        """Fail a waiting sequence in ``delay_s`` unless it has a slot by then (or an earlier
        deadline)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + delay_s
        if sequence.expires is not None and sequence.expires <= deadline:
            return
        if sequence.timer is not None:
            sequence.timer.cancel()
        sequence.expires = deadline
        sequence.timer = loop.call_at(deadline, self._expire, sequence)

    def _expire(self, sequence: _Sequence) -> None:
        """A sequence waited for a slot past its timeout: its requests fail, and it is forgotten."""
        sequence.timer = None
        if sequence.slot is not None or sequence not in self._backlog:
            return
        logger.debug("model '%s': sequence %s timed out waiting for a slot; its %d request(s) are rejected",
                     self._model, sequence.corrid, len(sequence.queue))
        self._backlog.remove(sequence)
        if self._sequences.get(sequence.corrid) is sequence:
            del self._sequences[sequence.corrid]
        while sequence.queue:
            pending = sequence.queue.popleft()
            if not pending.future.done():
                if self._on_reject is not None:
                    self._on_reject(pending.prepared)
                pending.future.set_exception(UnavailableError(SEQUENCE_TIMEOUT_MESSAGE))

    # ---- batches ------------------------------------------------------------------------------

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _ready(self) -> list[_Sequence]:
        return [s for s in self._slots if s is not None and s.queue]

    def _enough(self, ready: list[_Sequence]) -> bool:
        if self._spec.direct:  # Triton's rule: ready slots / max_batch_size
            return len(ready) / self._max_rows >= self._spec.minimum_slot_utilization or len(ready) == len(self._slots)
        count = min(len(ready), self._max_rows)
        return count >= self._max_rows or count in self._spec.preferred_batch_sizes

    async def _wait(self, timeout: float | None) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def _run(self) -> None:
        while self._sequences:
            next_idle = self._reap(time.monotonic())
            ready = self._ready()
            if not ready:
                await self._wait(next_idle)
                continue
            if self._delay_s > 0 and not self._enough(ready):
                deadline = min(s.queue[0].arrived for s in ready) + self._delay_s
                while (left := deadline - time.monotonic()) > 0 and not self._enough(ready):
                    await self._wait(left)
                    ready = self._ready()
                if not ready:
                    continue
            try:
                await self._run_batch(ready)
            except Exception as exc:  # the loop goes on; no request taken is left without an answer
                logger.exception("model '%s': a sequence batch failed", self._model)
                self._fail_running(exc)
            finally:
                self._running = []

    def _fail_running(self, exc: BaseException) -> None:
        for pending in self._running:
            if not pending.future.done():
                pending.future.set_exception(exc)

    async def _run_batch(self, ready: list[_Sequence]) -> None:
        if self._spec.direct:
            # One execution: requests that would execute apart (other shapes, outputs or
            # parameters) would lose their slot's row; they wait for a batch of their own.
            signature = min(ready, key=lambda s: s.slot or 0).queue[0].prepared.signature
            ready = [s for s in ready if s.queue[0].prepared.signature == signature]
            rows: list[tuple[_Sequence | None, _Pending | None]] = []
            highest = max(s.slot for s in ready if s.slot is not None)
            for index in range(min(highest + 1, self._max_rows)):
                holder = self._slots[index]
                taken = holder is not None and holder in ready
                rows.append((holder, holder.queue.popleft()) if taken and holder is not None else (None, None))
        else:
            oldest = sorted(ready, key=lambda s: s.queue[0].arrived)[:self._max_rows]
            rows = [(s, s.queue.popleft()) for s in oldest]
        self._running = [p for _, p in rows if p is not None]
        template = self._running[0].prepared
        batch = []
        for sequence, pending in rows:
            if pending is None:
                batch.append(self._padding(template))
            else:
                self._give_inputs(pending.prepared, sequence, pending.start, pending.end, True)
                batch.append(pending.prepared)
        try:
            results: Sequence[Any] = await self._execute(batch)
        except Exception as exc:  # noqa: BLE001 - every request gets the error
            results = [as_serving_error(exc)] * len(batch)
        now = time.monotonic()
        for (sequence, pending), prepared, result in zip(rows, batch, results):
            if sequence is None or pending is None:
                continue
            if self._spec.states and not isinstance(result, BaseException | ServingError):
                sequence.state = prepared.state_outputs or sequence.state
            sequence.last_used = now
            if result is RESCHEDULED and not pending.future.done():  # runs again, neither START nor END
                pending.start = pending.end = False
                pending.arrived = now
                _set_flags(pending.prepared, start=False, end=False)
                sequence.queue.append(pending)
                continue
            if (pending.end or self._spec.iterative) and not sequence.queue:
                self._release(sequence)
            if not pending.future.done():  # an error is the request's result, as from the dynamic batcher
                pending.future.set_result(result)

    def _give_inputs(self, prepared: Any, sequence: _Sequence | None, start: bool, end: bool, ready: bool) -> None:
        """The control inputs and the implicit state of one row."""
        shape = (1, 1) if self._batching else (1,)
        for control in self._spec.controls:
            if control.kind == "CORRID":  # an id of the other kind than the control's is given as 0 / ""
                strings = control.datatype == "BYTES"
                corrid = sequence.corrid if sequence is not None else None
                if strings:
                    text = corrid.encode() if isinstance(corrid, str) else b""
                    prepared.arrays[control.name] = np.full(shape, text, dtype=object)
                else:
                    prepared.arrays[control.name] = _integer_id(corrid if isinstance(corrid, int) else 0,
                                                                numpy_dtype(control.datatype), shape)
                continue
            flag = {"START": start, "END": end, "READY": ready}[control.kind]
            prepared.arrays[control.name] = np.full(shape, control.value(flag), dtype=numpy_dtype(control.datatype))
        for state in self._spec.states:
            held = None if start or sequence is None or sequence.state is None else sequence.state.get(state.output_name)
            value = state.initial_value() if held is None else held
            prepared.arrays[state.input_name] = value[None] if self._batching else value

    def _padding(self, template: Any) -> Any:
        """A row for a slot with no request (direct strategy): zeros, READY false."""
        padding = copy.copy(template)
        # Not the template's sequence: no correlation id or flags, no answer channel.
        padding.request = dataclasses.replace(template.request, id=None, parameters={})
        padding.sender = None if template.sender is None else _DISCARD
        padding.cancelled = False
        padding.arrays = {name: np.zeros_like(array) if array.dtype != object else np.full(array.shape, b"", object)
                          for name, array in template.arrays.items()}
        padding.padding = True
        padding.state_outputs = None
        self._give_inputs(padding, None, False, False, False)
        return padding

    def close(self) -> None:
        """Fail what is still queued or executing (the model is unloading); refuse new requests."""
        self._closed = True
        for sequence in self._backlog:
            if sequence.timer is not None:
                sequence.timer.cancel()
        self._fail_running(UnavailableError(f"model '{self._model}' is unloading"))
        for sequence in list(self._sequences.values()):
            while sequence.queue:
                pending = sequence.queue.popleft()
                if not pending.future.done():
                    pending.future.set_exception(UnavailableError(f"model '{self._model}' is unloading"))
        if self._task is not None:
            self._task.cancel()


def _set_flags(prepared: Any, *, start: bool, end: bool, corrid: CorrelationId | None = None) -> None:
    """Give the request the sequence flags (and id) the batcher set, as the model will see them."""
    parameters = dict(prepared.request.parameters, sequence_start=start, sequence_end=end)
    if corrid is not None:
        parameters["sequence_id"] = corrid
    prepared.request = dataclasses.replace(prepared.request, parameters=parameters)


class _Discard:
    """The response sender of a padding row of a decoupled model: its responses go nowhere."""

    def send(self, response: Any, final: bool = False) -> None:
        pass


_DISCARD = _Discard()


def _integer_id(corrid: int, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """An integer correlation id as the CORRID control's type holds it: its low bytes, as Triton
    copies them (a gRPC int64 id is taken as unsigned)."""
    bits = np.dtype(dtype).itemsize * 8
    unsigned = np.array(corrid % (1 << bits), dtype=f"uint{bits}")
    return np.full(shape, unsigned.view(dtype))
