"""Fixtures of the front's unit tests."""

from __future__ import annotations

import asyncio
import threading

import pytest


@pytest.fixture(scope="module")
def loop():
    """An event loop in a thread of its own, for the stand-in replicas' listeners."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
