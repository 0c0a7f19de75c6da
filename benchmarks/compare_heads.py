#!/usr/bin/env python3
"""Oversized request heads: how the Triton anchor and rayinfer answer them, in the same run.

    .venv/bin/python benchmarks/compare_heads.py

Starts the anchor's tritonserver on its Python model ``identity_fp32`` and rayinfer on the
example repository with that model beside it (inside a private network namespace), sends each
server heads of growing size and header count (``GET /v2/models/identity_fp32/ready``), on a new
connection and as the second request of a kept connection, and tabulates each answer: its status
and whether its body is JSON, or the connection closed (or reset) without one. rayinfer's kept
connections are of two kinds: one a model's replica holds (its first request was the model's) and
one the front's HAProxy holds (its first request named a model with no replica). Writes the table
to docs/benchmarks.md.
"""

from __future__ import annotations

import json
import re
import socket
import sys
import tempfile
import time
from pathlib import Path

from compare_triton import (PYTHON_MODEL, ROOT, ensure_anchor, in_private_netns, python_model_repository,
                            reexec_in_netns, start_rayinfer, start_triton, stop_server, stop_triton, wait_ready, write_doc)

TRITON_PORT = 18980
RAYINFER_PORT = 18990
MARKS = ("<!-- compare_heads:begin -->", "<!-- compare_heads:end -->")
PATH = f"/v2/models/{PYTHON_MODEL}/ready".encode()


def headers(count: int, size: int = 0) -> bytes:
    """``count`` headers of about ``size`` bytes each (``x-N: v`` when 0)."""
    return b"".join(b"x-%d: %b\r\n" % (i, b"v" * max(size - 8, 1)) for i in range(count))


# (what the head holds, its extra header lines, its path)
CASES = (
    ("100 headers (Host and 99 more)", headers(99), PATH),
    ("150 headers", headers(150), PATH),
    ("5,000 headers (about 54 KB)", headers(5000), PATH),
    ("one header of 8,100 bytes", b"x-big: %b\r\n" % (b"a" * 8100), PATH),
    ("one header of 9,000 bytes", b"x-big: %b\r\n" % (b"a" * 9000), PATH),
    ("one header of 16,000 bytes", b"x-big: %b\r\n" % (b"a" * 16000), PATH),
    ("one header of 20,000 bytes", b"x-big: %b\r\n" % (b"a" * 20000), PATH),
    ("one header of 70,000 bytes", b"x-big: %b\r\n" % (b"a" * 70000), PATH),
    ("80 headers of 250 bytes (20 KB)", headers(80, 250), PATH),
    ("25,000 headers of 40 bytes (1 MB)", headers(25000, 40), PATH),
    ("a path of 10,000 bytes", b"", PATH + b"?" + b"q" * 10000),
)


def read_answer(sock: socket.socket) -> str:
    """The answer to one request: "200", "400 JSON", "400 HTML", "closed, no answer", "reset"."""
    data = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return "closed, no answer" if not data else f"closed mid-answer ({data[:30]!r})"
            data += chunk
            if b"\r\n\r\n" not in data:
                continue
            head, _, body = data.partition(b"\r\n\r\n")
            length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
            if length is None or len(body) >= int(length.group(1)):
                break
    except ConnectionResetError:
        return "reset, no answer" if not data else "reset mid-answer"
    except socket.timeout:
        return "no answer within 20 s"
    status = head.split(b" ", 2)[1].decode()
    if not body:
        return status
    try:
        json.loads(body)
        return f"{status} JSON"
    except ValueError:
        return f"{status} {'HTML' if body.lstrip().startswith(b'<') else 'text'}"


def ask(port: int, first: bytes | None, extra: bytes, path: bytes) -> str:
    """Send ``first`` (a path, answered before) and then the head under test on one connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        if first is not None:
            sock.sendall(b"GET %b HTTP/1.1\r\nHost: x\r\n\r\n" % first)
            answer = read_answer(sock)
            if not answer[:3].isdigit() or "closed" in answer:
                return f"first request: {answer}"  # not a kept connection after all
        try:
            sock.sendall(b"GET %b HTTP/1.1\r\nHost: x\r\n%b\r\n" % (path, extra))
        except (BrokenPipeError, ConnectionResetError):
            return "reset while sending"
        return read_answer(sock)


def measure(port: int, kinds: dict[str, bytes | None]) -> dict[str, list[str]]:
    return {kind: [ask(port, first, extra, path) for _, extra, path in CASES] for kind, first in kinds.items()}


def run_triton(work: Path) -> dict[str, list[str]]:
    repo = python_model_repository(work / "triton-repository", example=False)
    proc = start_triton(repo, TRITON_PORT, work / "triton.log")
    try:
        wait_ready(TRITON_PORT, proc, 240)
        return measure(TRITON_PORT, {"Triton 2.51, new connection": None, "Triton, kept connection": PATH})
    finally:
        stop_triton(proc)


def run_rayinfer(work: Path) -> dict[str, list[str]]:
    repo = python_model_repository(work / "rayinfer-repository", example=True)
    proc = start_rayinfer(repo, RAYINFER_PORT, work / "rayinfer.log")
    try:
        wait_ready(RAYINFER_PORT, proc, 600)
        return measure(RAYINFER_PORT, {
            "rayinfer, new connection": None,
            "rayinfer, kept by a replica": PATH,
            "rayinfer, kept by HAProxy": b"/v2/models/no_such_model/ready",
        })
    finally:
        stop_server(proc)


def section(results: dict[str, list[str]]) -> str:
    kinds = list(results)
    lines = [
        MARKS[0],
        f"Measured {time.strftime('%Y-%m-%d')}, one run: `GET /v2/models/{PYTHON_MODEL}/ready` with a head of each "
        "kind, on a new connection and as the second request of a kept connection; each server's answer.",
        "",
        "| head | " + " | ".join(kinds) + " |",
        "|---" * (len(kinds) + 1) + "|",
    ]
    for i, (name, _, _) in enumerate(CASES):
        lines.append(f"| {name} | " + " | ".join(results[kind][i] for kind in kinds) + " |")
    lines += ["", "Reproduce: `.venv/bin/python benchmarks/compare_heads.py`", MARKS[1]]
    return "\n".join(lines)


def main() -> int:
    ensure_anchor()  # before the network goes away
    if not in_private_netns():
        reexec_in_netns()
    work = Path(tempfile.mkdtemp(prefix="heads-"))
    results = {**run_triton(work), **run_rayinfer(work)}
    text = section(results)
    print(text)
    write_doc(text, ROOT / "docs" / "benchmarks.md", MARKS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
