"""ray-configs/serve-example.yaml is what ``rayinfer config`` prints for the example repository."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayinfer.cluster.cli import main
from rayinfer.cluster.example_repository import write_example_repository

EXAMPLE = Path(__file__).resolve().parents[3] / "ray-configs" / "serve-example.yaml"


def without_header(text: str) -> str:
    """The YAML after the leading comment lines."""
    lines = text.splitlines(keepends=True)
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return "".join(lines)


def test_serve_example_is_current(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], cli_environment: None
) -> None:
    write_example_repository(tmp_path / "examples" / "model_repository")
    monkeypatch.chdir(tmp_path)
    assert main(["config", "--model-repository", "examples/model_repository", "--relative-paths"]) == 0
    rendered = capsys.readouterr().out
    assert rendered == without_header(EXAMPLE.read_text()), (
        "ray-configs/serve-example.yaml is out of date: run ray-configs/regenerate-serve-example.sh"
    )
    assert "name: simple_identity" in rendered


def test_relative_paths_from_an_absolute_repository(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str], cli_environment: None) -> None:
    """--relative-paths writes the repository relative to the current directory, however it was given."""
    (tmp_path / "models" / "empty").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "models")
    assert main(["config", "--model-repository", str(tmp_path / "models"), "--relative-paths"]) == 0
    assert "model_repository: .\n" in capsys.readouterr().out
    assert main(["config", "--model-repository", "."]) == 0
    assert f"model_repository: {tmp_path / 'models'}\n" in capsys.readouterr().out
