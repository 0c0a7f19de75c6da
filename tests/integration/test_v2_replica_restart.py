"""The /v2 replica killed under load: the front (HAProxy, kept by its supervisor process) goes on
relaying inference calls to the model replicas while Serve starts a new /v2 replica, which takes
the running front over; no inference call fails meanwhile. On the session server, after every
other test of it (the ``session_server_last`` marker): the new /v2 replica takes over its
whole repository's replicas."""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import HTTP_PORT, LOAD_TIMEOUT_S, front_folder, front_stat, pids_titled
from rayinfer.transport.router import RUN_REQUESTS
from rollout_models import ROLLOUT_MODEL, rollout_config
from waiting import wait_until

pytestmark = pytest.mark.session_server_last

PORT = HTTP_PORT


V2_REPLICA = "ServeReplica:rayinfer:ServerDeployment"


def answers_200(path: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


class Load(threading.Thread):
    """Calls simple over HTTP and gRPC in turn until stopped; counts answers and failures."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stopping = threading.Event()
        self.ok = 0
        self.failures: list[str] = []

    def run(self) -> None:
        clients = [httpclient.InferenceServerClient(f"127.0.0.1:{PORT}"),
                   grpcclient.InferenceServerClient(f"127.0.0.1:{PORT + 1}")]
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        while not self.stopping.is_set():
            for module, client in zip((httpclient, grpcclient), clients):
                inputs = []
                for name in ("INPUT0", "INPUT1"):
                    tensor = module.InferInput(name, [1, 16], "INT32")
                    tensor.set_data_from_numpy(a)
                    inputs.append(tensor)
                try:
                    result = client.infer("simple", inputs)
                    assert result.as_numpy("OUTPUT0").tolist() == (2 * a).tolist()
                    self.ok += 1
                except Exception as exc:  # noqa: BLE001  # every failure is reported by the test
                    self.failures.append(f"{type(exc).__name__}: {exc}")
            self.stopping.wait(0.01)  # a steady load, not a flood
        for client in clients:
            client.close()


def test_inference_goes_on_while_the_v2_replica_restarts(server):
    (before,) = pids_titled(V2_REPLICA)
    ready = answers_200("/v2/health/ready")
    load = Load()
    load.start()
    wait_until(lambda: load.ok >= 20, "the load to start", timeout_s=30)
    os.kill(before, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: not answers_200("/v2"), "the /v2 application to be gone", timeout_s=10, interval_s=0.05)
    served_while_down = load.ok
    wait_until(lambda: answers_200("/v2"), "a new /v2 replica to answer", timeout_s=120, interval_s=0.2)
    restart_s = time.monotonic() - killed_at
    # Calls go on while the model replica registers with the new /v2 replica, which then routes it.
    wait_until(lambda: load.ok > served_while_down + 100 and answers_200("/v2/models/simple/ready"),
               "the new /v2 replica to route the model",
               timeout_s=60, interval_s=0.2)
    load.stopping.set()
    load.join(30)
    assert load.failures == [], load.failures[:5]
    assert pids_titled(V2_REPLICA) and before not in pids_titled(V2_REPLICA)
    # The new replica knows that the start ended (cluster_records): it waits for no startup model,
    # even one unloaded since, so it is as ready as the first one was.
    wait_until(lambda: answers_200("/v2/health/ready") == ready, f"the server's readiness to be {ready} again",
               timeout_s=30)
    # The new replica gives the front its own gRPC server's port: a stream and a server call
    # reach it there again, not through Serve's ingress.
    front = front_folder(server)
    wait_until(lambda: front_stat(front, "serve_grpc")["v2"]["status"] == "UP",
               "the front's way to the new /v2 replica's gRPC server", timeout_s=30, interval_s=0.2)
    through_serve = front_stat(front, "serve_grpc")["serve"]["stot"]
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{PORT + 1}")
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs = [grpcclient.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(a)
        client.async_stream_infer("simple", inputs)
        result, error = answers.get(timeout=60)
        assert error is None and result.as_numpy("OUTPUT0").tolist() == (2 * a).tolist()
    finally:
        client.stop_stream()
    assert client.get_server_metadata().name == "triton"
    client.close()
    assert front_stat(front, "serve_grpc")["serve"]["stot"] == through_serve
    print(f"/v2 replica back after {restart_s:.1f} s; {load.ok} calls answered, none failed")


def _rollout(method: str, action: str = "", doc: dict | None = None) -> dict:
    path = f"http://127.0.0.1:{PORT}/v2/repository/models/{ROLLOUT_MODEL}/rollout" + (f"/{action}" if action else "")
    data = None if doc is None else json.dumps(doc).encode()
    with urllib.request.urlopen(urllib.request.Request(path, data=data, method=method), timeout=120) as answer:
        return json.loads(answer.read())


def test_a_rollout_outlives_the_v2_replica(server):
    """A rollout is kept in Ray's key-value store: the new /v2 replica takes it up as it was and
    the front goes on splitting by it."""
    client = httpclient.InferenceServerClient(f"127.0.0.1:{PORT}", network_timeout=LOAD_TIMEOUT_S)
    client.load_model(ROLLOUT_MODEL, config=rollout_config())
    _rollout("POST", "start", {"stable_version": "1", "candidate_version": "2",
                               "parameters": {"rollout_steps": "30,100", "rollout_automatic": "false"}})
    (before,) = pids_titled(V2_REPLICA)
    os.kill(before, signal.SIGKILL)
    wait_until(lambda: pids_titled(V2_REPLICA) - {before} and answers_200(f"/v2/repository/models/{ROLLOUT_MODEL}/rollout"),
               "a new /v2 replica to answer for the rollout", timeout_s=120, interval_s=0.2)
    doc = _rollout("GET")
    assert (doc["state"], doc["weight"], doc["stable_version"], doc["candidate_version"]) == ("PROGRESSING", 30, "1", "2")
    tensor = httpclient.InferInput("INPUT0", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 1), np.float32))
    calls = 10 * RUN_REQUESTS  # three of an HTTP/1.1 connection's pairs of runs at 30%
    served = [client.infer(ROLLOUT_MODEL, [tensor]).get_response()["model_version"] for _ in range(calls)]
    assert 0.18 <= served.count("2") / calls <= 0.42, served.count("2")
    client.unload_model(ROLLOUT_MODEL)
    client.close()
