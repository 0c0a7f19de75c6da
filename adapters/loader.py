"""Loads one model version from a repository into a ready :class:`ModelRunner`."""

from __future__ import annotations

import logging
from pathlib import Path

from rayinfer.adapters.base import create_adapter
from rayinfer.adapters.model_runner import ModelRunner
from rayinfer.adapters.warmup import run_warmup
from rayinfer.protocol.statistics import ModelStatistics
from rayinfer.protocol.errors import ModelConfigError
from rayinfer.repository.instance_groups import resolve_instance_kinds
from rayinfer.repository.model_config import CONFIG_FILENAME, spec_from_config
from rayinfer.repository.scanner import ModelEntry, scan_model

logger = logging.getLogger(__name__)


def load_runner(
    repository: Path, model_name: str, version: int, auto_complete: bool = True,
    config_override: str | None = None, on_gpu: bool = False, any_version: bool = False,
) -> tuple[ModelRunner, ModelEntry]:
    """Read the model's config, load ``version`` with its backend and return the runner.

    ``on_gpu``: the replica has a GPU; its KIND_AUTO / KIND_GPU instance groups become GPU
    instances (else CPU ones) before the backend loads. Raises :class:`ModelConfigError` (naming
    the file) if the config or model file is broken. ``any_version``: ``version`` may be one the
    version policy does not select (a rollout's stable version, kept beside the new one).
    """
    model_dir = Path(repository) / model_name
    entry = scan_model(model_dir, config_override)
    if entry.error is not None or entry.config is None:
        raise ModelConfigError(entry.error or f"{model_dir}: cannot be read")
    if version not in entry.versions and not (any_version and (model_dir / str(version)).is_dir()):
        raise ModelConfigError(
            f"{model_dir}: version {version} is not served by the version policy "
            f"(serving {entry.versions})"
        )
    config = entry.config
    resolve_instance_kinds(config, on_gpu)
    adapter = create_adapter(config.backend)
    adapter.load(model_dir, version, config, auto_complete)
    spec = spec_from_config(config, model_dir / CONFIG_FILENAME)
    # A backend whose models take whole batches of requests brings its own runner.
    runner = getattr(adapter, "runner_class", ModelRunner)(spec, adapter, version)
    run_warmup(runner, model_dir)
    # Warmup executions are not inference statistics.
    runner.stats = ModelStatistics(first_response_buckets=spec.first_response_buckets)
    logger.info("loaded model '%s' version %d (%s)", model_name, version, config.backend)
    return runner, entry
