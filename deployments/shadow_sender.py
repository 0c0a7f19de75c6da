"""A stable version's replica sending a share of its answered requests to a rollout's candidate
too (:mod:`rayinfer.serving.shadow`): one deployment-handle call each, in the background, at
most :data:`~rayinfer.serving.shadow.MAX_SHADOW_IN_FLIGHT` at once; the candidate's answer is
compared with the one the client got, and discarded. The ``/v2`` replica names the target when
the replica registers (``ServerDeployment.register_listener``) and gets the counts back."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from typing import Any

from rayinfer.deployments.model_handles import model_handle
from rayinfer.protocol.types import InferRequest, InferResponse
from rayinfer.serving.shadow import MAX_SHADOW_IN_FLIGHT, ShadowCounts

logger = logging.getLogger(__name__)


class ShadowSender:
    """Shadows requests to ``target``: {"candidate", "app", "deployment", "percent",
    "tolerance"} (None: none)."""

    def __init__(self) -> None:
        self.target: dict[str, Any] | None = None
        self.counts = ShadowCounts()
        self._handle: Any = None
        self._in_flight = 0
        self._tasks: set[asyncio.Task] = set()

    def configure(self, target: dict[str, Any] | None) -> bool:
        """Take the ``/v2`` replica's target; whether there is one. A new target counts afresh."""
        if target != self.target:
            self.target, self.counts, self._handle = target, ShadowCounts(), None
            if target is not None:
                logger.info("shadowing %s%% of the requests to version %s", target["percent"], target["candidate"])
        return self.target is not None

    def offer(self, request: InferRequest, response: InferResponse) -> None:
        """A request this replica answered with ``response`` (ModelCore.on_answer)."""
        target = self.target
        if target is None or random.random() * 100 >= target["percent"]:
            return
        if any(output.shm is not None for output in request.outputs or ()):
            return  # the candidate must not write into the client's shared memory
        if self._in_flight >= MAX_SHADOW_IN_FLIGHT:
            self.counts.skipped += 1
            return
        copy = dataclasses.replace(request, model_version=target["candidate"], trace_parent=None, forwarded=False)
        task = asyncio.ensure_future(self._shadow(copy, response, target))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _shadow(self, request: InferRequest, response: InferResponse, target: dict[str, Any]) -> None:
        self._in_flight += 1
        try:
            if self._handle is None:
                self._handle = model_handle((target["app"], target["deployment"]))
            answer = await self._handle.bls_infer.remote(request)
        except Exception as exc:  # noqa: BLE001  # the candidate's failure is a figure, not an error here
            if target is self.target:
                self.counts.failed += 1
            logger.debug("a shadow request failed: %s", exc)
            return
        finally:
            self._in_flight -= 1
        if target is self.target:
            self.counts.record(response, answer, target["tolerance"])
