"""A Python model's environments (EXECUTION_ENV_PATH archives unpacked, pip environments) live
in this user's private folders under the temporary directory; a folder another local user
planted there is refused, never imported from."""

from __future__ import annotations

import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from rayinfer.adapters.python_backend import requirements
from rayinfer.adapters.python_backend.environment import activate_execution_env
from rayinfer.protocol.errors import ModelConfigError
from rayinfer.protocol.private_folders import ownership_problem, per_user_path


@pytest.fixture
def temporary_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary directory of the code under test; sys.path restored afterwards."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "tmp").mkdir()
    return tmp_path / "tmp"


def _archive(folder: Path) -> Path:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    source = folder / "src" / "lib" / version / "site-packages"
    source.mkdir(parents=True)
    (source / "probe_mod.py").write_text("VALUE = 1\n")
    archive = folder / "env.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder / "src" / "lib", arcname="lib")
    return archive


def test_an_environment_archive_is_unpacked_in_this_users_private_folder(
    temporary_directory: Path, tmp_path: Path
) -> None:
    site = activate_execution_env(str(_archive(tmp_path)), tmp_path, "m")
    folder = per_user_path("rayinfer-envs")
    assert site.is_relative_to(folder) and ownership_problem(folder) is None
    assert (site / "probe_mod.py").read_text() == "VALUE = 1\n"


def test_a_planted_environments_folder_is_refused(temporary_directory: Path, tmp_path: Path) -> None:
    planted = per_user_path("rayinfer-envs")
    planted.mkdir()
    planted.chmod(0o777)
    with pytest.raises(ModelConfigError, match=f"^model 'm': cannot unpack EXECUTION_ENV_PATH .*"
                                               f"refusing to use the folder {planted}: its mode 0777"):
        activate_execution_env(str(_archive(tmp_path)), tmp_path, "m")


def test_pip_environments_live_in_this_users_private_folder(temporary_directory: Path) -> None:
    root = requirements.environment_root(["six==1.16"])
    assert root.parent == per_user_path(requirements.ROOT_PREFIX)
    assert ownership_problem(root.parent) is None


def test_a_planted_pip_folder_is_refused_before_pip_runs(temporary_directory: Path) -> None:
    planted = per_user_path(requirements.ROOT_PREFIX)
    planted.mkdir()
    planted.chmod(0o777)
    with pytest.raises(ModelConfigError, match=f"^model 'm': cannot install the model's requirements: "
                                               f"refusing to use the folder {planted}: its mode 0777"):
        requirements.activate_requirements(["--no-index", "nope==1"], "m")
    assert list(planted.iterdir()) == []
