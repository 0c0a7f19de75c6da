"""The package layering of STYLE.md: lower layers never import higher ones, and only
``deployments`` (and the CLI) import Ray."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Each layer may import the layers after it, never the ones before it.
ORDER = ["cluster", "deployments", "adapters", "repository", "protocol"]
RAY_FREE = {"adapters", "repository", "protocol"}


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", ORDER)
def test_layer_imports_only_lower_layers(layer: str) -> None:
    higher = ORDER[: ORDER.index(layer)]
    for path in (ROOT / layer).rglob("*.py"):
        for name in imports_of(path):
            parts = name.split(".")
            if parts[0] == "rayinfer" and len(parts) > 1:
                assert parts[1] not in higher, f"{path.relative_to(ROOT)} imports {name}"
            if layer in RAY_FREE:
                assert parts[0] != "ray", f"{path.relative_to(ROOT)} imports {name}"


def test_mypy_on_ray_free_layers() -> None:
    result = subprocess.run(
        [str(Path(sys.executable).parent / "mypy"), "--config-file", "pyproject.toml", *sorted(RAY_FREE)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
