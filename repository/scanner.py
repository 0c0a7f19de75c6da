"""Scan a model repository: one :class:`ModelEntry` per model folder, broken or not."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from rayinfer.protocol.errors import ModelConfigError
from rayinfer.repository.model_config import (
    CONFIG_FILENAME,
    ModelConfig,
    check_supported,
    fill_defaults,
    read_config,
    resolve_backend,
)
from rayinfer.repository.ensemble import is_ensemble, parse_ensemble
from rayinfer.repository.version_policy import select_versions, version_dirs

logger = logging.getLogger(__name__)
# (model, reason) already logged by this process: a repository is scanned again on each index
# request, load and poll, and a broken model is reported once, not on every scan.
_reported: set[tuple[str, str]] = set()


def _report_unavailable(name: str, reason: str) -> None:
    if (name, reason) not in _reported:
        _reported.add((name, reason))
        logger.error("model '%s' is unavailable: %s", name, reason)


@dataclass
class ModelEntry:
    """A model folder: its parsed config and served versions, or why it cannot be served."""

    name: str
    path: Path
    config: ModelConfig | None = None
    versions: list[int] = field(default_factory=list)
    error: str | None = None


def scan_repository(repository: Path) -> list[ModelEntry]:
    """Read every ``<repository>/<model>/`` folder; raises only if the repository itself is missing."""
    return RepositoryScan(repository).entries()


class RepositoryScan:
    """:func:`scan_repository` for a caller that reads the repository again and again (the
    ``/v2`` replica: every 2 s, and on each index request): a model's entry is parsed again only
    when its folder changed (the modification times of the folder, its config file and its
    version folders, which a file added to or removed from any of them changes)."""

    def __init__(self, repository: Path) -> None:
        self.repository = Path(repository)
        self._entries: dict[str, tuple[tuple, ModelEntry]] = {}

    def entries(self) -> list[ModelEntry]:
        if not self.repository.is_dir():
            raise ModelConfigError(f"model repository '{self.repository}' is not a directory")
        entries: dict[str, tuple[tuple | None, ModelEntry]] = {}
        for model_dir in sorted(p for p in self.repository.iterdir() if p.is_dir() and not p.name.startswith(".")):
            try:
                key: tuple | None = _folder_key(model_dir)
            except OSError:  # removed meanwhile, or unreadable: scan_model says why
                key = None
            cached = self._entries.get(model_dir.name)
            entry = cached[1] if cached is not None and key is not None and cached[0] == key else scan_model(model_dir)
            entries[model_dir.name] = (key, entry)
        self._entries = {name: (key, entry) for name, (key, entry) in entries.items() if key is not None}
        return [entry for _, entry in entries.values()]


def _folder_key(model_dir: Path) -> tuple:
    config = model_dir / CONFIG_FILENAME
    try:
        config_stat = config.stat()
        config_key: tuple = (config_stat.st_mtime_ns, config_stat.st_size, config_stat.st_ino)
    except FileNotFoundError:
        config_key = ()
    versions = tuple(sorted((p.name, p.stat().st_mtime_ns) for p in model_dir.iterdir() if p.is_dir()))
    return model_dir.stat().st_mtime_ns, config_key, versions


def scan_model(model_dir: Path, config_override: str | None = None) -> ModelEntry:
    """Parse one model folder; errors are recorded on the entry, never raised.

    ``config_override``: Triton's JSON form of a config to use instead of config.pbtxt.
    """
    entry = ModelEntry(name=model_dir.name, path=model_dir)
    try:
        config = read_config(model_dir, override=config_override)
        resolve_backend(config, model_dir)
        fill_defaults(config)
        check_supported(config, model_dir / CONFIG_FILENAME)
        if is_ensemble(config):  # its step graph, checked before any member is asked
            parse_ensemble(config, model_dir)
        available = version_dirs([p.name for p in model_dir.iterdir() if p.is_dir()])
        versions = select_versions(config.version_policy, available)
        if not versions:
            raise ModelConfigError(
                f"{model_dir}: no version folder matches the version policy "
                f"(found {available or 'none'})"
            )
    except ModelConfigError as exc:
        entry.error = exc.message
        _report_unavailable(entry.name, exc.message)
        return entry
    except OSError as exc:
        entry.error = f"{model_dir}: {exc}"
        _report_unavailable(entry.name, entry.error)
        return entry
    entry.config = config
    entry.versions = versions
    return entry
