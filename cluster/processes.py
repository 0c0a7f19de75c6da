"""The processes a server started, found in /proc, and stopping those that outlive it.

``rayinfer serve`` with an embedded Ray node stops what was under it once ``ray.shutdown()``
returns: Ray's dashboard and runtime-env agents outlive their raylet by 20 s and more,
reparented to init.
"""

from __future__ import annotations

import os
import signal
import time

Process = tuple[int, str]  # (PID, start time in clock ticks since boot)


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()
    except OSError:
        return None


def descendants(pid: int) -> list[Process]:
    """Every process under ``pid``."""
    children: dict[int, list[Process]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(entry)) is not None:
            children.setdefault(int(fields[1]), []).append((int(entry), fields[19]))
    found, parents = [], [pid]
    while parents:
        for child in children.get(parents.pop(), []):
            found.append(child)
            parents.append(child[0])
    return found


def alive(process: Process) -> bool:
    """Whether the process still runs (the same one: its start time, not a reused PID)."""
    fields = _stat(process[0])
    return fields is not None and fields[19] == process[1] and fields[0] != "Z"


def stop_processes(processes: list[Process], grace_s: float = 3.0) -> None:
    """SIGTERM to those of ``processes`` still running, SIGKILL to any left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = [p for p in processes if alive(p)]
        for pid, _ in left:
            try:
                os.kill(pid, sig)
            except OSError:  # exited meanwhile
                continue
        deadline = time.monotonic() + grace_s
        while left and time.monotonic() < deadline:
            time.sleep(0.05)  # polled: once reparented they are not this process's children to wait on
            left = [p for p in left if alive(p)]
        if not left:
            return
