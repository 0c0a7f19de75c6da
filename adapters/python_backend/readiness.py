"""A Python model's own readiness check (``is_ready()``, sync or ``async def``), by Triton's rules.

The check runs when a client asks whether the model is ready. It must return a bool: False, an
exception or any other value means not ready (logged), and so does a check that has not answered
within :data:`READY_TIMEOUT_S`; such a check goes on running, and the next question waits for it
rather than starting another. Inference does not depend on it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# Triton's kUserModelReadinessTimeoutMs.
READY_TIMEOUT_S = 5.0


class ReadinessCheck:
    """Asks one model's ``is_ready`` at most once at a time."""

    def __init__(self, model: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        self._model = model
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{model}-is-ready")
        self._running: concurrent.futures.Future | None = None

    def ask(self, check: Callable[[], Any]) -> bool:
        """Whether the model says it is ready (blocks up to the timeout)."""
        with self._lock:
            if self._running is None or self._running.done():
                self._running = self._pool.submit(self._answer, check)
            running = self._running
        try:
            return running.result(timeout=self._timeout_s)
        except concurrent.futures.TimeoutError:
            logger.warning("model '%s': is_ready did not answer within %.0f s: not ready", self._model,
                           self._timeout_s)
            return False

    def _answer(self, check: Callable[[], Any]) -> bool:
        try:
            ready = check()
        except Exception as exc:
            logger.warning("model '%s': is_ready raised %s: %s: not ready", self._model, type(exc).__name__, exc)
            return False
        if not isinstance(ready, bool):
            logger.warning("model '%s': is_ready returned %s, not a bool: not ready", self._model,
                           type(ready).__name__)
            return False
        return ready
