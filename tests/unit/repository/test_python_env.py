"""A Python model's own packages: requirements.txt or the ``pip_requirements`` parameter
(installed by pip into a node-local environment), and Triton's EXECUTION_ENV_PATH."""

from __future__ import annotations

import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from rayinfer.adapters.python_backend.environment import activate_execution_env
from rayinfer.protocol.errors import ModelConfigError
from google.protobuf import text_format

from rayinfer.repository.model_config import ModelConfig
from rayinfer.repository.python_env import model_requirements


def parse_config_text(text: str) -> ModelConfig:
    return text_format.Parse(text, ModelConfig())


def config(text: str = "") -> ModelConfig:
    return parse_config_text('name: "m"\nbackend: "python"\n' + text)


def test_requirements_beside_model_py_with_paths_made_absolute(tmp_path: Path) -> None:
    (tmp_path / "1" / "wheels").mkdir(parents=True)
    (tmp_path / "1" / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "1" / "requirements.txt").write_text(
        "# comment\nnumpy>=1.0  # pinned\n\n./wheels/a-1.0-py3-none-any.whl\n--find-links=./wheels\n-f ./wheels\n")
    (tmp_path / "requirements.txt").write_text("ignored-when-the-version-folder-has-one\n")
    wheels = str((tmp_path / "1" / "wheels").resolve())
    assert model_requirements(tmp_path, 1, config()) == ["numpy>=1.0", f"{wheels}/a-1.0-py3-none-any.whl",
                                                          f"--find-links={wheels}", f"-f {wheels}"]


def test_the_pip_parameter_and_the_model_folder_file(tmp_path: Path) -> None:
    (tmp_path / "requirements.txt").write_text("requests\n")
    text = 'parameters: { key: "pip_requirements" value: { string_value: "six==1.16, attrs" } }\n'
    assert model_requirements(tmp_path, 1, config(text)) == ["requests", "six==1.16", "attrs"]
    assert model_requirements(tmp_path / "none", 1, config()) == []
    onnx = parse_config_text('name: "m"\nbackend: "onnxruntime"\n')
    assert model_requirements(tmp_path, 1, onnx) == []  # only Python models


def test_execution_env_path_puts_the_environments_packages_first(tmp_path: Path) -> None:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    source = tmp_path / "src" / "lib" / version / "site-packages"
    source.mkdir(parents=True)
    (source / "probe_mod.py").write_text("VALUE = 1\n")
    archive = tmp_path / "env.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "src" / "lib", arcname="lib")
    site = activate_execution_env("$$TRITON_MODEL_DIRECTORY/env.tar.gz", tmp_path, "m")
    try:
        assert sys.path[0] == str(site) and (site / "probe_mod.py").read_text() == "VALUE = 1\n"
    finally:
        sys.path.remove(str(site))


def test_execution_env_path_errors_name_the_model_and_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="model 'm': EXECUTION_ENV_PATH .*missing.tar.gz' does not exist"):
        activate_execution_env(str(tmp_path / "missing.tar.gz"), tmp_path, "m")
    (tmp_path / "old" / "lib" / "python2.7" / "site-packages").mkdir(parents=True)
    with pytest.raises(ModelConfigError, match="has packages for python2.7; this server runs python3"):
        activate_execution_env(str(tmp_path / "old"), tmp_path, "m")
    (tmp_path / "bad.tar.gz").write_bytes(b"not a tarball")
    with pytest.raises(ModelConfigError, match="is not a readable tarball"):
        activate_execution_env(str(tmp_path / "bad.tar.gz"), tmp_path, "m")


def test_requirements_install_once_beside_the_servers_packages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip installs only what the server lacks (numpy is the server's), into a node-local
    environment that a second replica reuses; pip's own reason when it cannot."""
    import importlib

    from python_models import write_wheel
    from rayinfer.adapters.python_backend import requirements

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    wheel = write_wheel(tmp_path / "wheels", "rayinfer_env_probe", "VALUE = 11\n")
    packages = ["--no-index", f"--find-links={wheel.parent}", "rayinfer_env_probe", "numpy"]
    site = requirements.activate_requirements(packages, "m")
    assert sys.path[0] == str(site)
    assert importlib.import_module("rayinfer_env_probe").VALUE == 11
    assert sorted(p.name for p in site.iterdir() if not p.name.startswith("_")) == [
        "rayinfer_env_probe", "rayinfer_env_probe-1.0.dist-info"]  # numpy was not installed again
    marker = requirements.environment_root(packages) / ".installed"
    stamp = marker.stat().st_mtime_ns
    assert requirements.activate_requirements(packages, "m") == site and marker.stat().st_mtime_ns == stamp
    with pytest.raises(ModelConfigError, match="^pip could not install the model's requirements: "
                                               "No matching distribution found for nope==1$"):
        requirements.activate_requirements(["--no-index", "nope==1"], "m")
    assert not requirements.environment_root(["--no-index", "nope==1"]).exists()
