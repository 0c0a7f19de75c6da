"""Shared fixtures: the test model repository and one real rayinfer server per test session."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from waiting import WaitTimeout, wait_until

# Serve's controller loop in every server and Ray cluster the suite starts: Ray's default, 0.1 s,
# where rayinfer sets 0.5 s (rayinfer.cluster.settings.RAY_ENVIRONMENT: a shorter latency tail on
# small machines, each deployment step noticed up to 0.4 s later). The suite deploys and deletes
# applications many times; at 0.5 s its servers' loads, unloads and stops wait on the
# slower loop (test_model_pool.py: 52 s against 35 s). A value set by the caller is kept.
SUITE_RAY_ENVIRONMENT = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S":
                         os.environ.get("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.1")}
os.environ.update(SUITE_RAY_ENVIRONMENT)

HTTP_PORT = int(os.environ.get("RAYINFER_TEST_HTTP_PORT", "18600"))
GRPC_PORT = HTTP_PORT + 1
METRICS_PORT = HTTP_PORT + 2
RAY_METRICS_PORT = HTTP_PORT + 5  # the embedded Ray's own metrics
# Ray Serve's own gRPC and HTTP ingress, behind the front on GRPC_PORT and HTTP_PORT.
SERVE_GRPC_PORT = HTTP_PORT + 11
SERVE_HTTP_PORT = HTTP_PORT + 10
# How long an HTTP client waits for a model's load (tritonclient's default, 60 s, is shorter than
# starting replica processes has taken on a busy 2-core machine).
LOAD_TIMEOUT_S = 300.0


def http(method: str, path: str, body: bytes | None = None, headers: dict | None = None,
         timeout: float = 30.0, port: int | None = None) -> tuple[int, dict, bytes]:
    """One HTTP request to the test server (or the one on ``port``); returns (status, headers,
    body) for any status."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port or HTTP_PORT}{path}", data=body, method=method, headers=headers or {}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def metric_value(server: dict, sample: str) -> float:
    """The value of one sample (its name and labels as the metrics port writes them, e.g.
    ``py_cancel_cancelled{model="py_cancel"}``) on the server's metrics port; 0 while it is absent."""
    with urllib.request.urlopen(server["metrics_url"], timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(sample + " "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def http_json(method: str, path: str, doc: object | None = None, port: int | None = None) -> tuple[int, object]:
    body = None if doc is None else (doc if isinstance(doc, bytes) else json.dumps(doc).encode())
    status, _, raw = http(method, path, body, port=port)
    return status, (json.loads(raw) if raw else None)


def tensor(module, name: str, array, datatype: str):
    """A tritonclient input (``module``: tritonclient.http or .grpc) holding ``array``."""
    t = module.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def add_sub_inputs(a, b, binary: bool = True, dtype: str = "INT32") -> list:
    """``tritonclient.http`` inputs INPUT0 = a, INPUT1 = b for the add/sub test models."""
    import tritonclient.http as httpclient

    inputs = [httpclient.InferInput("INPUT0", list(a.shape), dtype), httpclient.InferInput("INPUT1", list(b.shape), dtype)]
    inputs[0].set_data_from_numpy(a, binary_data=binary)
    inputs[1].set_data_from_numpy(b, binary_data=binary)
    return inputs


def submit_each(client, model: str, input_name: str, datatype: str, arrays: list) -> list:
    """One ``async_infer`` per array (as the model's only input); returns the pending requests."""
    import tritonclient.http as httpclient

    pending = []
    for x in arrays:
        inp = httpclient.InferInput(input_name, list(x.shape), datatype)
        inp.set_data_from_numpy(x)
        pending.append(client.async_infer(model, [inp]))
    return pending


def pids_titled(title: str) -> set[int]:
    """Processes whose command line holds ``title`` (Ray titles a Serve replica
    ``ray::ServeReplica:<app>:<deployment>``)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and title.encode() in (entry / "cmdline").read_bytes():
                pids.add(int(entry.name))
        except OSError:
            continue  # a process that ended meanwhile
    return pids


def ray_actor_classes(server: dict) -> int:
    """How many actor classes the GCS of the server's embedded Ray holds (its function table):
    one for each class a process exported, which every process that takes a handle to an actor
    of that class loads and keeps. Asked from a process of its own (Ray's token, as the server's
    ``ray.init`` made it)."""
    gcs = []
    for pid in pids_titled("gcs_server"):
        try:
            if int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1]) == server["process"].pid:
                gcs.append(pid)
        except (OSError, IndexError, ValueError):
            continue
    (pid,) = gcs
    args = (Path("/proc") / str(pid) / "cmdline").read_bytes().decode().split("\0")
    (session,) = [a.split("=", 1)[1] for a in args if a.startswith("--session-dir=")]
    (port_file,) = Path(session).glob("gcs_server_port_*")
    script = ("import sys; from ray._raylet import GcsClient; "
              "print(len(GcsClient(address=sys.argv[1]).internal_kv_keys(b'ActorClass', b'fun')))")
    done = subprocess.run([sys.executable, "-c", script, f"127.0.0.1:{port_file.read_text().strip()}"],
                          env={**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


def front_folder(server: dict) -> Path:
    """The folder of the session server's live front (HAProxy): its route maps are
    ``replicas.map`` (``<model>/<version>`` -> replica count; the default version's key is
    ``<model>/``) and ``listeners.map`` (``<model>/<version>/<n>`` -> ``<host>|<port>``).
    Folders of earlier, stopped fronts are removed when a front starts."""
    from rayinfer.transport.front_supervisor import serves

    host, _, port = server["grpc_url"].rpartition(":")
    (front,) = [p.parent for p in Path(tempfile.gettempdir()).glob("rayinfer-front-*/haproxy.cfg")
                if serves(p.parent, (host, int(port))) and _in_this_network(p.parent)]
    return front


def _in_this_network(folder: Path) -> bool:
    """Whether a front's supervisor runs in this network namespace (a test run beside this one may
    use the same ports in another)."""
    try:
        supervisor = (folder / "supervisor.pid").read_text()
        return os.readlink(f"/proc/{supervisor}/ns/net") == os.readlink("/proc/self/ns/net")
    except OSError:
        return False


def front_command(front: Path, command: str) -> str:
    """What the HAProxy of the front at ``front`` answers ``command`` on its admin socket."""
    with socket.socket(socket.AF_UNIX) as admin:
        admin.settimeout(10)
        admin.connect(str(front / "admin.sock"))
        admin.sendall(command.encode() + b"\n")
        text = b""
        while chunk := admin.recv(65536):
            text += chunk
    return text.decode(errors="replace")


def front_stat(front: Path, backend: str) -> dict[str, dict[str, str]]:
    """HAProxy's ``show stat`` rows of ``backend`` in the front at ``front``, by server name."""
    header, *rows = front_command(front, "show stat").splitlines()
    names = header.lstrip("# ").split(",")
    return {row["svname"]: row for row in (dict(zip(names, line.split(","))) for line in rows)
            if row.get("pxname") == backend}


def read_map(path: Path) -> dict[str, str]:
    """A front's map file as {key: value}; a line caught half-written is left out."""
    return dict(fields for fields in (line.split() for line in path.read_text().splitlines()) if len(fields) == 2)


def _build_repository(root: Path) -> Path:
    from model_factory import build_test_repository

    return build_test_repository(root)


@pytest.fixture
def cli_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No RAYINFER_* settings from the caller; rayinfer's RAY_* variables set here (to the
    caller's values where given), so that the CLI's ``main()``, which sets the missing ones,
    leaves os.environ as it was."""
    from rayinfer.cluster.settings import RAY_ENVIRONMENT

    for key in list(os.environ):
        if key.startswith("RAYINFER_"):
            monkeypatch.delenv(key)
    for key, value in RAY_ENVIRONMENT.items():
        monkeypatch.setenv(key, os.environ.get(key, value))


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3-compatible server (moto's server mode) for the session: "127.0.0.1:<port>"."""
    from s3_server import s3_server

    with s3_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_repository(tmp_path_factory.mktemp("repo"))


# How long a server may take to start. The session server loads about 60 models: 100-270 s on
# this 2-core machine depending on the day, and over 300 s on a slower CI machine.
_START_TIMEOUT_S = 600


def port_flags(base: int) -> list[str]:
    """A server's ports from ``base``: HTTP on it, gRPC + 1, metrics + 2, Serve's own HTTP and
    gRPC ingress + 10 and + 11 (as the shared server's)."""
    return ["--http-port", str(base), "--grpc-port", str(base + 1), "--metrics-port", str(base + 2),
            "--serve-http-port", str(base + 10), "--serve-grpc-port", str(base + 11)]


def start_server(repository: Path | str, log_path: Path, args: list[str]) -> subprocess.Popen:
    """``rayinfer serve`` on ``repository`` (a folder or a URL) with ``args``; returns once it printed that
    HTTP is up."""
    proc = launch_server(repository, log_path, args)
    wait_started(proc, log_path)
    return proc


def launch_server(repository: Path | str, log_path: Path, args: list[str]) -> subprocess.Popen:
    """``rayinfer serve`` started, not waited for (:func:`wait_started`)."""
    log = log_path.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rayinfer.cluster.cli", "serve", "--model-repository", str(repository),
         "--replica-num-cpus", "0.01", "--num-cpus", "2", "--startup-timeout-s", str(_START_TIMEOUT_S - 60), *args],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    log.close()
    return proc


def wait_started(proc: subprocess.Popen, log_path: Path) -> None:
    """Wait until the server printed that HTTP is up; fail with its log if it exits or takes too long."""
    def started() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"rayinfer exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        return "Started HTTPService" in log_path.read_text()

    try:
        wait_until(started, "rayinfer to print 'Started HTTPService'", timeout_s=_START_TIMEOUT_S, interval_s=0.5)
    except WaitTimeout as exc:
        stop_server(proc)
        pytest.fail(f"{exc}:\n{log_path.read_text()[-4000:]}")


class ReadinessWatch(threading.Thread):
    """Polls /v2/health/ready on ``port`` while a server starts; the first time it answers 200,
    asks each of ``models`` whether it is ready (``models_ready``: {model: answered 200})."""

    def __init__(self, port: int, models: list[str]) -> None:
        super().__init__(daemon=True)
        self._url = f"http://127.0.0.1:{port}"
        self._models = models
        self._stopping = threading.Event()
        self.models_ready: dict[str, bool] | None = None

    def run(self) -> None:
        while not self._stopping.is_set() and self.models_ready is None:
            if self._status("/v2/health/ready") == 200:
                self.models_ready = {m: self._status(f"/v2/models/{m}/ready") == 200 for m in self._models}
            self._stopping.wait(0.25)

    def _status(self, path: str) -> int | None:
        try:
            with urllib.request.urlopen(self._url + path, timeout=5.0) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:  # not listening yet
            return None

    def stop(self, first_ready_within_s: float = 0.0) -> None:
        """Stop polling, once /v2/health/ready answered 200 or ``first_ready_within_s`` passed."""
        self.join(first_ready_within_s)
        self._stopping.set()
        self.join()


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT (rayinfer stops Serve and its embedded Ray), SIGKILL to the group if that hangs.
    Nothing the server started may outlive it: every process under it is gone within 10 s of its
    exit (else they are killed and this fails, naming them)."""
    from rayinfer.cluster.processes import alive, descendants

    if proc.poll() is not None:
        return
    tree = descendants(proc.pid)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return
    try:
        wait_until(lambda: not any(alive(p) for p in tree), "the server's processes to exit", timeout_s=10)
        return
    except WaitTimeout:
        left = [p for p in tree if alive(p)]
    if left:
        names = []
        for pid, _ in left:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                names.append(f"{pid} {command[:80]}")
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        pytest.fail(f"processes of the server outlived it: {names}")


# The session server's process, so that a test needing a Ray cluster of its own can stop it
# first (this machine runs one Ray cluster at a time); such tests are marked ``own_cluster``
# and run last.
_SHARED: dict[str, Any] = {}  # "server": its process until stopped; "launched": (process, log)


def stop_shared_server() -> None:
    proc = _SHARED.pop("server", None)
    if proc is not None:
        stop_server(proc)


def pytest_collection_modifyitems(config, items) -> None:
    """Unit tests first (they need no server: the session server starts meanwhile), then the
    tests of the session server, those that disturb it last (``session_server_last``), then those
    with a Ray cluster of their own."""
    def order(item) -> int:
        if item.get_closest_marker("own_cluster") is not None:
            return 3
        if item.get_closest_marker("session_server_last") is not None:
            return 2
        return 0 if Path(str(item.fspath)).is_relative_to(Path(__file__).parent / "unit") else 1

    items.sort(key=order)


@pytest.fixture(scope="module")
def loop():
    """An event loop in a thread of its own (the front's unit tests run stand-in replica
    listeners on it: tests/front_stand_ins.py)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


@pytest.fixture(scope="module", params=["http", "grpc"])
def proto(request, server):
    """(tritonclient module, client) for each protocol, against the session server."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    module = httpclient if request.param == "http" else grpcclient
    if module is httpclient:
        client = httpclient.InferenceServerClient(server["url"], network_timeout=LOAD_TIMEOUT_S)
    else:
        client = grpcclient.InferenceServerClient(server["grpc_url"])
    yield module, client
    client.close()


@pytest.fixture(scope="session", autouse=True)
def session_server_starts_early(request: pytest.FixtureRequest) -> Iterator[None]:
    """When the run has tests of the session server, start it before the first test: its start
    (about a minute of replica processes starting) overlaps the unit tests, which run first.
    Stopped at the end of the run even if none of those tests asked for it."""
    if any("server" in item.fixturenames and item.get_closest_marker("own_cluster") is None
           for item in request.session.items):
        _launch_session_server(request.getfixturevalue("model_repository"),
                               request.getfixturevalue("tmp_path_factory"))
    yield
    stop_shared_server()


def _launch_session_server(model_repository: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[
        subprocess.Popen, Path]:
    """The session server's process and log, launched on the first call (not waited for)."""
    if "launched" in _SHARED:
        return _SHARED["launched"]
    log_path = tmp_path_factory.mktemp("server") / "rayinfer.log"
    trace_file = log_path.parent / "trace.json"  # the trace extension's file (tracing is off at start)
    from model_factory import ON_DEMAND_MODELS
    from ensemble_models import ENSEMBLE_NOT_LOADED_AT_START
    from python_models import NOT_LOADED_AT_START
    from backend_models import BACKEND_NOT_LOADED_AT_START
    from rollout_models import ROLLOUT_NOT_LOADED_AT_START
    from sequence_models import SEQUENCE_NOT_LOADED_AT_START

    # Explicit model control: every model but the on-demand ones loads at start (--load-model each).
    later = (ON_DEMAND_MODELS + NOT_LOADED_AT_START + ENSEMBLE_NOT_LOADED_AT_START + BACKEND_NOT_LOADED_AT_START
             + ROLLOUT_NOT_LOADED_AT_START + SEQUENCE_NOT_LOADED_AT_START)
    load = [arg for p in sorted(model_repository.iterdir()) if p.is_dir() and p.name not in later
            for arg in ("--load-model", p.name)]
    proc = launch_server(model_repository, log_path, [
        "--model-control-mode", "explicit", *load, "--http-port", str(HTTP_PORT), "--metrics-port", str(METRICS_PORT),
        "--grpc-port", str(GRPC_PORT), "--serve-grpc-port", str(SERVE_GRPC_PORT), "--serve-http-port", str(SERVE_HTTP_PORT),
        "--cache-config", "local,size=1048576", "--trace-config", f"triton,file={trace_file}",
        "--ray-metrics-port", str(RAY_METRICS_PORT), "--metrics-config", "summary_latencies=true",
        "--metrics-config", "histogram_latencies=true", "--model-hosting", "pool",
    ])
    _SHARED["server"] = proc
    _SHARED["launched"] = (proc, log_path)
    return proc, log_path


@pytest.fixture(scope="session")
def server(model_repository: Path, tmp_path_factory: pytest.TempPathFactory):
    """``rayinfer serve`` on the test repository, started once (before the unit tests, when the
    run has both); stopped with SIGINT at the end.

    With ``--model-hosting pool``: every model that can be pooled shares the pool's replica (half
    the replica processes on two cores). A model whose tests need a process of its own says
    ``rayinfer_hosting: dedicated``; decoupled models, ensembles and the others that cannot be
    pooled have replicas of their own anyway."""
    proc, log_path = _launch_session_server(model_repository, tmp_path_factory)
    trace_file = log_path.parent / "trace.json"
    wait_started(proc, log_path)
    try:
        yield {
            "url": f"127.0.0.1:{HTTP_PORT}",
            "grpc_url": f"127.0.0.1:{GRPC_PORT}",
            "metrics_url": f"http://127.0.0.1:{METRICS_PORT}/metrics",
            "ray_metrics_url": f"http://127.0.0.1:{RAY_METRICS_PORT}/metrics",
            "log": log_path,
            "trace_file": trace_file,
            "process": proc,
        }
    finally:
        stop_shared_server()
        # The Python models' pip environments (Ray clones the whole virtualenv for each): Ray
        # keeps a session's files after it stops.
        shutil.rmtree(Path(tempfile.gettempdir()) / "ray" / "session_latest" / "runtime_resources" / "pip",
                      ignore_errors=True)
