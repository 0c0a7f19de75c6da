"""This user's folders under a shared directory: created 0700, and refused (never used, changed
or removed) when what is there is a link, another user's folder or one others may enter."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from rayinfer.protocol.private_folders import (
    UnsafeFolderError,
    ownership_problem,
    per_user_path,
    private_folder,
    private_temporary_folder,
)

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")


@pytest.fixture
def temporary_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary directory of the code under test (tempfile.gettempdir())."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_a_missing_folder_is_made_for_this_user_alone(temporary_directory: Path) -> None:
    folder = private_temporary_folder("rayinfer-things")
    assert folder == temporary_directory / f"rayinfer-things-{os.getuid()}"
    status = folder.lstat()
    assert status.st_uid == os.getuid() and status.st_mode & 0o777 == 0o700
    assert private_temporary_folder("rayinfer-things") == folder  # found again, and accepted
    assert ownership_problem(folder) is None


def test_the_path_is_per_user_under_the_given_base(tmp_path: Path) -> None:
    assert per_user_path("rayinfer-cache", tmp_path) == tmp_path / f"rayinfer-cache-{os.getuid()}"


def test_a_folder_others_may_enter_is_refused_and_left_as_it_is(temporary_directory: Path) -> None:
    planted = per_user_path("rayinfer-things")
    planted.mkdir()
    planted.chmod(0o777)
    with pytest.raises(UnsafeFolderError, match=f"{planted}: its mode 0777 lets the group or others in"):
        private_temporary_folder("rayinfer-things")
    assert planted.stat().st_mode & 0o777 == 0o777


def test_a_link_is_refused(temporary_directory: Path) -> None:
    elsewhere = temporary_directory / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    per_user_path("rayinfer-things").symlink_to(elsewhere)
    with pytest.raises(UnsafeFolderError, match="is a symbolic link"):
        private_temporary_folder("rayinfer-things")


def test_a_file_is_refused(temporary_directory: Path) -> None:
    per_user_path("rayinfer-things").write_text("")
    with pytest.raises(UnsafeFolderError, match="is not a directory"):
        private_temporary_folder("rayinfer-things")


@needs_root
def test_another_users_folder_is_refused_and_not_taken_over(temporary_directory: Path) -> None:
    planted = per_user_path("rayinfer-things")
    planted.mkdir(mode=0o700)
    os.chown(planted, 65534, 65534)
    with pytest.raises(UnsafeFolderError, match=f"{planted}: it belongs to uid 65534"):
        private_temporary_folder("rayinfer-things")
    assert planted.stat().st_uid == 65534


def test_the_error_is_a_permission_error_that_survives_pickling(tmp_path: Path) -> None:
    import pickle

    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o755)
    with pytest.raises(PermissionError) as info:
        private_folder(tmp_path / "open")
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is UnsafeFolderError and str(again) == str(info.value)
