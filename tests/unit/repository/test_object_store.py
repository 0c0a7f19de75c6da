"""s3:// model repositories against a real S3-compatible server (moto's server mode): Triton's
URL forms, the node-local copy brought up to date by ETag, a model's folder alone, keys that
would leave the copy, and errors naming the repository."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rayinfer.cluster.example_repository import write_example_repository
from rayinfer.protocol.errors import ModelConfigError
from rayinfer.repository.object_store import MOUNT_DIRECTORY_VARIABLE, S3Location, local_repository, parse_s3_url
from rayinfer.repository.scanner import scan_repository
from s3_server import CREDENTIALS, client, upload_folder


@pytest.fixture
def bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, request: pytest.FixtureRequest):
    """A bucket of its own holding the example repository under ``models/``; the copy goes to
    a folder of this test's (TRITON_AWS_MOUNT_DIRECTORY)."""
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(MOUNT_DIRECTORY_VARIABLE, str(tmp_path / "copy"))
    s3 = client(s3_endpoint)
    name = request.node.name.lower().replace("_", "-")[:60]
    s3.create_bucket(Bucket=name)
    write_example_repository(tmp_path / "source")
    upload_folder(s3, name, "models", tmp_path / "source")
    return s3, name, f"s3://{s3_endpoint}/{name}/models", tmp_path


@pytest.mark.parametrize(("url", "location"), [
    ("s3://bucket/path/to/repository", S3Location(None, "bucket", "path/to/repository/")),
    ("s3://bucket", S3Location(None, "bucket", "")),
    ("s3://localhost:9000/bucket/repository/", S3Location("http://localhost:9000", "bucket", "repository/")),
    ("s3://https://minio.example:443/bucket/a/b", S3Location("https://minio.example:443", "bucket", "a/b/")),
    ("s3://http://minio.example/bucket", S3Location("http://minio.example", "bucket", "")),
])
def test_tritons_s3_url_forms(url: str, location: S3Location) -> None:
    assert parse_s3_url(url) == location


@pytest.mark.parametrize(("url", "message"), [
    ("s3://", "names no bucket"),
    ("s3://localhost:9000", "expected s3://host:port/bucket/path"),
    ("gs://bucket/models", "Google Cloud Storage is not supported"),
    ("as://account/container", "Azure Storage is not supported"),
])
def test_urls_rayinfer_cannot_read_are_refused_naming_them(url: str, message: str) -> None:
    with pytest.raises(ModelConfigError, match=message) as info:
        parse_s3_url(url)
    assert url in info.value.message


def test_a_folder_is_served_as_it_is(tmp_path: Path) -> None:
    assert local_repository(tmp_path) == tmp_path
    assert local_repository(str(tmp_path)) == tmp_path


def test_the_copy_is_the_repository_and_unchanged_objects_are_not_copied_again(bucket) -> None:
    s3, name, url, tmp_path = bucket
    copy = local_repository(url)
    assert copy == tmp_path / "copy"
    source_files = sorted(p.relative_to(tmp_path / "source") for p in (tmp_path / "source").rglob("*")
                          if p.is_file() and "__pycache__" not in p.parts)
    copied = sorted(p.relative_to(copy) for p in copy.rglob("*") if p.is_file() and not p.name.startswith(".rayinfer"))
    assert copied == source_files
    assert (copy / "mlp" / "1" / "model.onnx").read_bytes() == (tmp_path / "source" / "mlp" / "1" / "model.onnx").read_bytes()
    assert {entry.name for entry in scan_repository(copy) if entry.error is None} >= {"mlp", "simple", "simple_identity"}

    before = {p: p.stat().st_mtime_ns for p in copy.rglob("*") if p.is_file() and not p.name.startswith(".rayinfer")}
    config = "simple/config.pbtxt"
    s3.put_object(Bucket=name, Key=f"models/{config}", Body=b"changed")
    s3.put_object(Bucket=name, Key="models/simple/3/model.onnx", Body=b"new version")
    s3.delete_object(Bucket=name, Key="models/mlp/1/model.onnx")
    local_repository(url)
    after = {p: p.stat().st_mtime_ns for p in copy.rglob("*") if p.is_file() and not p.name.startswith(".rayinfer")}
    assert (copy / config).read_bytes() == b"changed" and (copy / "simple" / "3" / "model.onnx").is_file()
    assert not (copy / "mlp" / "1").exists()  # the object went, and its now empty folder
    changed = {p for p in before if p in after and before[p] != after[p]}
    assert changed == {copy / config}  # nothing else was written again


def test_a_model_replica_copies_its_own_model_only(bucket) -> None:
    _, _, url, _ = bucket
    copy = local_repository(url, ["simple_identity"])
    assert sorted(p.name for p in copy.iterdir() if not p.name.startswith(".")) == ["simple_identity"]
    assert (copy / "simple_identity" / "1" / "model.py").is_file()
    # A later copy of another model keeps the first; the whole repository's copy adds the rest.
    local_repository(url, ["mlp"])
    assert {p.name for p in copy.iterdir() if not p.name.startswith(".")} == {"simple_identity", "mlp"}
    local_repository(url)
    assert (copy / "nlp_ensemble" / "config.pbtxt").is_file()


def test_keys_that_would_leave_the_copy_are_skipped(bucket) -> None:
    s3, name, url, tmp_path = bucket
    for key in ("models/../escaped.txt", "models/simple/../../escaped.txt", "models/./dot/file", "models/folder/"):
        s3.put_object(Bucket=name, Key=key, Body=b"x")
    copy = local_repository(url)
    assert not (tmp_path / "escaped.txt").exists() and not (copy / "escaped.txt").exists()
    assert not (copy / "dot").exists() and not (copy / "folder").exists()
    assert (copy / "simple" / "config.pbtxt").is_file()


def test_an_unreadable_repository_is_an_error_naming_it(bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    _, name, url, _ = bucket
    missing = url.replace(f"/{name}/", "/no-such-bucket/")
    with pytest.raises(ModelConfigError, match="cannot list its objects") as info:
        local_repository(missing)
    assert missing in info.value.message
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    with pytest.raises(ModelConfigError, match="Unable to locate credentials"):
        local_repository(url)


def test_rayinfer_config_keeps_the_url_for_the_replicas(bucket, capsys: pytest.CaptureFixture[str],
                                                         cli_environment: None) -> None:
    from rayinfer.cluster.cli import main

    _, _, url, _ = bucket
    assert main(["config", "--model-repository", url]) == 0
    rendered = capsys.readouterr().out
    assert f"model_repository: {url}\n" in rendered and "- name: simple_identity\n" in rendered
