"""Keeps the front's HAProxy running for as long as a ``/v2`` replica owns it, and a while after.

Run as ``python front_keeper.py <folder> <haproxy binary>`` (standard library only, in a
session of its own). It starts HAProxy on ``<folder>/haproxy.cfg`` as its child, which dies with
it. The ``/v2`` replica that owns the front writes its PID to ``<folder>/owner``. If that
process dies (a crash, Ray's memory monitor), the keeper and HAProxy stay up, so that inference
calls keep reaching the model replicas while Serve starts a new ``/v2`` replica, which takes the
front over by writing its own PID there. If no owner is alive for :data:`ORPHAN_GRACE_S` (60 s,
or ``RAYINFER_FRONT_ORPHAN_GRACE_S``), the keeper stops HAProxy and exits: the server is gone.
SIGTERM stops both at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ORPHAN_GRACE_S = float(os.environ.get("RAYINFER_FRONT_ORPHAN_GRACE_S", "60"))
_PR_SET_PDEATHSIG = 1


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def owner_alive(folder: Path) -> bool:
    try:
        return pid_alive(int((folder / "owner").read_text()))
    except (OSError, ValueError):
        return False


def _die_with_parent() -> None:
    """In the child before exec: HAProxy gets SIGTERM when the keeper dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def main(folder: Path, binary: str) -> int:
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with (folder / "haproxy.log").open("wb") as log:
        haproxy = subprocess.Popen([binary, "-f", str(folder / "haproxy.cfg"), "-db"], stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        orphaned_since: float | None = None
        while haproxy.poll() is None and not stopping:
            if owner_alive(folder):
                orphaned_since = None
            elif orphaned_since is None:
                orphaned_since = time.monotonic()
            elif time.monotonic() - orphaned_since > ORPHAN_GRACE_S:
                break
            time.sleep(0.25)
        if haproxy.poll() is None:
            haproxy.terminate()
            try:
                haproxy.wait(5)
            except subprocess.TimeoutExpired:
                haproxy.kill()
                haproxy.wait()
    return haproxy.returncode or 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2]))
