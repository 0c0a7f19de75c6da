"""Files carried by a load request: decoding and path checks (no Ray)."""

from __future__ import annotations

import base64

import pytest

from rayinfer.protocol.errors import InvalidArgError
from rayinfer.repository import override_files
from rayinfer.repository.override_files import MAX_FILES, checked_relative_path, file_parameters, write_model_directory


def test_http_contents_are_base64_and_grpc_contents_bytes():
    params = {"config": "{}", "file:1/model.onnx": base64.b64encode(b"\x01\x02").decode(), "file:1/extra": b"raw"}
    assert file_parameters("m", params) == {"1/model.onnx": b"\x01\x02", "1/extra": b"raw"}
    with pytest.raises(InvalidArgError, match="not valid base64"):
        file_parameters("m", {"file:1/model.onnx": "not base64!"})


def test_a_load_request_carries_a_bounded_number_of_files():
    many = {f"file:1/f{i}": b"" for i in range(MAX_FILES + 1)}
    with pytest.raises(InvalidArgError, match=f"1025 'file:' parameters, more than the {MAX_FILES}"):
        file_parameters("m", many)
    many.popitem()
    assert len(file_parameters("m", many)) == MAX_FILES


@pytest.mark.parametrize("path", ["", "/etc/passwd", "../x", "1/../../x", ".", "a\\b", "A" * 256, "1/\0"])
def test_unsafe_paths_are_invalid(path):
    with pytest.raises(InvalidArgError, match="Invalid file path"):
        checked_relative_path("m", path)


def test_files_land_in_a_new_model_directory(tmp_path):
    root = write_model_directory("m", {"1/model.onnx": b"onnx", "config.pbtxt": b"cfg"})
    try:
        assert (root / "m" / "1" / "model.onnx").read_bytes() == b"onnx"
        assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == [
            "m/1/model.onnx", "m/config.pbtxt"]
    finally:
        import shutil

        shutil.rmtree(root)


def test_nothing_is_written_when_any_path_is_bad(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(InvalidArgError):
        write_model_directory("m", {"1/model.onnx": b"ok", "../escape": b"bad"})
    assert list(tmp_path.iterdir()) == []


def test_a_file_and_a_folder_of_the_same_name_are_invalid(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(InvalidArgError, match="cannot write 'file:1/a/b'"):
        write_model_directory("m", {"1/a": b"x", "1/a/b": b"y"})
    assert list(tmp_path.iterdir()) == []


def test_a_file_over_int_max_is_refused_with_tritons_message(monkeypatch) -> None:
    monkeypatch.setattr(override_files, "_INT_MAX", 8)
    with pytest.raises(InvalidArgError, match="^'file:1/model.onnx' exceeds the maximum allowed data size limit INT_MAX$"):
        file_parameters("m", {"file:1/model.onnx": b"123456789"})
    assert file_parameters("m", {"file:1/model.onnx": b"12345678"}) == {"1/model.onnx": b"12345678"}
