"""docs/compatibility.md: every row says Y, P, N or 'beyond Triton'; every Y and P row names a
test, and every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _rows() -> list[list[str]]:
    rows = []
    for line in (ROOT / "docs" / "compatibility.md").read_text().splitlines():
        if line.startswith("|") and not line.startswith(("| feature", "|---")):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_every_supported_row_names_a_test_that_exists() -> None:
    rows = _rows()
    assert len(rows) >= 50
    for feature, status, _notes, verified in rows:
        assert status in ("Y", "P", "N", "beyond Triton"), feature
        if status == "N":
            continue
        match = re.fullmatch(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", verified)
        assert match, f"{feature!r}: 'verified by' must name a test, got {verified!r}"
        path, name = match.groups()
        source = (ROOT / path).read_text()
        if name:
            assert re.search(rf"^(async )?def {name}\(", source, re.MULTILINE), f"{feature!r}: no {name} in {path}"
