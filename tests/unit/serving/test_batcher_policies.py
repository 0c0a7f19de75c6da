"""DynamicBatcher: Triton's priority levels and queue policies (queue size, timeouts, REJECT and
DELAY), without Ray."""

from __future__ import annotations

import asyncio
import time

import pytest

from rayinfer.protocol.errors import UnavailableError
from rayinfer.repository.model_config import QueuePolicy
from rayinfer.serving.batcher import DynamicBatcher, QueueFullError
from test_batcher import Recorder, run
from waiting import wait_until_async


async def _blocked(batcher: DynamicBatcher, rec: Recorder) -> asyncio.Future:
    """A first request that is executing (held by ``rec``), so that later ones queue."""
    first = asyncio.ensure_future(batcher.submit(0))
    await wait_until_async(lambda: rec.batches == [[0]], "the first batch to start executing")
    return first


def test_a_higher_priority_request_overtakes_the_queued_lower_ones():
    async def main():
        rec = Recorder(hold=True)
        batcher = DynamicBatcher(rec, max_batch_size=1, priority_levels=3, default_priority_level=3)
        first = await _blocked(batcher, rec)
        low = [asyncio.ensure_future(batcher.submit(i, priority=3)) for i in (1, 2)]
        default = asyncio.ensure_future(batcher.submit(3))  # priority 0: the default level, 3
        high = asyncio.ensure_future(batcher.submit(9, priority=1))
        middle = asyncio.ensure_future(batcher.submit(5, priority=2))
        await wait_until_async(lambda: batcher.pending_requests == 5, "the later requests to be queued")
        rec.release.set()
        await asyncio.gather(first, *low, default, high, middle)
        return rec.batches

    assert run(main()) == [[0], [9], [5], [1], [2], [3]]


def test_a_priority_out_of_range_means_the_default_level():
    async def main():
        rec = Recorder(hold=True)
        batcher = DynamicBatcher(rec, max_batch_size=4, priority_levels=2, default_priority_level=2)
        first = await _blocked(batcher, rec)
        beyond = asyncio.ensure_future(batcher.submit(7, priority=99))
        high = asyncio.ensure_future(batcher.submit(1, priority=1))
        await wait_until_async(lambda: batcher.pending_requests == 2, "both requests to be queued")
        rec.release.set()
        await asyncio.gather(first, beyond, high)
        return rec.batches

    # One batch after the first: level 1's request leads it, the out-of-range one (level 2) follows.
    assert run(main()) == [[0], [1, 7]]


def test_without_priority_levels_a_request_priority_is_ignored():
    async def main():
        rec = Recorder(hold=True)
        batcher = DynamicBatcher(rec, max_batch_size=1)
        first = await _blocked(batcher, rec)
        later = [asyncio.ensure_future(batcher.submit(i, priority=p)) for i, p in ((1, 5), (2, 1))]
        await wait_until_async(lambda: batcher.pending_requests == 2, "both requests to be queued")
        rec.release.set()
        await asyncio.gather(first, *later)
        return rec.batches

    assert run(main()) == [[0], [1], [2]]


def test_a_full_queue_refuses_the_request_at_once():
    async def main():
        rec = Recorder(hold=True)
        batcher = DynamicBatcher(rec, max_batch_size=1, default_policy=QueuePolicy(max_queue_size=2))
        first = await _blocked(batcher, rec)
        queued = [asyncio.ensure_future(batcher.submit(i)) for i in (1, 2)]
        await wait_until_async(lambda: batcher.pending_requests == 2, "two requests to be queued")
        with pytest.raises(QueueFullError, match="^Exceeds maximum queue size$"):
            await batcher.submit(3)
        queued[0].cancel()  # a caller that went away frees its place
        await wait_until_async(queued[0].done, "the first queued caller to be cancelled")
        fourth = asyncio.ensure_future(batcher.submit(4))
        await wait_until_async(lambda: batcher.pending_requests == 2, "the fourth request to be queued")
        rec.release.set()
        await asyncio.gather(first, queued[1], fourth)
        return rec.batches

    assert run(main()) == [[0], [2], [4]]


def test_queue_sizes_are_per_priority_level():
    async def main():
        rec = Recorder(hold=True)
        batcher = DynamicBatcher(rec, max_batch_size=1, priority_levels=2, default_priority_level=2,
                                 level_policies={1: QueuePolicy(max_queue_size=1)})
        first = await _blocked(batcher, rec)
        high = asyncio.ensure_future(batcher.submit(1, priority=1))
        low = [asyncio.ensure_future(batcher.submit(i, priority=2)) for i in (2, 3)]
        await wait_until_async(lambda: batcher.pending_requests == 3, "the requests to be queued")
        with pytest.raises(QueueFullError):
            await batcher.submit(4, priority=1)
        rec.release.set()
        await asyncio.gather(first, high, *low)
        return rec.batches

    assert run(main()) == [[0], [1], [2], [3]]


def test_an_expired_request_is_rejected_without_running_and_reported():
    async def main():
        rec = Recorder(hold=True)
        rejected = []
        batcher = DynamicBatcher(rec, max_batch_size=1, on_reject=rejected.append,
                                 default_policy=QueuePolicy(default_timeout_us=20_000))
        first = await _blocked(batcher, rec)
        start = time.monotonic()
        with pytest.raises(UnavailableError, match="^Request timeout expired$"):
            await batcher.submit(1)
        waited = time.monotonic() - start
        assert batcher.pending_requests == 0
        rec.release.set()
        await first
        return rec.batches, rejected, waited

    batches, rejected, waited = run(main())
    assert batches == [[0]]  # never executed
    assert rejected == [1]
    assert 0.015 <= waited < 5.0  # answered when it expired, while the first batch still ran


def test_a_request_may_only_shorten_the_default_timeout_when_the_policy_allows_it():
    assert QueuePolicy(default_timeout_us=100, allow_timeout_override=True).timeout_us(40) == 40
    assert QueuePolicy(default_timeout_us=100, allow_timeout_override=True).timeout_us(400) == 100
    assert QueuePolicy(default_timeout_us=100, allow_timeout_override=False).timeout_us(40) == 100
    # Triton's rule: no default timeout, no timeout at all, whatever the request asks.
    assert QueuePolicy(default_timeout_us=0, allow_timeout_override=True).timeout_us(40) == 0

    async def main():
        rec = Recorder(hold=True)
        batcher = DynamicBatcher(rec, max_batch_size=1, default_policy=QueuePolicy(
            default_timeout_us=60_000_000, allow_timeout_override=True))
        first = await _blocked(batcher, rec)
        start = time.monotonic()
        with pytest.raises(UnavailableError, match="Request timeout expired"):
            await batcher.submit(1, timeout_us=20_000)
        rec.release.set()
        await first
        return time.monotonic() - start

    assert run(main()) < 30.0  # the request's 20 ms, not the default minute


def test_a_delayed_request_runs_after_its_levels_unexpired_requests():
    async def main():
        rec = Recorder(hold=True)
        batcher = DynamicBatcher(rec, max_batch_size=1, priority_levels=2, default_priority_level=1,
                                 level_policies={1: QueuePolicy(delay_on_timeout=True, default_timeout_us=60_000_000,
                                                                allow_timeout_override=True)})
        first = await _blocked(batcher, rec)
        late = asyncio.ensure_future(batcher.submit(1, priority=1, timeout_us=1_000))
        # The 1 ms timeout expires while the first batch holds the model.
        await wait_until_async(lambda: batcher._levels[1].delayed, "the first request to be delayed")
        on_time = asyncio.ensure_future(batcher.submit(2, priority=1))
        low = asyncio.ensure_future(batcher.submit(3, priority=2))
        await wait_until_async(lambda: batcher.pending_requests == 3, "the requests to be queued")
        rec.release.set()
        await asyncio.gather(first, late, on_time, low)
        return rec.batches

    # The delayed request still goes before the lower level's.
    assert run(main()) == [[0], [2], [1], [3]]
