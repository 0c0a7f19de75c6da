"""The documentation site builds in MkDocs' strict mode (a broken link or a page left out of
the navigation fails it), and every link in README.md resolves."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    result = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr[-3000:]
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = [next(iter(item.values())) for item in config["nav"]]
    for page in pages:
        html = "index.html" if page == "index.md" else f"{page.removesuffix('.md')}/index.html"
        assert (tmp_path / "site" / html).is_file(), page
    listed = set(pages)
    assert {p.name for p in (ROOT / "docs").glob("*.md")} <= listed, "a page of docs/ is not in mkdocs.yml's nav"


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    with (docs / "getting-started.md").open("a") as page:
        page.write("\nSee [a page that is not there](no-such-page.md).\n")
    config = (ROOT / "mkdocs.yml").read_text().replace("docs_dir: docs", f"docs_dir: {docs}")
    (tmp_path / "mkdocs.yml").write_text(config)
    result = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-page.md" in result.stderr


def test_every_link_in_the_readme_resolves() -> None:
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert targets
    for target in targets:
        if target.startswith(("http://", "https://")):
            continue
        path = target.split("#", 1)[0]
        assert (ROOT / path).exists(), f"README.md links to {target}, which is not in the repository"
