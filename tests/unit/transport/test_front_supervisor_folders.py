"""The fronts' folders under the temporary directory (``rayinfer-front-*``) that the server looks
for, stops and removes are only its user's own, and a PID read from one is signalled only when
it is that front's supervisor: a folder another local user planted cannot make the server signal
a process of their choosing or remove their files."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from front_stand_ins import free_port
from rayinfer.transport import front_supervisor

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")


@pytest.fixture
def temporary_directory(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A short temporary directory of the code under test (a Unix socket's path is short)."""
    folder = Path(tempfile.mkdtemp(prefix="rif-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def running(command: list[str]) -> Iterator[subprocess.Popen]:
    """A process for the test to plant, killed by its own PID at the end."""
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def fake_supervisor(folder: Path) -> list[str]:
    """A process whose command line is the front supervisor's for ``folder`` (it only sleeps)."""
    return [sys.executable, "-c", "import time; time.sleep(30)", "-m", "rayinfer.transport.front_supervisor",
            str(folder), "haproxy"]


def plant_front(folder: Path, port: int, pid: int, mode: int = 0o700) -> socket.socket:
    """A front's folder as the front writes it: its config binds ``port``, ``pid`` is its
    supervisor, and its admin socket listens (as a live HAProxy's does); returns that socket."""
    folder.mkdir(mode=0o700)
    (folder / "haproxy.cfg").write_text(f"frontend http\n    bind 127.0.0.1:{port}\n")
    (folder / "supervisor.pid").write_text(str(pid))
    admin = socket.socket(socket.AF_UNIX)
    admin.bind(str(folder / "admin.sock"))
    admin.listen()
    folder.chmod(mode)
    return admin


def test_this_users_front_is_found_and_stopped(temporary_directory: Path) -> None:
    port = free_port()
    folder = temporary_directory / f"{front_supervisor.DIR_PREFIX}mine"
    with running(fake_supervisor(folder)) as supervisor:
        with plant_front(folder, port, supervisor.pid):
            assert front_supervisor.running_front(("127.0.0.1", port)) == folder
            front_supervisor.stop_fronts([("127.0.0.1", port)])
        assert supervisor.wait(10) is not None
    assert not folder.exists()


def test_a_pid_that_is_no_front_supervisor_is_not_signalled(temporary_directory: Path) -> None:
    port = free_port()
    folder = temporary_directory / f"{front_supervisor.DIR_PREFIX}sleep"
    with running(["sleep", "30"]) as sleeper:
        with plant_front(folder, port, sleeper.pid):
            assert front_supervisor.running_front(("127.0.0.1", port)) is None
            front_supervisor.stop_fronts([("127.0.0.1", port)])
            front_supervisor.stop_supervisor(folder)
        assert sleeper.poll() is None  # still alive


def test_a_supervisor_of_another_folder_is_not_signalled(temporary_directory: Path) -> None:
    port = free_port()
    folder = temporary_directory / f"{front_supervisor.DIR_PREFIX}planted"
    with running(fake_supervisor(temporary_directory / f"{front_supervisor.DIR_PREFIX}other")) as supervisor:
        with plant_front(folder, port, supervisor.pid):
            front_supervisor.stop_fronts([("127.0.0.1", port)])
            front_supervisor.stop_supervisor(folder)
        assert supervisor.poll() is None


def test_a_front_folder_others_may_write_is_ignored(temporary_directory: Path) -> None:
    port = free_port()
    folder = temporary_directory / f"{front_supervisor.DIR_PREFIX}open"
    with running(fake_supervisor(folder)) as supervisor:
        with plant_front(folder, port, supervisor.pid, mode=0o777):
            assert front_supervisor.running_front(("127.0.0.1", port)) is None
            front_supervisor.stop_fronts([("127.0.0.1", port)])
            front_supervisor.stop_supervisor(folder)
        front_supervisor.remove_stale_fronts("127.0.0.1", port)  # its HAProxy is gone: it would be stale
        assert supervisor.poll() is None
    assert (folder / "haproxy.cfg").is_file()


@needs_root
def test_another_users_front_folder_is_neither_signalled_nor_removed(temporary_directory: Path) -> None:
    port = free_port()
    folder = temporary_directory / f"{front_supervisor.DIR_PREFIX}theirs"
    with running(fake_supervisor(folder)) as supervisor:
        with plant_front(folder, port, supervisor.pid):
            os.chown(folder, 65534, 65534)
            assert front_supervisor.running_front(("127.0.0.1", port)) is None
            front_supervisor.stop_fronts([("127.0.0.1", port)])
            front_supervisor.stop_supervisor(folder)
        assert supervisor.poll() is None
    front_supervisor.remove_stale_fronts("127.0.0.1", port)
    assert (folder / "haproxy.cfg").is_file()


def test_the_command_line_checked_is_the_one_the_front_runs() -> None:
    """The front starts ``python -m <front_supervisor.__name__>``: the name the check looks for."""
    assert front_supervisor.MODULE == front_supervisor.__name__
