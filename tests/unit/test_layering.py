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
ORDER = ["cluster", "deployments", "transport", "serving", "adapters", "repository", "protocol"]
RAY_FREE = {"transport", "serving", "adapters", "repository", "protocol"}


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


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["rayinfer", *parts])


def test_no_module_imports_itself_through_others() -> None:
    """No import cycles between rayinfer's modules (imports under TYPE_CHECKING or inside
    functions count too: a cycle is a design smell wherever it hides)."""
    graph: dict[str, set[str]] = {}
    for layer in ORDER:
        for path in (ROOT / layer).rglob("*.py"):
            graph[_module_name(path)] = {name for name in imports_of(path) if name.startswith("rayinfer.")}
    for module in graph:
        graph[module] = {name for name in graph[module] if name in graph and name != module}

    def cycle_from(start: str) -> list[str] | None:
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    return [*path, start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
        return None

    cycles = [cycle for module in sorted(graph) if (cycle := cycle_from(module)) is not None]
    assert not cycles, f"import cycle: {' -> '.join(cycles[0])}"


def test_test_modules_have_unique_basenames() -> None:
    """pytest imports test modules by basename (no packages here): two with one name stop the
    whole suite at collection."""
    tests = Path(__file__).resolve().parents[1]
    names = [path.name for path in tests.rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []


# What only deployments/serve_internals.py may use: Ray Serve's (and Ray's) private API.
PRIVATE_RAY = ("ray.serve._private", "ray.serve.context", "ray.serve.handle", "ray.experimental.internal_kv")
PRIVATE_CALLS = ("_blocking", "_get_global_client", "get_serve_details", "_internal_kv", "unique_id")


def test_ray_private_api_only_in_serve_internals() -> None:
    found = []
    for layer in ORDER:
        for path in sorted((ROOT / layer).rglob("*.py")):
            if path.name == "serve_internals.py":
                continue
            found += [f"{path.relative_to(ROOT)}: import {name}" for name in imports_of(path)
                      if name.startswith(PRIVATE_RAY)]
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in PRIVATE_CALLS:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
                elif isinstance(node, ast.keyword) and node.arg in PRIVATE_CALLS:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.arg}=")
    assert found == []
