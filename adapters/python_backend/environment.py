"""Triton's ``EXECUTION_ENV_PATH``: a conda-pack tarball (or an unpacked environment folder)
whose packages a Python model imports.

Triton runs its stub process inside the unpacked environment. A rayinfer model runs in its
replica's interpreter, so the environment's ``site-packages`` goes first on ``sys.path``: its
packages must be built for the replica's Python version (as Triton's stub must match the
environment's). Native libraries the packages load from the environment's ``lib`` folder
through ``LD_LIBRARY_PATH`` are not found; a ``requirements.txt`` (:mod:`rayinfer.repository.python_env`)
is the way to bring those.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

from rayinfer.protocol.errors import ModelConfigError
from rayinfer.protocol.private_folders import UnsafeFolderError, private_temporary_folder

PARAMETER = "EXECUTION_ENV_PATH"
MODEL_DIRECTORY = "$$TRITON_MODEL_DIRECTORY"


def activate_execution_env(value: str, model_dir: Path, model: str) -> Path:
    """Put the environment named by ``value`` (``$$TRITON_MODEL_DIRECTORY`` expanded) first on
    ``sys.path``; returns its ``site-packages``. ModelConfigError naming the model and the path
    when it is missing, unreadable or for another Python version."""
    path = Path(value.replace(MODEL_DIRECTORY, str(model_dir))).expanduser()
    if not path.exists():
        raise ModelConfigError(f"model '{model}': {PARAMETER} '{path}' does not exist")
    root = path if path.is_dir() else _unpacked(path, model)
    wanted = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = root / "lib" / wanted / "site-packages"
    if not site.is_dir():
        found = sorted(p.parent.name for p in (root / "lib").glob("python*/site-packages"))
        raise ModelConfigError(
            f"model '{model}': {PARAMETER} '{path}' has packages for {', '.join(found) or 'no Python'}; "
            f"this server runs {wanted}"
        )
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    return site


def _unpacked(archive: Path, model: str) -> Path:
    """The archive unpacked once per content (shared by the replicas of a node) in this user's
    private folder ``<temporary directory>/rayinfer-envs-<uid>``: the replica imports from it, so
    a folder another user planted there is refused (ModelConfigError naming it), never used."""
    digest = hashlib.sha256()
    with archive.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    try:
        target = private_temporary_folder("rayinfer-envs") / digest.hexdigest()[:20]
    except UnsafeFolderError as exc:
        raise ModelConfigError(f"model '{model}': cannot unpack {PARAMETER} '{archive}': {exc}") from None
    if target.is_dir():
        return target
    staging = Path(tempfile.mkdtemp(dir=target.parent))
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(staging, filter="data")
        os.replace(staging, target)  # another replica may have finished first: then theirs
    except OSError:
        if not target.is_dir():
            raise
    except (tarfile.TarError, EOFError) as exc:
        raise ModelConfigError(f"model '{model}': {PARAMETER} '{archive}' is not a readable tarball: {exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
