"""Model control (Triton's explicit and poll modes): what to load, from where, and what failed.

:class:`ModelController` decides; a :class:`Deployer` does. The controller checks names and load
parameters, writes a load request's files to a temporary model directory, tries a serving
model's new version before replacing it, and keeps each model's load error and source; the
deployer (Serve's, in :mod:`rayinfer.deployments.control`) starts and removes applications.
No Ray here: unit tests drive the controller with a deployer of their own.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from rayinfer.protocol.errors import InternalError, InvalidArgError, as_serving_error
from rayinfer.repository.ensemble import first_step, member_names
from rayinfer.repository.override_files import file_parameters, write_model_directory
from rayinfer.repository.object_store import is_remote, local_repository
from rayinfer.repository.scanner import ModelEntry, scan_model

logger = logging.getLogger(__name__)

# (model, version, is_default): one served version.
Version = tuple[str, int, bool]


class Deployer(Protocol):
    """Starts and removes the applications that serve model versions."""

    def serving(self, model: str) -> bool:
        """Whether any version of ``model`` has an application now."""

    def trial_load(self, root: str, versions: list[Version], override: str | None) -> None:
        """Load each version once and drop it; raise the load's error."""

    def deploy(self, root: str, model: str, versions: list[Version], override: str | None) -> str | None:
        """Serve exactly ``versions`` of ``model`` (removing others); the failure reason, or None."""

    def remove_version(self, model: str, version: int) -> None:
        """Remove the application of one (non-default) version of ``model``."""

    def remove(self, model: str) -> None:
        """Remove every version of ``model``; return once they are gone."""


def check_model_name(model: str) -> None:
    """Triton's checks of a model name a load request gives (INVALID_ARG, its messages)."""
    if not model:
        raise InvalidArgError("model name must not be empty")
    if not model.strip():
        raise InvalidArgError("model name must not contain only whitespace characters")
    if ".." in model or "/" in model or "\\" in model:
        raise InvalidArgError(f"invalid model name '{model}', model name must not contain path traversal characters")


class ModelController:
    """Loads and unloads models of one repository through a deployer (one call at a time)."""

    def __init__(self, repository: Path, deployer: Deployer, mode: str = "none", source: str | None = None) -> None:
        self.repository = Path(repository)
        # What replicas are given for ``repository``: an s3:// URL whose copy it is, or the folder.
        self.source = source or str(repository)
        self.mode = mode
        self._deployer = deployer
        # model -> why its last load failed (also set by ``rayinfer serve`` for start-up loads).
        self.load_errors: dict[str, str] = {}
        # Models loaded with a config override or files: model -> (repository root, override).
        self.sources: dict[str, tuple[Path, str | None]] = {}
        # model -> a version served beyond its version policy: a rollout's stable version, kept
        # while its candidate (the new highest version) is rolled out beside it.
        self.kept: dict[str, int] = {}

    @property
    def explicit(self) -> bool:
        return self.mode == "explicit"

    def refresh(self) -> None:
        """Bring the copy of an s3:// repository up to date (a folder: nothing to do)."""
        if is_remote(self.source):
            local_repository(self.source)

    def _published(self, root: Path) -> str:
        """The repository replicas load ``root``'s models from."""
        return self.source if root == self.repository else str(root)

    def entry(self, name: str, scanned: ModelEntry) -> ModelEntry:
        """A repository entry as served: read again from its own source when it has one, with
        its kept version."""
        source = self.sources.get(name)
        return self._with_kept(scanned if source is None else scan_model(source[0] / name, source[1]))

    def scan(self, name: str, override: str | None = None) -> ModelEntry:
        """Model ``name`` as served, read from its own source (files a load gave it) when it has
        one, else from the repository (with ``override`` as its config)."""
        source = self.sources.get(name)
        if source is None:
            return self._with_kept(scan_model(self.repository / name, override))
        return self._with_kept(scan_model(source[0] / name, source[1]))

    def _with_kept(self, entry: ModelEntry) -> ModelEntry:
        """``entry`` with the version kept for its rollout, while that version's folder is there."""
        kept = self.kept.get(entry.name)
        if kept is None or entry.error is not None or kept in entry.versions or not (entry.path / str(kept)).is_dir():
            return entry
        return replace(entry, versions=sorted([*entry.versions, kept]))

    def entries(self, scanned: list[ModelEntry]) -> list[ModelEntry]:
        """The repository's entries as served, then the models a load request's files brought
        under names the repository does not have."""
        names = {entry.name for entry in scanned}
        return [self.entry(entry.name, entry) for entry in scanned] + [
            scan_model(root / name, override) for name, (root, override) in sorted(self.sources.items())
            if name not in names]

    def load(self, model: str, parameters: dict[str, Any], loading: frozenset[str] = frozenset()) -> None:
        """Deploy every version the model's policy selects; remove versions no longer selected.
        An ensemble's members that are not served are loaded first (``loading``: the ensembles
        whose members are being loaded, outer first).

        ``parameters.config``: a config in Triton's JSON form used instead of config.pbtxt;
        ``file:<version>/<name>`` parameters: the model's files, served from a temporary model
        directory (they need ``config``). Raises with Triton's message when the load fails; a
        serving model keeps serving unless its new version loads.
        """
        if not loading:  # an s3:// repository's objects may have changed since the last load
            self.refresh()
        check_model_name(model)
        override = parameters.get("config")
        if override is not None and not isinstance(override, str):
            raise InvalidArgError(f"failed to load '{model}': parameter 'config' must be a JSON string")
        files = file_parameters(model, parameters)
        # With files, the model is served from them, whether or not the repository has it (as in Triton).
        if not files and (model.startswith(".") or not (self.repository / model).is_dir()):
            raise InternalError(f"failed to load '{model}', failed to poll from model repository")
        if files and override is None:
            raise InvalidArgError(f"failed to load '{model}': 'file:' parameters need the 'config' parameter")
        root = write_model_directory(model, files) if files else self.repository
        try:
            self._load_members(root, model, override, loading)
            versions = self._versions_to_deploy(root, model, override)
        except BaseException:  # nothing was deployed from the new files
            if files:
                shutil.rmtree(root, ignore_errors=True)
            raise
        # From here on applications may run from ``root``: it is kept until the model is unloaded
        # or loaded again from elsewhere.
        previous = self.sources.pop(model, None)
        if files or override is not None:
            self.sources[model] = (root, override)
        if previous is not None and previous[0] not in (root, self.repository):
            shutil.rmtree(previous[0], ignore_errors=True)
        failure = self._deployer.deploy(self._published(root), model, versions, override)
        if failure is not None:
            self.load_errors[model] = failure
            raise InvalidArgError(f"failed to load '{model}': {failure}")
        self.load_errors.pop(model, None)

    def _load_members(self, root: Path, model: str, override: str | None, loading: frozenset[str]) -> None:
        """Load the members of an ensemble that no application serves yet, as Triton does."""
        entry = scan_model(root / model, override)
        if entry.config is None:
            return
        for member in member_names(entry.config):
            if member in loading or member == model:
                raise InvalidArgError(f"failed to load '{model}': ensemble '{model}' depends on itself "
                                      f"through '{member}'")
            if not (self.repository / member).is_dir():
                self.load_errors[model] = (f"ensemble '{model}': step {first_step(entry.config, member)} names model "
                                           f"'{member}', which is not in the model repository")
                raise InvalidArgError(f"failed to load '{model}': {self.load_errors[model]}")
            if not self._deployer.serving(member):
                try:
                    self.load(member, {}, loading | {model})
                except Exception as exc:
                    message = as_serving_error(exc).message
                    self.load_errors[model] = f"ensemble '{model}' depends on '{member}', which failed to load: {message}"
                    raise InvalidArgError(f"failed to load '{model}': {self.load_errors[model]}") from None

    def dependents_to_unload(self, model: str, served: list[str]) -> list[str]:
        """The members an ensemble's unload with ``unload_dependents`` takes along (nested ones
        too): those no other served ensemble still uses."""
        def members_of(name: str) -> list[str]:
            entry = self.scan(name)
            return member_names(entry.config) if entry.config is not None else []

        closure: list[str] = []
        queue = members_of(model)
        while queue:
            member = queue.pop(0)
            if member not in closure and member != model:
                closure.append(member)
                queue.extend(members_of(member))
        keep = {m for other in served if other != model and other not in closure for m in members_of(other)}
        return [m for m in closure if m not in keep]

    def _versions_to_deploy(self, root: Path, model: str, override: str | None) -> list[Version]:
        """The versions to deploy (the policy's, and a kept one); a serving model's new versions
        are loaded on trial first."""
        entry = self._with_kept(scan_model(root / model, override))
        serving = self._deployer.serving(model)
        if entry.error is not None:
            if not serving:  # a serving version keeps serving
                self.load_errors[model] = entry.error
            raise InvalidArgError(f"failed to load '{model}': {entry.error}")
        latest = max(entry.versions)
        versions = [(model, v, v == latest) for v in entry.versions]
        if serving:
            try:
                self._deployer.trial_load(self._published(root), versions, override)
            except Exception as exc:
                raise InvalidArgError(f"failed to load '{model}': {as_serving_error(exc).message}") from None
        return versions

    def release_kept(self, model: str) -> int | None:
        """Keep ``model``'s kept version no longer (its rollout's candidate was promoted);
        returns it once removed when the version policy does not select it."""
        kept = self.kept.pop(model, None)
        if kept is None:
            return None
        source = self.sources.get(model)
        entry = scan_model((source[0] if source else self.repository) / model, source[1] if source else None)
        if entry.error is not None or kept in entry.versions:
            return None
        self._deployer.remove_version(model, kept)
        return kept

    def unload(self, model: str) -> None:
        """Remove every version (an unknown or unloaded model: nothing to do, as in Triton)."""
        self._deployer.remove(model)
        source = self.sources.pop(model, None)
        if source is not None and source[0] != self.repository:
            shutil.rmtree(source[0], ignore_errors=True)
        self.load_errors.pop(model, None)
        self.kept.pop(model, None)

    def close(self) -> None:
        """Remove the temporary model directories."""
        for root, _ in self.sources.values():
            if root != self.repository:
                shutil.rmtree(root, ignore_errors=True)
        self.sources.clear()
