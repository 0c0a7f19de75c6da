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
    repository = Path(repository)
    if not repository.is_dir():
        raise ModelConfigError(f"model repository '{repository}' is not a directory")
    entries = []
    for model_dir in sorted(p for p in repository.iterdir() if p.is_dir() and not p.name.startswith(".")):
        entries.append(scan_model(model_dir))
    return entries


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
