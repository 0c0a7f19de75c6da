"""Every flag of ``rayinfer serve`` says what it does, and docs/command-line.md lists the same."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rayinfer.cluster.flags_reference import (
    BEGIN,
    END,
    TRITON_BEGIN,
    TRITON_END,
    serve_parser,
    reference_markdown,
    tritonserver_markdown,
)

PAGE = Path(__file__).resolve().parents[3] / "docs" / "command-line.md"


def test_every_flag_has_a_sentence_its_default_and_its_variable() -> None:
    parser = serve_parser()
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help",) or action.help == "==SUPPRESS==":
            continue
        assert action.help and len(action.help.split()) >= 4, action.option_strings
    help_text = subprocess.run([sys.executable, "-m", "rayinfer.cluster.cli", "serve", "--help"], capture_output=True,
                               text=True, check=True, env={**os.environ, "COLUMNS": "100"}).stdout
    flat = " ".join(help_text.split())
    assert "KServe v2 HTTP port. (default 8000; env RAYINFER_HTTP_PORT)" in flat
    assert "(required; env RAYINFER_MODEL_REPOSITORY)" in flat
    assert "--max-inflight-requests MAX_INFLIGHT_REQUESTS Inference calls (HTTP and gRPC together)" in flat
    assert "--allow-grpc [true|false]" in flat


def test_the_command_line_page_lists_the_flags_as_generated() -> None:
    page = PAGE.read_text()
    table = page.split(BEGIN, 1)[1].split(END, 1)[0]
    assert table.strip() == reference_markdown().strip(), (
        "docs/command-line.md is out of date: run .venv/bin/python -m rayinfer.cluster.flags_reference "
        "docs/command-line.md")
    assert "| `--startup-timeout-s` | `600.0` | `RAYINFER_STARTUP_TIMEOUT_S` |" in table
    assert "`--pinned-memory-pool-byte-size`" in table  # refused tritonserver flags are named too


def test_the_migrating_page_lists_every_tritonserver_flag_as_generated() -> None:
    page = (PAGE.parent / "migrating.md").read_text()
    table = page.split(TRITON_BEGIN, 1)[1].split(TRITON_END, 1)[0]
    assert table.strip() == tritonserver_markdown().strip(), (
        "docs/migrating.md is out of date: run .venv/bin/python -m rayinfer.cluster.flags_reference "
        "docs/command-line.md docs/migrating.md")
    assert "| `--rate-limit` | refused | the rate limiter is not implemented" in table
    assert "| `--http-port` | taken | default `8000` |" in table
    assert "| `--backend-directory` | accepted, ignored |" in table
