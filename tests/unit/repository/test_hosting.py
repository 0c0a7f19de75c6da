"""Which models the pool may host, and the ``rayinfer_hosting`` parameter's rules."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format

from rayinfer.protocol.errors import ModelConfigError
from rayinfer.repository.hosting import model_hosting, pool_obstacle
from rayinfer.repository.instance_groups import ReplicaPlan
from rayinfer.repository.model_config import ModelConfig, fill_defaults

PATH = Path("/models/m/config.pbtxt")
ONE_CPU = ReplicaPlan(1, "KIND_CPU")


def config(text: str) -> ModelConfig:
    parsed = text_format.Parse('name: "m"\n' + text, ModelConfig())
    fill_defaults(parsed)
    return parsed


def hosting(text: str, server: str = "dedicated", plan: ReplicaPlan = ONE_CPU) -> str:
    return model_hosting(config(text), PATH, plan, server, 1)


ONNX = 'platform: "onnxruntime_onnx"\n'


def test_the_server_default_pools_only_models_that_need_nothing_of_their_own() -> None:
    assert hosting(ONNX) == "dedicated"
    assert hosting(ONNX, "pool") == "pool"
    for text, plan in [
        ('platform: "ensemble"\n', ONE_CPU),
        (ONNX, ReplicaPlan(2, "KIND_CPU")),
        (ONNX, ReplicaPlan(1, "KIND_GPU", 1.0)),
        (ONNX + 'parameters { key: "autoscaling_max_replicas" value: { string_value: "4" } }\n', ONE_CPU),
    ]:
        assert hosting(text, "pool", plan) == "dedicated", text


def test_a_sequence_model_is_pooled() -> None:
    assert hosting(ONNX + "sequence_batching { }\n", "pool") == "pool"


def test_the_models_parameter_overrides_the_server() -> None:
    asks_pool = ONNX + 'parameters { key: "rayinfer_hosting" value: { string_value: "Pool" } }\n'
    asks_own = ONNX + 'parameters { key: "rayinfer_hosting" value: { string_value: "dedicated" } }\n'
    assert hosting(asks_pool) == "pool"
    assert hosting(asks_own, "pool") == "dedicated"


def test_a_model_that_asks_for_the_pool_and_cannot_have_it_is_refused_naming_the_file_and_why() -> None:
    text = ONNX + 'parameters { key: "rayinfer_hosting" value: { string_value: "pool" } }\n'
    with pytest.raises(ModelConfigError, match=r"/models/m/config.pbtxt: .*asks for the pool, but it has 3 instances"):
        hosting(text, plan=ReplicaPlan(3, "KIND_CPU"))
    with pytest.raises(ModelConfigError, match="must be one of dedicated, pool, got 'shared'"):
        hosting(ONNX + 'parameters { key: "rayinfer_hosting" value: { string_value: "shared" } }\n')


PYTHON = 'backend: "python"\n'


def python_model(root: Path, **files: str) -> Path:
    """A Python model's folder under ``root`` with version 1's model.py and ``files`` (path: text)."""
    folder = root / "m"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text("class TritonPythonModel: pass\n")
    (folder / "config.pbtxt").write_text(PYTHON)
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def test_a_python_model_with_only_its_model_file_is_pooled(tmp_path: Path) -> None:
    folder = python_model(tmp_path, **{"1/data.json": "{}", "README.md": "", ".hidden.py": ""})
    assert model_hosting(config(PYTHON), folder / "config.pbtxt", ONE_CPU, "pool", 1) == "pool"


@pytest.mark.parametrize("files, reason", [
    ({"1/utils.py": ""}, "holds Python modules besides model.py"),
    ({"helpers/__init__.py": ""}, "holds Python modules besides model.py"),
    ({"1/requirements.txt": "numpy\n"}, "requirements of its own"),
])
def test_a_python_model_with_modules_or_packages_of_its_own_stays_dedicated(
        tmp_path: Path, files: dict[str, str], reason: str) -> None:
    folder = python_model(tmp_path, **files)
    assert model_hosting(config(PYTHON), folder / "config.pbtxt", ONE_CPU, "pool", 1) == "dedicated"
    assert reason in (pool_obstacle(config(PYTHON), ONE_CPU, folder, 1) or "")


def test_a_python_model_with_a_conda_environment_stays_dedicated(tmp_path: Path) -> None:
    folder = python_model(tmp_path)
    text = PYTHON + 'parameters { key: "EXECUTION_ENV_PATH" value: { string_value: "env.tar.gz" } }\n'
    assert "execution environment" in (pool_obstacle(config(text), ONE_CPU, folder, 1) or "")
