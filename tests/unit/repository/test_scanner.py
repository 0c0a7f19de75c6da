"""Repository scanning: every model folder yields an entry; a broken one never hides the others."""

from __future__ import annotations

from pathlib import Path

import pytest
from onnx import TensorProto

from rayinfer.cluster.example_repository import SIMPLE_CONFIG, add_sub_model, write_model
from rayinfer.protocol.errors import ModelConfigError
from rayinfer.repository.scanner import RepositoryScan, scan_model, scan_repository


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    write_model(tmp_path, "simple", SIMPLE_CONFIG, add_sub_model(TensorProto.INT32))
    broken = tmp_path / "broken"
    (broken / "1").mkdir(parents=True)
    (broken / "config.pbtxt").write_text("max_batch_size: [[[")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "README.md").write_text("not a model")
    return tmp_path


def test_good_and_broken_models(repository: Path) -> None:
    entries = {e.name: e for e in scan_repository(repository)}
    assert sorted(entries) == ["broken", "simple"]
    broken = entries["broken"]
    assert broken.config is None and broken.versions == []
    assert broken.error is not None and "config.pbtxt" in broken.error
    assert str(repository / "broken" / "config.pbtxt") in broken.error
    simple = entries["simple"]
    assert simple.error is None
    assert simple.versions == [1]
    assert simple.config is not None
    assert (simple.config.name, simple.config.backend, simple.config.max_batch_size) == ("simple", "onnxruntime", 8)
    assert simple.path == repository / "simple"


def test_latest_version_is_served_and_non_numeric_folders_ignored(tmp_path: Path) -> None:
    model = add_sub_model(TensorProto.INT32)
    for version in (1, 3, 2):
        write_model(tmp_path, "simple", SIMPLE_CONFIG, model, version)
    (tmp_path / "simple" / "backup").mkdir()
    (entry,) = scan_repository(tmp_path)
    assert entry.error is None and entry.versions == [3]


def test_all_versions_policy(tmp_path: Path) -> None:
    model = add_sub_model(TensorProto.INT32)
    config = SIMPLE_CONFIG + "version_policy { all { } }\n"
    for version in (2, 1):
        write_model(tmp_path, "simple", config, model, version)
    assert scan_model(tmp_path / "simple").versions == [1, 2]


def test_no_matching_version_folder(tmp_path: Path) -> None:
    write_model(tmp_path, "simple", SIMPLE_CONFIG + "version_policy { specific { versions: [ 4 ] } }\n",
                add_sub_model(TensorProto.INT32), version=1)
    entry = scan_model(tmp_path / "simple")
    assert entry.config is None
    assert entry.error == f"{tmp_path / 'simple'}: no version folder matches the version policy (found [1])"


def test_no_version_folders_at_all(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.pbtxt").write_text('platform: "onnxruntime_onnx"')
    entry = scan_model(tmp_path / "empty")
    assert entry.error is not None and "(found none)" in entry.error


def test_missing_repository(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="is not a directory"):
        scan_repository(tmp_path / "nope")


def test_empty_repository(tmp_path: Path) -> None:
    assert scan_repository(tmp_path) == []


def test_gpu_instance_groups_are_servable(tmp_path: Path) -> None:
    config = 'platform: "onnxruntime_onnx"\nmax_batch_size: 8\ninstance_group [ { count: 2 kind: KIND_GPU } ]\n'
    write_model(tmp_path, "gpu_model", config, add_sub_model(TensorProto.INT32))
    (entry,) = scan_repository(tmp_path)
    assert entry.error is None and entry.versions == [1]


def test_a_repeated_scan_parses_a_model_again_only_when_its_folder_changed(tmp_path: Path, monkeypatch):
    from rayinfer.repository import scanner

    write_model(tmp_path, "simple", SIMPLE_CONFIG, add_sub_model(TensorProto.INT32))
    write_model(tmp_path, "other", SIMPLE_CONFIG.replace('name: "simple"', 'name: "other"'),
                add_sub_model(TensorProto.INT32))
    parsed: list[str] = []
    real_scan_model = scanner.scan_model
    monkeypatch.setattr(scanner, "scan_model", lambda model_dir: parsed.append(model_dir.name) or real_scan_model(model_dir))
    scan = RepositoryScan(tmp_path)
    assert [e.name for e in scan.entries()] == ["other", "simple"] and sorted(parsed) == ["other", "simple"]
    parsed.clear()
    assert [e.versions for e in scan.entries()] == [[1], [1]] and parsed == []  # nothing changed: nothing parsed
    # A new version folder, an edited config, a removed model: each read again (or gone).
    (tmp_path / "simple" / "2").mkdir()
    (tmp_path / "simple" / "2" / "model.onnx").write_bytes((tmp_path / "simple" / "1" / "model.onnx").read_bytes())
    config = tmp_path / "other" / "config.pbtxt"
    config.write_text(config.read_text() + "\nversion_policy: { all { }}\n")
    entries = {e.name: e for e in scan.entries()}
    assert sorted(parsed) == ["other", "simple"] and entries["simple"].versions == [2]
    parsed.clear()
    (tmp_path / "simple" / "1" / "model.onnx").unlink()  # inside a version folder: that folder's time
    scan.entries()
    assert parsed == ["simple"]
    import shutil

    shutil.rmtree(tmp_path / "other")
    assert [e.name for e in scan.entries()] == ["simple"]
