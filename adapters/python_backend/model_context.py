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
import sys
import types
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelContext:
    """One loaded model's: its folder (``<repository>/<model>``), its BLS client, and (in a pool
    replica) its module by its file's name, for :class:`RunningModelModule`."""

    model_dir: str
    bls: Any = None
    modules: dict[str, types.ModuleType] = field(default_factory=dict, compare=False, hash=False)


class RunningModelModule(types.ModuleType):
    """``sys.modules["model"]`` in a pool replica: what Triton's stub gives a model, its own
    module by its file's name (``unittest.main('model')`` imports it to find the model's
    tests), where one interpreter holds many models' files of that name. Each attribute is the
    running model's (:func:`current`); outside any model's call there is none."""

    def _running(self) -> types.ModuleType:
        context = current()
        module = context.modules.get(self.__name__) if context is not None else None
        if module is None:
            raise AttributeError(f"module {self.__name__!r}: no Python model of this pool replica is running here")
        return module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._running(), name)

    def __dir__(self) -> list[str]:
        return dir(self._running())


def register_module(context: ModelContext, file_name: str, module: types.ModuleType) -> None:
    """``module`` is ``context``'s model's, importable by ``file_name`` as in Triton's stub: in a
    dedicated replica the module itself (the first loaded keeps the name), in a pool replica
    the running model's (:class:`RunningModelModule`)."""
    if not _shared:
        sys.modules.setdefault(file_name, module)
        return
    context.modules[file_name] = module
    if not isinstance(sys.modules.get(file_name), RunningModelModule):
        sys.modules[file_name] = RunningModelModule(file_name)


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
