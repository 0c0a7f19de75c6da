"""Repository polling (``--model-control-mode poll``): what to load and unload after each scan.

A model folder is fingerprinted by the paths, sizes and modification times of its files. A
changed folder is (re)loaded only once two consecutive polls saw the same fingerprint, so a
model that is still being copied in is not loaded half-written.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def fingerprint(model_dir: Path) -> str:
    """A digest of every file under ``model_dir`` (relative path, size, mtime)."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(model_dir):
        dirs.sort()
        for name in sorted(files):
            path = Path(root) / name
            try:
                stat = path.stat()
            except OSError:  # removed while we walked: the next poll sees the new state
                continue
            digest.update(f"{path.relative_to(model_dir)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def repository_fingerprints(repository: Path) -> dict[str, str]:
    """``{model name: fingerprint}`` for every model folder (hidden folders skipped)."""
    if not repository.is_dir():
        return {}
    return {
        p.name: fingerprint(p)
        for p in sorted(repository.iterdir())
        if p.is_dir() and not p.name.startswith(".")
    }


class PollPlan:
    """Decides, poll after poll, which models to (re)load and which to unload."""

    def __init__(self, loaded: dict[str, str]) -> None:
        self._loaded = dict(loaded)  # what is deployed (or was tried), by fingerprint
        self._previous: dict[str, str] = dict(loaded)

    def step(self, current: dict[str, str]) -> tuple[list[str], list[str]]:
        """``(to_load, to_unload)`` for this poll's fingerprints; the caller then applies them."""
        to_load = sorted(
            name for name, fp in current.items()
            if fp != self._loaded.get(name) and self._previous.get(name) == fp
        )
        to_unload = sorted(name for name in self._loaded if name not in current)
        self._previous = dict(current)
        for name in to_load:
            self._loaded[name] = current[name]
        for name in to_unload:
            del self._loaded[name]
        return to_load, to_unload
