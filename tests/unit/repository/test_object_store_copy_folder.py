"""Where an s3:// repository's copy lives without TRITON_AWS_MOUNT_DIRECTORY: in this user's
private folder under the temporary directory, never in a folder another local user planted."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from rayinfer.protocol.errors import ModelConfigError
from rayinfer.protocol.private_folders import ownership_problem, per_user_path
from rayinfer.repository.object_store import MOUNT_DIRECTORY_VARIABLE, local_repository
from s3_server import CREDENTIALS, client


@pytest.fixture
def url(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """A bucket of its own with one object under ``models/``; the temporary directory is this
    test's."""
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(MOUNT_DIRECTORY_VARIABLE, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    name = request.node.name.lower().replace("_", "-")[:60]
    s3 = client(s3_endpoint)
    s3.create_bucket(Bucket=name)
    s3.put_object(Bucket=name, Key="models/simple/config.pbtxt", Body=b'name: "simple"\n')
    return f"s3://{s3_endpoint}/{name}/models"


def test_the_copy_lives_in_this_users_private_folder(url: str) -> None:
    copy = local_repository(url)
    assert copy.parent == per_user_path("rayinfer-repositories")
    assert ownership_problem(copy.parent) is None  # a directory of this user, mode 0700
    assert (copy / "simple" / "config.pbtxt").read_bytes() == b'name: "simple"\n'


def test_a_planted_folder_is_refused_not_read(url: str) -> None:
    planted = per_user_path("rayinfer-repositories")
    planted.mkdir()
    planted.chmod(0o777)
    with pytest.raises(ModelConfigError, match=f"refusing to use the folder {planted}: its mode 0777") as info:
        local_repository(url)
    assert info.value.message.startswith(f"model repository '{url}': ")
    assert os.listdir(planted) == []
