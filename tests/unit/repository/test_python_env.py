"""A Python model's own packages: the runtime environment from requirements.txt or the
``pip_requirements`` parameter, and Triton's EXECUTION_ENV_PATH."""

from __future__ import annotations

import sys
import tarfile
from pathlib import Path

import pytest

from rayinfer.adapters.python_backend.environment import activate_execution_env
from rayinfer.protocol.errors import ModelConfigError
from google.protobuf import text_format

from rayinfer.repository.model_config import ModelConfig
from rayinfer.repository.python_env import python_runtime_env


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
    env = python_runtime_env(tmp_path, 1, config())
    assert env == {"pip": {"packages": ["numpy>=1.0", f"{wheels}/a-1.0-py3-none-any.whl",
                                        f"--find-links={wheels}", f"-f {wheels}"], "pip_check": False}}


def test_the_pip_parameter_and_the_model_folder_file(tmp_path: Path) -> None:
    (tmp_path / "requirements.txt").write_text("requests\n")
    text = 'parameters: { key: "pip_requirements" value: { string_value: "six==1.16, attrs" } }\n'
    assert python_runtime_env(tmp_path, 1, config(text))["pip"]["packages"] == ["requests", "six==1.16", "attrs"]
    assert python_runtime_env(tmp_path / "none", 1, config()) is None
    onnx = parse_config_text('name: "m"\nbackend: "onnxruntime"\n')
    assert python_runtime_env(tmp_path, 1, onnx) is None  # only Python models


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
