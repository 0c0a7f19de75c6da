"""The answers of a gRPC stream a test opened, and, when they do not come, what the server's
front holds at that moment (an unanswered stream has failed a few suite runs, and could not be
caught on demand: the failure message carries what its cause needs)."""

from __future__ import annotations

import os
import queue
import re
from pathlib import Path
from typing import Any


def stream_answers(received: queue.Queue, count: int, server: dict, timeout_s: float = 60.0) -> list[Any]:
    """``count`` items from a stream callback's queue, each within ``timeout_s``; an
    AssertionError with the front's state when one does not come."""
    answers = []
    for _ in range(count):
        try:
            answers.append(received.get(timeout=timeout_s))
        except queue.Empty:
            raise AssertionError(f"answer {len(answers) + 1} of {count} did not come within {timeout_s:g} s\n"
                                 f"{front_state(server)}") from None
    return answers


def front_state(server: dict) -> str:
    """HAProxy's sessions and its serve_grpc servers in the session server's front, and who
    holds each TCP connection to the gRPC port."""
    from conftest import front_command, front_folder  # the tests' own conftest, on sys.path as this module is

    lines = []
    try:
        front = front_folder(server)
        for command in ("show sess", "show servers state serve_grpc"):
            lines += [f"# {command}", front_command(front, command).strip()]
    except (OSError, ValueError) as exc:
        lines.append(f"the front's admin socket: {exc}")
    port = int(server["grpc_url"].rpartition(":")[2])
    lines.append(f"# TCP connections of port {port}: local -> remote, state, queues, holder")
    lines += _connections(port)
    return "\n".join(lines)


def _connections(port: int) -> list[str]:
    holders: dict[str, str] = {}  # socket inode -> "pid name"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            name = (entry / "cmdline").read_bytes().replace(b"\0", b" ")[:80].decode(errors="replace").strip()
            for fd in (entry / "fd").iterdir():
                match = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
                if match:
                    holders[match.group(1)] = f"{entry.name} {name}"
        except OSError:
            continue  # a process that ended meanwhile
    rows = []
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            local, remote = (int(address.rpartition(":")[2], 16) for address in fields[1:3])
            if port in (local, remote) and remote:
                rows.append(f"{local} -> {remote} state {fields[3]} tx:rx {fields[4]} {holders.get(fields[9], '-')}")
    return rows
