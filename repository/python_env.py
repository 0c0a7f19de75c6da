"""A Python model's own packages: the requirement lines its replicas install.

Triton needs a conda-pack tarball for a Python model's dependencies (``EXECUTION_ENV_PATH``,
still honoured: :mod:`rayinfer.adapters.python_backend.environment`). rayinfer also takes a
``requirements.txt`` beside ``model.py`` (in the version folder, else the model folder) or a
``pip_requirements`` parameter in config.pbtxt (one requirement per line or comma-separated);
each replica installs them before importing ``model.py``
(:mod:`rayinfer.adapters.python_backend.requirements`). A relative path in a requirement (a wheel,
``-f ./wheels``) is taken from the folder of the file that names it (the model folder for the
parameter).
"""

from __future__ import annotations

from pathlib import Path

from rayinfer.repository.model_config import ModelConfig

REQUIREMENTS_FILE = "requirements.txt"
PIP_PARAMETER = "pip_requirements"
ENV_PARAMETER = "EXECUTION_ENV_PATH"  # a conda-pack environment (adapters/python_backend/environment.py)


def model_requirements(model_dir: Path, version: int, config: ModelConfig) -> list[str]:
    """A Python model's requirement lines (none for other models, or when it names none)."""
    if (config.backend or "").lower() != "python":
        return []
    lines: list[str] = []
    for folder in (model_dir / str(version), model_dir):
        path = folder / REQUIREMENTS_FILE
        if path.is_file():
            lines += _absolute(path.read_text().splitlines(), folder)
            break
    parameter = config.parameters.get(PIP_PARAMETER)
    if parameter is not None and parameter.string_value.strip():
        text = parameter.string_value.replace(",", "\n")
        lines += _absolute(text.splitlines(), model_dir)
    return [line for line in lines if line]


def _absolute(lines: list[str], folder: Path) -> list[str]:
    """Requirement lines without comments, with paths that exist under ``folder`` made absolute."""
    out = []
    for line in lines:
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        tokens = []
        for token in line.split():
            prefix, _, value = token.rpartition("=") if token.startswith("--") and "=" in token else ("", "", token)
            candidate = folder / value
            if value and not Path(value).is_absolute() and candidate.exists():
                value = str(candidate.resolve())
            tokens.append(f"{prefix}={value}" if prefix else value)
        out.append(" ".join(tokens))
    return out


def own_modules(folder: Path, model_file: Path) -> bool:
    """Whether ``folder`` holds Python a model can import besides its model file: a module
    (``*.py``, a compiled extension) or a package (a folder of modules)."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return False
    for entry in entries:
        if entry == model_file or not entry.name.split(".", 1)[0].isidentifier():
            continue  # a version folder ("1") or a hidden file cannot be imported
        if entry.name == "__pycache__":
            continue
        if entry.is_file() and entry.suffix in (".py", ".so", ".pyd", ".pyc"):
            return True
        if entry.is_dir() and any(any(entry.rglob(pattern)) for pattern in ("*.py", "*.so", "*.pyc")):
            return True  # a package, a namespace package or a compiled one
    return False
