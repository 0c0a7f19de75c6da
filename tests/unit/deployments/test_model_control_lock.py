"""Model control's exclusion (deployments/v2_api.py: ModelControlLock): unloads of different
models run together, a load runs alone, and one model is unloaded once at a time."""

from __future__ import annotations

import asyncio

from rayinfer.deployments.v2_api import ModelControlLock
from waiting import wait_until_async


def test_unloads_run_together_and_a_load_waits_for_them():
    async def scenario() -> None:
        lock = ModelControlLock()
        running: set[str] = set()
        most = 0
        order: list[str] = []

        release = asyncio.Event()  # the unloads' work ends when the test sets it

        async def unload(model: str) -> None:
            nonlocal most
            async with lock.unloading(model):
                running.add(model)
                most = max(most, len(running))
                await asyncio.wait_for(release.wait(), 10)
                running.discard(model)
                order.append(f"unloaded {model}")

        async def load(model: str) -> None:
            async with lock.loading():
                assert not running  # alone
                order.append(f"loaded {model}")

        unloads = [asyncio.create_task(unload(m)) for m in ("a", "b", "c")]
        await wait_until_async(lambda: len(running) == 3, "the three unloads to run together")
        loading = asyncio.create_task(load("d"))
        await asyncio.sleep(0)  # the load reaches the lock, held by the unloads
        assert "loaded d" not in order
        release.set()
        await asyncio.gather(loading, *unloads)
        assert most == 3 and order[-1] == "loaded d"
        # The same model twice: one after the other.
        most, release = 0, asyncio.Event()
        twice = [asyncio.create_task(unload("a")) for _ in range(2)]
        await wait_until_async(lambda: len(running) == 1, "the first unload of 'a' to run")
        await asyncio.sleep(0)  # the second reaches the lock
        assert most == 1
        release.set()
        await asyncio.gather(*twice)
        assert most == 1

    asyncio.run(scenario())
