"""The response cache's folder is this user's alone: another user's folder at its path is
refused by the cache and left alone when the server clears the cache at its start."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rayinfer.protocol.private_folders import UnsafeFolderError
from rayinfer.serving.response_cache import ResponseCache, clear, default_root

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")


def test_the_default_folder_is_per_user() -> None:
    assert default_root().name == f"rayinfer-response-cache-{os.getuid()}"


@needs_root
def test_another_users_folder_is_refused_and_not_cleared(tmp_path: Path) -> None:
    planted = tmp_path / "cache"
    (planted / "entries").mkdir(parents=True, mode=0o700)
    os.chown(planted, 65534, 65534)
    with pytest.raises(UnsafeFolderError, match=f"{planted}: it belongs to uid 65534"):
        ResponseCache(planted, "m", "1", "f", 100)
    clear(planted)
    assert (planted / "entries").is_dir()


def test_a_folder_others_may_enter_is_not_cleared(tmp_path: Path) -> None:
    planted = tmp_path / "cache"
    (planted / "entries").mkdir(parents=True)
    planted.chmod(0o777)
    clear(planted)
    assert (planted / "entries").is_dir()


def test_this_users_folder_is_cleared(tmp_path: Path) -> None:
    cache = ResponseCache(tmp_path / "cache", "m", "1", "f", 100)
    assert cache is not None and any((tmp_path / "cache").iterdir())
    clear(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
