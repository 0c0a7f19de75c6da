"""Waiting for a condition with a deadline, instead of sleeping for a guessed time.

A test that waits for something to happen polls the condition itself: it goes on as soon as
the condition holds, and when it never does, it fails with a message naming what it awaited
instead of failing later on an assertion about the state it assumed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """The awaited condition did not hold before the deadline."""


def wait_until(predicate: Callable[[], T], what: str, timeout_s: float = 60.0, interval_s: float = 0.2) -> T:
    """Call ``predicate`` every ``interval_s`` until it returns a true value, and return that value.

    Raises :class:`WaitTimeout` naming ``what`` (the awaited event, e.g. "'m' to be unloaded")
    when ``timeout_s`` passes first. Exceptions from ``predicate`` propagate.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


async def wait_until_async(predicate: Callable[[], T], what: str, timeout_s: float = 10.0,
                           interval_s: float = 0.001) -> T:
    """:func:`wait_until` for code on an event loop: the loop runs other tasks between checks."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(interval_s)
