"""The answers of a gRPC stream a test opened, and, when one does not come or is an error, what
the server's front holds at that moment and the server's latest warnings (a stream that failed
now and then in suite runs was found this way: a model replica closed a connection too early)."""

from __future__ import annotations

import os
import queue
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from rayinfer.transport.front_config import EVENTS_RING


def stream_answers(received: queue.Queue, count: int, server: dict, timeout_s: float = 60.0) -> list[Any]:
    """``count`` (result, error) items from a stream callback's queue, each within
    ``timeout_s`` and none an error; an AssertionError with the front's state and the server's
    latest warnings when one does not come or is an error (a stream that failed ends with its
    error: nothing comes after it)."""
    answers = []
    for _ in range(count):
        try:
            answer = received.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"answer {len(answers) + 1} of {count} did not come within {timeout_s:g} s\n"
                                 f"{front_state(server)}\n{server_warnings()}") from None
        if answer[1] is not None:
            raise AssertionError(f"answer {len(answers) + 1} of {count} is an error: {answer[1]}\n"
                                 f"{front_state(server)}\n{server_warnings()}")
        answers.append(answer)
    return answers


def front_state(server: dict) -> str:
    """HAProxy's sessions, its latest abnormal ones and its serve_grpc servers in the session
    server's front, and who holds each TCP connection to the gRPC port."""
    from conftest import front_command, front_folder  # the tests' own conftest, on sys.path as this module is

    lines = []
    try:
        front = front_folder(server)
        for command in ("show sess", f"show events {EVENTS_RING}", "show servers state serve_grpc"):
            lines += [f"# {command}", front_command(front, command).strip()]
    except (OSError, ValueError) as exc:
        lines.append(f"the front's admin socket: {exc}")
    port = int(server["grpc_url"].rpartition(":")[2])
    lines.append(f"# TCP connections of port {port}: local -> remote, state, queues, holder")
    lines += _connections(port)
    return "\n".join(lines)


def server_warnings(lines: int = 40, within_s: float = 300.0) -> str:
    """The latest warnings and errors in the logs of Ray Serve's processes (the replicas, the
    proxy, the controller) written in the last ``within_s`` seconds."""
    found = []
    folder = Path(tempfile.gettempdir()) / "ray" / "session_latest" / "logs" / "serve"
    for log in sorted(folder.glob("*.log")) if folder.is_dir() else []:
        try:
            if time.time() - log.stat().st_mtime > within_s:
                continue
            found += [f"{log.name}: {line}" for line in log.read_text(errors="replace").splitlines()[-2000:]
                      if line.startswith(("WARNING", "ERROR"))][-10:]
        except OSError:
            continue  # a log rotated away meanwhile
    return "\n".join([f"# warnings and errors in {folder}", *found[-lines:]])


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
