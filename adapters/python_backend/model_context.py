"""Which Python model the running code belongs to, where one process holds many (the model pool).

A dedicated replica holds one Python model. A pool replica holds many in one interpreter, so
what ``triton_python_backend_utils`` answers for "this model" (``get_model_dir``, and the BLS
client, which calls the model itself in place and every other model by handle) cannot be the
process's. Each model's calls into its code (its module's import, ``auto_complete_config``,
``initialize``, ``execute``, ``is_ready``, ``finalize``) run inside the model's
:class:`ModelContext`, a context variable: code those calls run, the coroutines an async
``execute`` awaits and the threads it starts with ``asyncio.to_thread`` (or
``contextvars.copy_context().run``) see it. In a dedicated replica, code outside any call (a
thread the model starts with ``threading``) sees the process's one model; in a pool replica it
sees none, and a BLS call from it fails saying so rather than calling as another model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelContext:
    """One loaded model's: its folder (``<repository>/<model>``) and its BLS client."""

    model_dir: str
    bls: Any = None


_current: ContextVar[ModelContext | None] = ContextVar("rayinfer_python_model", default=None)
_last: ModelContext | None = None  # the process's last loaded model (a thread of its own sees it)
_loaded: list[ModelContext] = []  # the process's loaded models, oldest first
_shared = False  # this process holds many models (a pool replica): no model is "the process's"


def share_process() -> None:
    """This process hosts many models (the model pool's replica)."""
    global _shared
    _shared = True


def process_shared() -> bool:
    return _shared


def current() -> ModelContext | None:
    """The running model's context: the one entered, else (a dedicated replica) the process's."""
    return _current.get() or (None if _shared else _last)


def loaded(context: ModelContext) -> None:
    """``context``'s model is loaded: it is the process's, for code outside any model's call."""
    global _last
    _last = context
    _loaded.append(context)


def unloaded(context: ModelContext) -> None:
    """``context``'s model is unloaded: nothing refers to it any more."""
    global _last
    if _last is context:
        _last = None
    for i, each in enumerate(_loaded):
        if each is context:
            del _loaded[i]
            break


def reports_process_metrics(context: ModelContext | None) -> bool:
    """Whether ``context``'s model is the one whose statistics carry the process's own metric
    families (``pb_utils.MetricFamily``): in a pool replica the oldest loaded model, so that a
    change is pushed once, not once per model; in a dedicated replica its one model."""
    return not _shared or bool(_loaded) and _loaded[0] is context


@contextlib.contextmanager
def entered(context: ModelContext | None) -> Iterator[None]:
    """Run the block as ``context``'s model (nothing changes for None)."""
    if context is None:
        yield
        return
    token = _current.set(context)
    try:
        yield
    finally:
        _current.reset(token)
