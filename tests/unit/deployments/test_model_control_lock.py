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

        async def unload(model: str) -> None:
            nonlocal most
            async with lock.unloading(model):
                running.add(model)
                most = max(most, len(running))
                await asyncio.sleep(0.05)  # the unload's work, long enough for the others to start
                running.discard(model)
                order.append(f"unloaded {model}")

        async def load(model: str) -> None:
            async with lock.loading():
                assert not running  # alone
                order.append(f"loaded {model}")

        unloads = [asyncio.create_task(unload(m)) for m in ("a", "b", "c")]
        await wait_until_async(lambda: len(running) == 3, "the three unloads to run together")
        await asyncio.gather(load("d"), *unloads)
        assert most == 3 and order[-1] == "loaded d"
        # The same model twice: one after the other.
        most = 0
        await asyncio.gather(unload("a"), unload("a"))
        assert most == 1

    asyncio.run(scenario())
