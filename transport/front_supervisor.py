"""Keeps the front's HAProxy running for as long as a ``/v2`` replica owns it, and a while after.

Run as ``python -m rayinfer.transport.front_supervisor <folder> <haproxy binary>`` (in a session
of its own). It starts HAProxy on ``<folder>/haproxy.cfg`` as its child, which dies with
it. The ``/v2`` replica that owns the front writes its PID to ``<folder>/owner``. If that
process dies (a crash, Ray's memory monitor), the supervisor and HAProxy stay up, so that inference
calls keep reaching the model replicas while Serve starts a new ``/v2`` replica, which takes the
front over by writing its own PID there. If no owner is alive for :data:`ORPHAN_GRACE_S` (60 s,
or ``RAYINFER_FRONT_ORPHAN_GRACE_S``), the supervisor stops HAProxy and exits: the server is gone.
If the Ray node's raylet that the owner ran under (``<folder>/raylet.pid``) is gone (``ray
stop``, the node crashed), no ``/v2`` replica can come back on this node: the supervisor stops at
once. SIGTERM stops both at once.

With an acceptor (``<folder>/acceptor`` names the HTTP and gRPC addresses and ports it owns), the supervisor
owns those ports itself and passes each connection on (:mod:`acceptor`): to a model replica,
or to HAProxy over a socket pair (one per port) whose end HAProxy inherits.

Other local users may create folders named like a front's in the temporary directory. The
server looks only at fronts' folders of its own user that no one else may write into (mkdtemp
makes them 0700), and signals a PID read from one only when that process is this user's and its
command line is this module's for that folder (:func:`front_supervisor_pid`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rayinfer.protocol.private_folders import ownership_problem
from rayinfer.transport.acceptor import HANDOFF_FD_VARIABLES, Acceptor, AcceptorLimits, listening_socket
from rayinfer.transport.front_paths import FrontPaths

logger = logging.getLogger(__name__)

DIR_PREFIX = "rayinfer-front-"
# How the front runs this module (its name is __main__ in the supervisor itself).
MODULE = "rayinfer.transport.front_supervisor"
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


def _pid_in(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def owner_alive(folder: Path) -> bool:
    try:
        return pid_alive(int((folder / "owner").read_text()))
    except (OSError, ValueError):
        return False


def serves(folder: Path, bind: tuple[str, int]) -> bool:
    """Whether the front in ``folder`` serves ``bind``: its HAProxy binds it, or its acceptor does."""
    paths = FrontPaths(folder)
    if any(line.split()[:2] == ["bind", f"{bind[0]}:{bind[1]}"] for line in paths.config.read_text().splitlines()):
        return True
    return any(line.split()[1:] == [bind[0], str(bind[1])] for line in read_text(paths.acceptor_ports).splitlines())


def stop_fronts(binds: list[tuple[str, int]]) -> None:
    """Stop the fronts serving ``binds`` in this network namespace: the server stops (its ``/v2``
    replica may be gone without stopping its front)."""
    for bind in binds:
        folder = running_front(bind)
        if folder is not None:
            stop_supervisor(folder)


def read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def own_front_folders() -> list[Path]:
    """The fronts' folders (with a configuration) in the temporary directory that are this
    user's and closed to everyone else; others' are skipped, never read, signalled or removed."""
    folders = []
    for config in Path(tempfile.gettempdir()).glob(f"{DIR_PREFIX}*/haproxy.cfg"):
        problem = ownership_problem(config.parent)
        if problem is None:
            folders.append(config.parent)
        else:
            logger.debug("skipping the front folder %s: %s", config.parent, problem)
    return folders


def is_front_supervisor(pid: int, folder: Path) -> bool:
    """Whether process ``pid`` is this user's and runs this module for ``folder``."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return False
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:  # gone
        return False
    for i, arg in enumerate(args[:-2]):
        if arg == b"-m" and args[i + 1] == MODULE.encode():
            return os.path.realpath(os.fsdecode(args[i + 2])) == os.path.realpath(folder)
    return False


def front_supervisor_pid(folder: Path) -> int | None:
    """The PID in ``<folder>/supervisor.pid`` when that process is the folder's supervisor
    (:func:`is_front_supervisor`); None otherwise: gone, or another process (a PID reused since,
    or one someone else wrote there: logged)."""
    pid = _pid_in(FrontPaths(folder).supervisor_pid)
    if pid is None or not pid_alive(pid):
        return None
    if not is_front_supervisor(pid, folder):
        logger.warning("not signalling process %d named in %s: it is not that front's supervisor", pid,
                       FrontPaths(folder).supervisor_pid)
        return None
    return pid


def running_front(bind: tuple[str, int]) -> Path | None:
    """The folder of a front of this user whose supervisor and HAProxy run in this network
    namespace (a server in another one may use the same port) and which binds ``bind``."""
    for folder in own_front_folders():
        try:
            if not serves(folder, bind):
                continue
            supervisor = front_supervisor_pid(folder)
            if supervisor is None:
                continue
            if os.readlink(f"/proc/{supervisor}/ns/net") != os.readlink("/proc/self/ns/net"):
                continue
            with socket.socket(socket.AF_UNIX) as admin:
                admin.connect(str(FrontPaths(folder).admin_socket))
        except (OSError, ValueError):
            continue
        return folder
    return None


def stop_supervisor(folder: Path, supervisor: subprocess.Popen | None = None) -> None:
    """SIGTERM to a front's supervisor (which stops its HAProxy), then remove its folder. Without
    ``supervisor`` (the front's own child), the PID comes from the folder, which must be this
    user's private one, and is signalled only when it is that front's supervisor."""
    if supervisor is None:
        problem = ownership_problem(folder)
        if problem is not None:
            logger.warning("not stopping the front in %s: %s", folder, problem)
            return
    pid = supervisor.pid if supervisor is not None else front_supervisor_pid(folder)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pid = None
    if supervisor is not None:
        try:
            supervisor.wait(10)
        except subprocess.TimeoutExpired:
            supervisor.kill()
            supervisor.wait()
    elif pid is not None:
        deadline = time.monotonic() + 10
        while pid_alive(pid) and time.monotonic() < deadline:  # not our child: no wait() to call
            time.sleep(0.05)
    shutil.rmtree(folder, ignore_errors=True)


def remove_stale_fronts(address: str, port: int) -> None:
    """Remove the folders of earlier fronts on this address and port whose HAProxy is gone
    (a replica that is killed cannot clean up after itself); this user's folders only."""
    for folder in own_front_folders():
        try:
            if not serves(folder, (address, port)):
                continue
            with socket.socket(socket.AF_UNIX) as admin:
                admin.connect(str(FrontPaths(folder).admin_socket))
        except OSError:  # no live HAProxy behind it
            shutil.rmtree(folder, ignore_errors=True)


def _die_with_parent() -> None:
    """In the child before exec: HAProxy gets SIGTERM when the supervisor dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def main(folder: Path, binary: str) -> int:
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    acceptor, env, fds = None, dict(os.environ), []
    with FrontPaths(folder).haproxy_log.open("wb") as log:
        listening, ours, theirs, limits = {}, {}, [], AcceptorLimits()
        # <folder>/acceptor: a line "<protocol> <address> <port>" per port the acceptor owns, and
        # one "limits ..." (AcceptorLimits.line).
        for line in read_text(FrontPaths(folder).acceptor_ports).splitlines():
            if line.startswith("limits "):
                limits = AcceptorLimits.parse(line)
                continue
            kind, address, port = line.split()
            try:
                listening[kind] = listening_socket(address, int(port))
            except OSError as exc:
                log.write(f"the front's acceptor cannot listen on {address}:{port}: {exc}\n".encode())
                return 1
            ours[kind], their_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            env[HANDOFF_FD_VARIABLES[kind]] = str(their_end.fileno())
            theirs.append(their_end)
            fds.append(their_end.fileno())
        if listening:
            acceptor = Acceptor(listening, ours, folder, limits)
        haproxy = subprocess.Popen([binary, "-f", str(FrontPaths(folder).config), "-db"], stdout=log, env=env,
                                   pass_fds=fds, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   preexec_fn=_die_with_parent)
        for their_end in theirs:
            their_end.close()
        orphaned_since: float | None = None
        raylet = _pid_in(FrontPaths(folder).raylet_pid)
        while haproxy.poll() is None and not stopping:
            if raylet is not None and not pid_alive(raylet):
                break
            if owner_alive(folder):
                orphaned_since = None
            elif orphaned_since is None:
                orphaned_since = time.monotonic()
            elif time.monotonic() - orphaned_since > ORPHAN_GRACE_S:
                break
            # Polled: the owner is a process of another parent (nothing to wait on), and a quarter
            # of a second is nothing against the grace period.
            if acceptor is not None:
                acceptor.serve(0.25)
            else:
                time.sleep(0.25)
        if acceptor is not None:
            acceptor.close()
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
