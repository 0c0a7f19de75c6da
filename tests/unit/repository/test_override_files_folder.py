"""The temporary model directory a load request's files are written to is this user's alone."""

from __future__ import annotations

import shutil

from rayinfer.protocol.private_folders import ownership_problem
from rayinfer.repository.override_files import write_model_directory


def test_the_model_directory_is_private_to_this_user() -> None:
    root = write_model_directory("m", {"1/model.onnx": b"x"})
    try:
        assert ownership_problem(root) is None  # a new directory of this user, mode 0700
        assert (root / "m" / "1" / "model.onnx").read_bytes() == b"x"
    finally:
        shutil.rmtree(root)
