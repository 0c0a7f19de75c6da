"""A non-decoupled Python model's answer sent through its request's response sender.

Triton lets a non-decoupled model answer a request with ``request.get_response_sender()``
instead of ``execute``'s return value: exactly one response, before ``execute`` returns or after
(from a thread of the model's). The first response sent is the request's answer.
"""

from __future__ import annotations

import threading
from typing import Any

from rayinfer.adapters.model_runner import LateAnswer


class SenderAnswer:
    """What the sender of one request sent: its result, once sent (from any thread)."""

    __slots__ = ("_lock", "result", "_late")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.result: Any = None
        self._late: LateAnswer | None = None

    def sent(self, result: Any) -> None:
        """The sender's one response (the sender refuses a second)."""
        with self._lock:
            self.result = result
            late = self._late
        if late is not None:
            late.set(result)

    def after_return(self) -> Any:
        """The request's result once ``execute`` returned None for it: the response it sent,
        or a LateAnswer that the response will complete."""
        with self._lock:
            if self.result is not None:
                return self.result
            self._late = LateAnswer()
            return self._late
