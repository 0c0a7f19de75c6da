"""The sequence batcher on its own event loop, with an execute function that records each batch
(no Ray, no model): slots and padding rows, the backlog, the oldest strategy, control inputs,
implicit state, idle release, cancellation and Triton's request errors."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from rayinfer.adapters.model_runner import PreparedRequest
from rayinfer.protocol.errors import InvalidArgError
from rayinfer.protocol.types import InferInput, InferRequest
from rayinfer.repository.sequence_config import ControlSpec, SequenceSpec, StateSpec
from rayinfer.serving.sequencer import SequenceBatcher
from waiting import wait_until_async

CONTROLS = (ControlSpec("START", "START", "INT32"), ControlSpec("END", "END", "INT32"),
            ControlSpec("READY", "READY", "INT32"), ControlSpec("CORRID", "CORRID", "UINT64"))
STATE = StateSpec("ACC_IN", "ACC_OUT", "INT32", (1,))


def _request(sequence_id: Any, value: int, start: bool = False, end: bool = False, rows: int = 1) -> PreparedRequest:
    data = np.full((rows, 1), value, np.int32)
    request = InferRequest(model_name="m", model_version="", id=None, inputs=[InferInput("INPUT", "INT32", data.shape, data)],
                           outputs=None, parameters={"sequence_id": sequence_id, "sequence_start": start, "sequence_end": end})
    return PreparedRequest(request=request, arrays={"INPUT": data}, rows=rows, output_names=("OUTPUT",),
                           signature=(), arrival_ns=0)


class Recorder:
    """Executes batches like an accumulator model with implicit state: ACC_OUT = (START ? 0 :
    ACC_IN) + INPUT where READY, and records each batch's rows as (READY, START, END, CORRID)."""

    def __init__(self, gate: asyncio.Event | None = None) -> None:
        self.batches: list[list[tuple[int, int, int, int]]] = []
        self.gate = gate
        self.padding_parameters: list[dict] = []  # the request parameters of each padding row

    async def __call__(self, batch: list[PreparedRequest]) -> list[Any]:
        if self.gate is not None:
            await self.gate.wait()
        self.batches.append([tuple(int(p.arrays[n][0, 0]) for n in ("READY", "START", "END", "CORRID")) for p in batch])
        results = []
        self.padding_parameters += [p.request.parameters for p in batch if p.padding]
        for p in batch:
            acc = (0 if p.arrays["START"][0, 0] else p.arrays["ACC_IN"][0, 0]) + p.arrays["INPUT"][0, 0]
            p.state_outputs = {"ACC_OUT": np.array([acc], np.int32)}
            results.append(int(acc))
        return results


def _batcher(recorder: Recorder, **spec: Any) -> SequenceBatcher:
    spec.setdefault("max_candidate_sequences", 2)
    return SequenceBatcher(recorder, SequenceSpec(controls=CONTROLS, states=(STATE,), **spec), model="m", max_batch_size=2)


async def _sequence(batcher: SequenceBatcher, sequence_id: Any, values: list[int]) -> list[int]:
    return [await batcher.submit(_request(sequence_id, v, i == 0, i == len(values) - 1)) for i, v in enumerate(values)]


def test_each_sequence_keeps_its_own_state_and_a_third_waits_for_a_slot() -> None:
    async def main() -> tuple[list[list[int]], Recorder]:
        recorder = Recorder()
        batcher = _batcher(recorder)
        results = await asyncio.gather(*(_sequence(batcher, sid, [sid, 1, 1]) for sid in (10, 20, 30)))
        return list(results), recorder

    results, recorder = asyncio.run(main())
    assert results == [[10, 11, 12], [20, 21, 22], [30, 31, 32]]
    # Two slots: sequence 30 runs only once one of the others ended, in the slot it freed.
    first_rows = {row[3] for batch in recorder.batches[:3] for row in batch}
    assert 30 not in first_rows
    assert all(len(batch) <= 2 for batch in recorder.batches)


def test_direct_rows_are_slots_and_an_empty_slot_gets_a_padding_row() -> None:
    async def main() -> Recorder:
        gate = asyncio.Event()
        recorder = Recorder(gate)
        batcher = _batcher(recorder)
        first = asyncio.ensure_future(batcher.submit(_request(1, 5, start=True)))
        await wait_until_async(lambda: batcher.pending_requests == 0 or batcher.active_sequences == 1,
                               "the first sequence to take slot 0")
        second = asyncio.ensure_future(batcher.submit(_request(2, 7, start=True)))
        gate.set()
        await asyncio.gather(first, second)
        # Slot 0's sequence sends nothing now: the next batch of slot 1 carries a padding row 0.
        await batcher.submit(_request(2, 1, end=True))
        return recorder

    recorder = asyncio.run(main())
    rows = [row for batch in recorder.batches for row in batch]
    assert (1, 1, 0, 1) in rows and (1, 1, 0, 2) in rows
    assert recorder.batches[-1] == [(0, 0, 0, 0), (1, 0, 1, 2)]
    assert recorder.padding_parameters == [{}]  # a padding row claims no sequence


def test_oldest_strategy_takes_the_oldest_request_of_each_sequence_without_padding() -> None:
    async def main() -> tuple[list[int], Recorder]:
        gate = asyncio.Event()
        recorder = Recorder(gate)
        batcher = _batcher(recorder, direct=False)
        a = asyncio.ensure_future(_sequence(batcher, 1, [1, 2, 3]))
        b = asyncio.ensure_future(_sequence(batcher, 2, [10]))
        await wait_until_async(lambda: batcher.pending_requests == 0 and batcher.active_sequences == 2,
                               "both sequences to have their first request taken")
        gate.set()
        return [*(await a), *(await b)], recorder

    results, recorder = asyncio.run(main())
    assert results == [1, 3, 6, 10]
    assert all(row[0] == 1 for batch in recorder.batches for row in batch)  # READY in every row
    assert recorder.batches[0] == [(1, 1, 0, 1), (1, 1, 1, 2)]


def test_requests_that_break_the_sequence_rules_get_tritons_errors() -> None:
    async def main() -> list[str]:
        batcher = _batcher(Recorder())
        messages = []
        for request in (_request(0, 1, start=True), _request("", 1, start=True), _request(5, 1),
                        _request(6, 1, start=True, rows=2)):
            with pytest.raises(InvalidArgError) as caught:
                await batcher.submit(request)
            messages.append(caught.value.message)
        return messages

    messages = asyncio.run(main())
    assert messages[0] == messages[1] == "inference request to model 'm' must specify a non-zero or non-empty correlation ID"
    assert messages[2] == ("inference request for sequence 5 to model 'm' must specify the START flag on the first "
                           "request of the sequence")
    assert messages[3] == "inference request to model 'm' must specify batch-size 1 due to requirements of sequence batcher"


def test_an_idle_sequence_loses_its_slot_and_must_start_again() -> None:
    async def main() -> str:
        batcher = _batcher(Recorder(), max_sequence_idle_us=50_000)
        assert await batcher.submit(_request("s", 4, start=True)) == 4
        await wait_until_async(lambda: batcher.active_sequences == 0, "the idle sequence to be released", timeout_s=5)
        with pytest.raises(InvalidArgError) as caught:
            await batcher.submit(_request("s", 1))
        return caught.value.message

    assert "sequence s to model 'm' must specify the START flag" in asyncio.run(main())


def test_a_cancelled_request_leaves_its_queue_without_running() -> None:
    async def main() -> Recorder:
        gate = asyncio.Event()
        recorder = Recorder(gate)
        batcher = _batcher(recorder)
        first = asyncio.ensure_future(batcher.submit(_request(1, 1, start=True)))
        await wait_until_async(lambda: batcher.pending_requests == 0, "the first request to be taken")
        queued = asyncio.ensure_future(batcher.submit(_request(1, 100)))
        await wait_until_async(lambda: batcher.pending_requests == 1, "the second request to queue")
        queued.cancel()
        await wait_until_async(lambda: batcher.pending_requests == 0, "the cancelled request to leave")
        gate.set()
        await first
        assert await batcher.submit(_request(1, 2, end=True)) == 3  # 1 + 2: the cancelled 100 never ran
        return recorder

    recorder = asyncio.run(main())
    assert sum(len(batch) for batch in recorder.batches) == 2


def test_a_timeout_bounds_only_the_wait_for_a_slot() -> None:
    """Triton's schedule policy for sequences: a sequence still without a slot when its request's
    timeout passes fails every request it holds (UNAVAILABLE), is rejected, and must START again;
    a sequence that holds a slot is not affected by its requests' timeouts."""
    from rayinfer.protocol.errors import UnavailableError
    from rayinfer.serving.sequencer import SEQUENCE_TIMEOUT_MESSAGE

    def timed(sequence_id: int, value: int, timeout_us: int, **flags: bool) -> PreparedRequest:
        prepared = _request(sequence_id, value, **flags)
        prepared.request.parameters["timeout"] = timeout_us
        return prepared

    async def main() -> tuple[list[Any], list[PreparedRequest], int]:
        rejected: list[PreparedRequest] = []
        batcher = SequenceBatcher(Recorder(), SequenceSpec(controls=CONTROLS, states=(STATE,), max_candidate_sequences=2,
                                                           max_sequence_idle_us=60_000_000),
                                  model="m", max_batch_size=2, on_reject=rejected.append)
        # Two sequences take both slots and stay open (a timeout on a slot holder does nothing).
        assert await batcher.submit(timed(1, 1, 1_000, start=True)) == 1
        assert await batcher.submit(_request(2, 2, start=True)) == 2
        waiting = [asyncio.ensure_future(batcher.submit(timed(3, 3, 50_000, start=True))),
                   asyncio.ensure_future(batcher.submit(_request(3, 4)))]
        outcomes = await asyncio.gather(*waiting, return_exceptions=True)
        # Sequence 3 is forgotten: its next request without START gets Triton's error.
        with pytest.raises(InvalidArgError, match="must specify the START flag"):
            await batcher.submit(_request(3, 5))
        # The slot holders run on, long past their own requests' timeouts (1 ms for sequence 1).
        late = await batcher.submit(_request(1, 10, end=True))
        return outcomes, rejected, late

    outcomes, rejected, late = asyncio.run(main())
    assert all(isinstance(o, UnavailableError) and o.message == SEQUENCE_TIMEOUT_MESSAGE for o in outcomes)
    assert [int(p.arrays["INPUT"][0, 0]) for p in rejected] == [3, 4]
    assert late == 11


def test_a_waiting_sequence_given_a_slot_in_time_runs() -> None:
    async def main() -> list[int]:
        batcher = SequenceBatcher(Recorder(), SequenceSpec(controls=CONTROLS, states=(STATE,), max_candidate_sequences=1),
                                  model="m", max_batch_size=2)
        assert await batcher.submit(_request(1, 1, start=True)) == 1
        waiting = _request(2, 5, start=True, end=True)
        waiting.request.parameters["timeout"] = 10_000_000  # 10 s: the slot frees long before
        second = asyncio.ensure_future(batcher.submit(waiting))
        first_end = await batcher.submit(_request(1, 1, end=True))
        return [first_end, await second]

    assert asyncio.run(main()) == [2, 5]


def test_integer_ids_fill_the_corrid_type_as_triton_copies_them() -> None:
    from rayinfer.serving.sequencer import _integer_id

    assert _integer_id(-1 + (1 << 64), np.uint64, (1, 1)).tolist() == [[(1 << 64) - 1]]
    assert _integer_id((1 << 40) + 7, np.int32, (1,)).tolist() == [7]  # the low four bytes


def test_close_answers_the_running_batch_and_refuses_new_requests() -> None:
    async def main() -> tuple[Any, str]:
        gate = asyncio.Event()  # never set: the batch stays executing
        batcher = _batcher(Recorder(gate))
        running = asyncio.ensure_future(batcher.submit(_request(1, 1, start=True)))
        await wait_until_async(lambda: batcher.pending_requests == 0 and batcher.active_sequences == 1,
                               "the request to execute")
        batcher.close()
        with pytest.raises(Exception) as refused:
            await batcher.submit(_request(2, 1, start=True))
        with pytest.raises(Exception) as failed:
            await running
        return failed.value, refused.value.message

    failed, refused = asyncio.run(main())
    assert "is unloading" in str(failed) and refused == "model 'm' is unloading"


def test_direct_rows_with_other_signatures_wait_for_their_own_batch() -> None:
    async def main() -> Recorder:
        recorder = Recorder()
        batcher = _batcher(recorder)
        first, second = _request(1, 1, start=True), _request(2, 2, start=True)
        second.signature = ("other outputs",)
        await asyncio.gather(batcher.submit(first), batcher.submit(second))
        return recorder

    recorder = asyncio.run(main())
    # Sequence 2 keeps row 1 in a batch of its own, with a padding row 0.
    assert recorder.batches == [[(1, 1, 0, 1)], [(0, 0, 0, 0), (1, 1, 0, 2)]]


def test_oldest_waits_out_its_queue_delay_for_a_preferred_batch() -> None:
    """With a queue delay, the oldest strategy holds its first request until the batch reaches a
    preferred size (here 2: both sequences in one batch), not longer than the delay."""
    async def main() -> Recorder:
        recorder = Recorder()
        batcher = _batcher(recorder, direct=False, max_queue_delay_us=5_000_000, preferred_batch_sizes=(2,))
        first = asyncio.ensure_future(batcher.submit(_request(1, 1, start=True, end=True)))
        await wait_until_async(lambda: batcher.pending_requests == 1, "the first request to queue")
        await batcher.submit(_request(2, 2, start=True, end=True))
        await first
        return recorder

    assert [len(batch) for batch in asyncio.run(main()).batches] == [2]


def test_direct_waits_for_its_minimum_slot_utilization_until_the_delay_expires() -> None:
    async def main() -> tuple[Recorder, float]:
        recorder = Recorder()
        batcher = _batcher(recorder, max_queue_delay_us=200_000, minimum_slot_utilization=1.0)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await batcher.submit(_request(1, 1, start=True, end=True))  # one of two slots: waits out the delay
        return recorder, loop.time() - start

    recorder, waited = asyncio.run(main())
    assert recorder.batches == [[(1, 1, 1, 1)]] and waited >= 0.19


def test_iterative_requests_get_an_id_run_again_when_rescheduled_and_end_their_sequence():
    """iterative_sequence: a request without an id gets one and START; each time the model
    reschedules it, it runs again in its slot with neither START nor END; once answered, its
    sequence has ended (its slot is free; ids count on, as Triton's do)."""
    from rayinfer.adapters.model_runner import RESCHEDULED

    runs: list[tuple[Any, bool, bool, int]] = []  # (id the model saw, START, END, slot row)

    async def countdown(batch: list[PreparedRequest]) -> list[Any]:
        results = []
        for row, p in enumerate(batch):
            if p.padding:
                results.append(None)
                continue
            parameters = p.request.parameters
            runs.append((parameters["sequence_id"], parameters["sequence_start"], parameters["sequence_end"], row))
            left = p.arrays["INPUT"][0, 0] - 1
            p.arrays["INPUT"] = np.full((1, 1), left, np.int32)
            results.append(RESCHEDULED if left > 0 else "done")
        return results

    async def scenario() -> None:
        batcher = SequenceBatcher(countdown, SequenceSpec(iterative=True), model="m", max_batch_size=2)
        first, second = _request(0, 3), _request(0, 2)
        assert await asyncio.gather(batcher.submit(first), batcher.submit(second)) == ["done", "done"]
        by_id: dict[Any, list[tuple[bool, bool, int]]] = {}
        for corrid, start, end, row in runs:
            by_id.setdefault(corrid, []).append((start, end, row))
        assert sorted(by_id) == [1, 2]
        assert [len(by_id[1]), len(by_id[2])] == [3, 2]
        for flags in by_id.values():  # START once, then neither; always the same slot's row
            assert [(s, e) for s, e, _ in flags] == [(True, False)] + [(False, False)] * (len(flags) - 1)
            assert len({row for _, _, row in flags}) == 1
        assert batcher.active_sequences == 0 and batcher.pending_requests == 0
        assert await batcher.submit(_request(0, 1)) == "done" and runs[-1][:3] == (3, True, False)
        own = _request(77, 2, start=True)  # an id of the client's own is kept
        assert await batcher.submit(own) == "done" and [r[0] for r in runs[-2:]] == [77, 77]
        with pytest.raises(InvalidArgError, match="must specify the START flag"):  # its sequence ended
            await batcher.submit(_request(77, 1))

    asyncio.run(scenario())
