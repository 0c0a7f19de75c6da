"""Writing a model folder of a repository: ``config.pbtxt`` and a version's model file."""

from __future__ import annotations

from pathlib import Path


def finish_onnx(model):
    """An ONNX model built in code, at the IR version onnxruntime reads, checked."""
    import onnx

    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def write_model(repository: Path, name: str, config: str | None, model, version: int = 1) -> Path:
    """Write ``<repository>/<name>/config.pbtxt`` (if given) and ``<version>/model.onnx``."""
    import onnx

    version_dir = Path(repository) / name / str(version)
    version_dir.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (Path(repository) / name / "config.pbtxt").write_text(config)
    onnx.save(model, str(version_dir / "model.onnx"))
    return version_dir.parent


def write_python_model(repository: Path, name: str, config: str, code: str, version: int = 1) -> Path:
    """Write ``<repository>/<name>/config.pbtxt`` and ``<version>/model.py``."""
    version_dir = Path(repository) / name / str(version)
    version_dir.mkdir(parents=True, exist_ok=True)
    (Path(repository) / name / "config.pbtxt").write_text(config)
    (version_dir / "model.py").write_text(code)
    return version_dir.parent
