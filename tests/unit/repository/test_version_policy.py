"""Triton's version_policy selection and version folder names."""

from __future__ import annotations

import pytest
from google.protobuf import text_format

from rayinfer.repository.model_config import ModelConfig
from rayinfer.repository.version_policy import select_versions, version_dirs


def _policy(text: str):
    return text_format.Parse(f"version_policy {{ {text} }}", ModelConfig()).version_policy


@pytest.mark.parametrize(
    "text, available, expected",
    [
        ("latest { num_versions: 1 }", [1, 3, 2], [3]),
        ("latest { num_versions: 2 }", [1, 3, 2, 10], [3, 10]),
        ("latest { num_versions: 5 }", [2, 1], [1, 2]),
        ("all { }", [3, 1, 2], [1, 2, 3]),
        ("specific { versions: [ 1, 3, 7 ] }", [1, 2, 3], [1, 3]),
        ("specific { versions: [ 7 ] }", [1, 2], []),
        ("latest { num_versions: 1 }", [], []),
    ],
)
def test_select_versions(text: str, available: list[int], expected: list[int]) -> None:
    assert select_versions(_policy(text), available) == expected


def test_default_policy_is_latest_one() -> None:
    assert select_versions(None, [4, 2, 9]) == [9]
    assert select_versions(ModelConfig().version_policy, [4, 2, 9]) == [9]
    assert select_versions(None, []) == []


def test_duplicates_are_ignored() -> None:
    assert select_versions(_policy("all { }"), [2, 2, 1]) == [1, 2]


def test_version_dirs_ignores_non_numeric_folders() -> None:
    assert version_dirs(["2", "10", "1", "latest", "v3", "1.5", "-1", ".ipynb_checkpoints"]) == [1, 2, 10]
    assert version_dirs([]) == []
