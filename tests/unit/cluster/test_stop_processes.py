"""rayinfer serve stops what its embedded Ray node leaves behind: every process under it,
found in /proc by parent and start time, is sent SIGTERM, then SIGKILL after the grace."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from rayinfer.cluster.processes import alive, descendants, stop_processes


def test_descendants_are_found_and_stopped_even_one_that_ignores_sigterm():
    # A child with a grandchild that ignores SIGTERM (as a stuck agent would).
    script = ("import signal, subprocess, sys, time; "
              "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)'], stdout=sys.stdout); "
              "time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline().strip() == b"1"  # the grandchild runs, SIGTERM ignored
        mine = descendants(os.getpid())  # (this test session's other children are left alone)
        assert child.pid in {pid for pid, _ in mine}
        tree = [p for p in mine if p[0] == child.pid] + descendants(child.pid)
        assert len(tree) == 2 and all(alive(p) for p in tree)
        stop_processes(tree, grace_s=0.5)
        child.wait(timeout=5)
        assert not [p for p in tree if p[0] != child.pid and alive(p)]
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            child.wait()


def test_a_reused_pid_is_not_a_survivor():
    assert not alive((os.getpid(), "0"))  # another start time: not the process recorded
