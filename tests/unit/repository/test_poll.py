"""Repository polling decisions, without Ray."""

from __future__ import annotations

import os
from pathlib import Path

from rayinfer.repository.poll import PollPlan, fingerprint, repository_fingerprints


def make_model(repo: Path, name: str, content: bytes = b"model") -> Path:
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text('backend: "onnxruntime"\n')
    (repo / name / "1" / "model.onnx").write_bytes(content)
    return repo / name


def test_fingerprint_changes_with_content_size_mtime_and_new_files(tmp_path: Path):
    model = make_model(tmp_path, "m")
    first = fingerprint(model)
    assert fingerprint(model) == first
    (model / "1" / "model.onnx").write_bytes(b"other content")
    second = fingerprint(model)
    assert second != first
    os.utime(model / "config.pbtxt", ns=(1, 1))
    third = fingerprint(model)
    assert third != second
    (model / "2").mkdir()
    (model / "2" / "model.onnx").write_bytes(b"v2")
    assert fingerprint(model) != third


def test_repository_fingerprints_skip_files_and_hidden_folders(tmp_path: Path):
    make_model(tmp_path, "a")
    (tmp_path / ".staging").mkdir()
    (tmp_path / "README").write_text("not a model")
    assert set(repository_fingerprints(tmp_path)) == {"a"}
    assert repository_fingerprints(tmp_path / "missing") == {}


def test_a_new_model_loads_once_it_stopped_changing():
    plan = PollPlan({"a": "fa"})
    assert plan.step({"a": "fa", "b": "fb1"}) == ([], [])  # b seen for the first time
    assert plan.step({"a": "fa", "b": "fb2"}) == ([], [])  # still being written
    assert plan.step({"a": "fa", "b": "fb2"}) == (["b"], [])  # stable: load
    assert plan.step({"a": "fa", "b": "fb2"}) == ([], [])  # loaded: nothing to do


def test_a_changed_model_reloads_and_a_removed_one_unloads():
    plan = PollPlan({"a": "fa", "b": "fb"})
    assert plan.step({"a": "fa2", "b": "fb"}) == ([], [])
    assert plan.step({"a": "fa2", "b": "fb"}) == (["a"], [])
    assert plan.step({"a": "fa2"}) == ([], ["b"])
    assert plan.step({"a": "fa2"}) == ([], [])
    # Put back: loads again once stable.
    assert plan.step({"a": "fa2", "b": "fb"}) == ([], [])
    assert plan.step({"a": "fa2", "b": "fb"}) == (["b"], [])
