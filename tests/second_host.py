"""A second "machine" on this one: a network namespace of its own, joined to the tests' by a veth
pair, so that a second Ray node has an address, a loopback and ports of its own, as on a cluster
of two machines (Ray nodes started side by side on one network share every port)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

HERE_IP = "10.87.0.1"
THERE_IP = "10.87.0.2"


def _ip(*args: str, pid: int | None = None) -> None:
    command = ["ip", *args] if pid is None else ["nsenter", "-t", str(pid), "-n", "ip", *args]
    subprocess.run(command, check=True, capture_output=True, timeout=30)


class SecondHost:
    """``HERE_IP`` on this side of the pair, ``THERE_IP`` on the other; :meth:`popen` and
    :meth:`run` start processes there. Raises ``OSError`` where namespaces or veth pairs cannot
    be made (no CAP_NET_ADMIN)."""

    def __init__(self) -> None:
        suffix = secrets.token_hex(3)
        self._here, there = f"ri{suffix}a", f"ri{suffix}b"
        self._holder: subprocess.Popen | None = None
        try:
            _ip("link", "add", self._here, "type", "veth", "peer", "name", there)
        except (subprocess.CalledProcessError, FileNotFoundError) as exc:
            raise OSError(f"cannot make a veth pair: {getattr(exc, 'stderr', b'')!r}") from exc
        try:
            self._holder = subprocess.Popen(["unshare", "-n", "sleep", "infinity"], start_new_session=True)
            ours = os.readlink("/proc/self/ns/net")
            deadline = time.monotonic() + 10
            while os.readlink(f"/proc/{self._holder.pid}/ns/net") == ours:
                if time.monotonic() > deadline or self._holder.poll() is not None:
                    raise OSError("cannot make a network namespace")
                time.sleep(0.02)
            self.namespace = os.readlink(f"/proc/{self._holder.pid}/ns/net")
            _ip("link", "set", there, "netns", str(self._holder.pid))
            _ip("addr", "add", f"{HERE_IP}/24", "dev", self._here)
            _ip("link", "set", self._here, "up")
            for args in (("link", "set", "lo", "up"), ("addr", "add", f"{THERE_IP}/24", "dev", there),
                         ("link", "set", there, "up")):
                _ip(*args, pid=self._holder.pid)
        except (OSError, subprocess.CalledProcessError) as exc:
            self.close()
            raise OSError(f"cannot set up the second host: {exc}") from exc

    def command(self, args: list[str]) -> list[str]:
        """``args`` as a command that runs in the second host's network namespace."""
        assert self._holder is not None
        return ["nsenter", "-t", str(self._holder.pid), "-n", *args]

    def run(self, args: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(args), **kwargs)

    def pids(self) -> list[int]:
        """The processes in the second host's namespace (its holder aside)."""
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and self._holder is not None and int(entry.name) != self._holder.pid:
                try:
                    if os.readlink(entry / "ns" / "net") == self.namespace:
                        found.append(int(entry.name))
                except OSError:
                    continue
        return found

    def close(self) -> None:
        """Kill whatever still runs there, then remove the namespace and the pair."""
        if self._holder is not None:
            if hasattr(self, "namespace"):
                for pid in self.pids():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            self._holder.kill()
            self._holder.wait()
            self._holder = None
        subprocess.run(["ip", "link", "del", self._here], capture_output=True, timeout=30)
