"""rayinfer on a Ray cluster of two nodes with addresses of their own (the second node in a
network namespace of its own: tests/second_host.py), the front on every node
(``--front-on-every-node``): every RPC of both protocols answers through each node's front,
each front routes to the replicas of both nodes, a gRPC stream's trace gets its send stamps from
the other node, both nodes' fronts apply a rollout's weights, and a node's front that dies is
started again."""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto
from tritonclient.utils import InferenceServerException

from conftest import HTTP_PORT, SUITE_RAY_ENVIRONMENT, add_sub_inputs, start_server, stop_server, stop_shared_server
from rollout_models import ROLLOUT_MODEL, rollout_config, write_rollout_models
from trace_files import ORDER, trace_files, traces_by_id
from rayinfer.cluster.example_repository import SIMPLE_CONFIG, add_sub_model, write_model
from rayinfer.cluster.settings import RAY_ENVIRONMENT
from rayinfer.transport.front_maps import splits_on_disk
from rayinfer.transport.router import GRPC_RUN_REQUESTS
from second_host import HERE_IP, THERE_IP, SecondHost
from waiting import wait_until

pytestmark = pytest.mark.own_cluster

PORT = HTTP_PORT + 600
BIN = Path(sys.executable).parent
A = np.arange(16, dtype=np.int32).reshape(1, 16)


@pytest.fixture(scope="module")
def two_nodes():
    """A head (1 CPU) here and a worker node (2 CPUs) on the second host."""
    stop_shared_server()  # one Ray cluster at a time on a small machine
    try:
        host = SecondHost()
    except OSError as exc:
        pytest.skip(f"needs root (CAP_NET_ADMIN) to give a second Ray node a network of its own: {exc}")
    # Ray turns token authentication on for a head not on loopback: the nodes share one token.
    env = {**os.environ, **RAY_ENVIRONMENT, **SUITE_RAY_ENVIRONMENT, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    try:
        subprocess.run([str(BIN / "ray"), "start", "--head", "--node-ip-address", HERE_IP, "--num-cpus", "1",
                        "--disable-usage-stats", "--dashboard-host", "127.0.0.1"],
                       env=env, check=True, capture_output=True, timeout=120)
        host.run([str(BIN / "ray"), "start", "--address", f"{HERE_IP}:6379", "--node-ip-address", THERE_IP,
                  "--num-cpus", "2", "--disable-usage-stats"], env=env, check=True, capture_output=True, timeout=120)
        yield host, env
    finally:
        # Serve first, as a user stops it on a cluster of their own: its proxies stop their
        # HAProxy processes, which `ray stop --force` would leave running.
        subprocess.run([str(BIN / "serve"), "shutdown", "-y"], env=env, capture_output=True, timeout=120)
        subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)  # nothing to drain
        host.close()


def ready(ip: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{ip}:{PORT}/v2/health/ready", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module")
def server(two_nodes, tmp_path_factory):
    """``simple`` with a replica on each node (the head holds the /v2 replica and one of 0.9
    CPU); ``spare`` to load and unload (on the second node: the head has no room left); the
    rollout tests' two-version model, not loaded; trace files (no request is traced until a
    test asks)."""
    host, env = two_nodes
    repo = tmp_path_factory.mktemp("two_nodes_repo")
    trace_file = tmp_path_factory.mktemp("two_nodes_traces") / "trace.json"
    write_model(repo, "simple", SIMPLE_CONFIG + "instance_group [ { count: 2 kind: KIND_CPU } ]\n",
                add_sub_model(TensorProto.INT32))
    write_model(repo, "spare", SIMPLE_CONFIG.replace('name: "simple"', 'name: "spare"'),
                add_sub_model(TensorProto.INT32))
    write_rollout_models(repo)
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        proc = start_server(repo, tmp_path_factory.mktemp("two_nodes_log") / "rayinfer.log", [
            "--ray-address", "auto", "--http-address", "0.0.0.0", "--http-port", str(PORT),
            "--grpc-port", str(PORT + 1), "--metrics-port", str(PORT + 2), "--serve-http-port", str(PORT + 10),
            "--serve-grpc-port", str(PORT + 11), "--front-on-head", "--front-on-every-node",
            "--model-control-mode", "explicit", "--load-model", "simple", "--replica-num-cpus", "0.9",
            "--trace-config", f"triton,file={trace_file}"])
    try:
        wait_until(lambda: ready(HERE_IP), "the head's front to be ready", timeout_s=120)
        wait_until(lambda: ready(THERE_IP), "the second node's front to be ready", timeout_s=60)
        host.trace_file = trace_file
        yield host
    finally:
        stop_server(proc)


def grpc_inputs() -> list:
    inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(A)
    return inputs


@pytest.mark.parametrize("ip", [HERE_IP, THERE_IP])
def test_every_http_endpoint_answers_through_each_nodes_front(server, ip: str):
    client = httpclient.InferenceServerClient(f"{ip}:{PORT}", network_timeout=120.0)
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata()["name"] == "triton"
    assert client.is_model_ready("simple") and not client.is_model_ready("spare")
    assert client.get_model_metadata("simple")["name"] == "simple"
    assert client.get_model_config("simple")["max_batch_size"] == 8
    for _ in range(4):
        np.testing.assert_array_equal(client.infer("simple", add_sub_inputs(A, A)).as_numpy("OUTPUT0"), 2 * A)
    # The replicas report their statistics every second or two.
    wait_until(lambda: client.get_inference_statistics("simple")["model_stats"][0]["inference_stats"]["success"]
               ["count"] >= 4, "the statistics to count the inferences", timeout_s=30)
    assert {m["name"] for m in client.get_model_repository_index()} == {"simple", "spare", ROLLOUT_MODEL}
    assert "trace_level" in client.get_trace_settings()
    assert "log_verbose_level" in client.get_log_settings()
    assert client.get_system_shared_memory_status() == []
    client.load_model("spare")
    np.testing.assert_array_equal(client.infer("spare", add_sub_inputs(A, A)).as_numpy("OUTPUT1"), 0 * A)
    client.unload_model("spare")
    with pytest.raises(InferenceServerException, match="spare"):
        client.infer("spare", add_sub_inputs(A, A))
    client.close()


@pytest.mark.parametrize("ip", [HERE_IP, THERE_IP])
def test_every_grpc_rpc_answers_through_each_nodes_front(server, ip: str):
    client = grpcclient.InferenceServerClient(f"{ip}:{PORT + 1}")
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata().name == "triton"
    assert client.is_model_ready("simple") and not client.is_model_ready("spare")
    assert client.get_model_metadata("simple").name == "simple"
    assert client.get_model_config("simple").config.max_batch_size == 8
    for _ in range(4):
        np.testing.assert_array_equal(client.infer("simple", grpc_inputs()).as_numpy("OUTPUT0"), 2 * A)
    wait_until(lambda: client.get_inference_statistics("simple").model_stats[0].inference_stats.success.count >= 4,
               "the statistics to count the inferences", timeout_s=30)
    assert {m.name for m in client.get_model_repository_index().models} == {"simple", "spare", ROLLOUT_MODEL}
    assert client.get_trace_settings().settings
    assert client.get_log_settings().settings
    assert list(client.get_system_shared_memory_status().regions) == []
    results: queue.Queue = queue.Queue()
    client.start_stream(lambda result, error: results.put((result, error)))
    for _ in range(3):
        client.async_stream_infer("simple", grpc_inputs())
    for _ in range(3):
        result, error = results.get(timeout=60)
        assert error is None
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * A)
    client.stop_stream()
    client.load_model("spare")
    np.testing.assert_array_equal(client.infer("spare", grpc_inputs()).as_numpy("OUTPUT1"), 0 * A)
    client.unload_model("spare")
    with pytest.raises(InferenceServerException, match="spare"):
        client.infer("spare", grpc_inputs())
    client.close()


def front_folders(host: SecondHost) -> dict[str, Path]:
    """The folder of each running front, by the node its supervisor runs on."""
    there = set(host.pids())
    folders: dict[str, Path] = {}
    for folder in Path("/tmp").glob("rayinfer-front-*"):
        try:
            supervisor = int((folder / "supervisor.pid").read_text())
            alive = b"front_supervisor" in Path(f"/proc/{supervisor}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if alive:
            node = THERE_IP if supervisor in there else HERE_IP
            assert node not in folders, f"two fronts on {node}"
            folders[node] = folder
    return folders


def test_each_nodes_front_routes_to_the_replicas_of_both_nodes(server):
    maps = {node: (folder / "listeners.map").read_text().split() for node, folder in front_folders(server).items()}
    assert set(maps) == {HERE_IP, THERE_IP}
    assert maps[HERE_IP] == maps[THERE_IP]  # the same routes on both
    # Serve spreads a deployment's replicas over the nodes (and the head has room for one only).
    assert {value.split("|")[0] for key, value in zip(maps[THERE_IP][::2], maps[THERE_IP][1::2])
            if key.startswith("simple/")} == {HERE_IP, THERE_IP}


@pytest.mark.parametrize("ip", [HERE_IP, THERE_IP])
def test_a_stream_traced_across_nodes_gets_its_send_stamps(server, ip: str):
    """``spare``'s replica runs on the second node, the /v2 replica (which reads a stream and
    writes its responses) on the head: each traced stream request's file has the model's stamps
    and then GRPC_SEND_START / _END, joined from the other node, in time order."""
    client = grpcclient.InferenceServerClient(f"{ip}:{PORT + 1}")
    client.load_model("spare")
    answers: queue.Queue = queue.Queue()
    before = trace_files(server.trace_file)
    try:
        wait_until(lambda: any(key.startswith("spare/") and value.startswith(THERE_IP + "|") for key, value in
                               pairs((front_folders(server)[HERE_IP] / "listeners.map").read_text().split())),
                   "spare's replica on the second node to be routed to", timeout_s=30)
        client.update_trace_settings("spare", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "log_frequency": "1"})
        client.start_stream(lambda result, error: answers.put(error or result))
        for _ in range(3):
            client.async_stream_infer("spare", grpc_inputs())
        outs = [answers.get(timeout=60) for _ in range(3)]
        client.stop_stream()
        new = wait_until(lambda: len(traces_by_id(trace_files(server.trace_file) - before)) >= 3 and
                         trace_files(server.trace_file) - before, "three traces", timeout_s=60, interval_s=0.3)
    finally:
        client.update_trace_settings("spare", {"trace_level": None, "trace_rate": None, "log_frequency": None})
        client.unload_model("spare")
        client.close()
    for out in outs:
        assert not isinstance(out, Exception), out
        np.testing.assert_array_equal(out.as_numpy("OUTPUT1"), 0 * A)
    traces = traces_by_id(new)
    assert len(traces) == 3
    for entries in traces.values():
        stamps = [s for e in entries for s in e.get("timestamps", [])]
        assert [s["name"] for s in stamps] == ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", *ORDER,
                                               "GRPC_SEND_START", "GRPC_SEND_END"]
        assert all(a["ns"] <= b["ns"] for a, b in zip(stamps, stamps[1:]))


def pairs(words: list[str]) -> list[tuple[str, str]]:
    """A listeners.map's (route, address) pairs."""
    return list(zip(words[::2], words[1::2]))


def _rollout(ip: str, action: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://{ip}:{PORT}/v2/repository/models/{ROLLOUT_MODEL}/rollout/{action}",
                                     json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def _versions(ip: str, count: int, grpc_count: int) -> tuple[Counter, Counter]:
    """The versions that answered version-less requests through ``ip``'s front: ``count`` over
    HTTP (one connection, one at a time) and ``grpc_count`` over gRPC (one channel, eight at a
    time: its connections' runs are longer)."""
    h = httpclient.InferenceServerClient(f"{ip}:{PORT}", network_timeout=60.0)
    g = grpcclient.InferenceServerClient(f"{ip}:{PORT + 1}")

    def version(client, module) -> str:
        tensor = module.InferInput("INPUT0", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.ones((1, 1), np.float32))
        result = client.infer(ROLLOUT_MODEL, [tensor])
        response = result.get_response()
        answered = response["model_version"] if isinstance(response, dict) else response.model_version
        assert float(result.as_numpy("OUTPUT0")[0, 0]) == float(answered)
        return answered

    try:
        http_seen = Counter(version(h, httpclient) for _ in range(count))
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            grpc_seen = Counter(pool.map(lambda _: version(g, grpcclient), range(grpc_count)))
    finally:
        h.close()
        g.close()
    return http_seen, grpc_seen


def _fronts_split(server) -> dict[str, tuple | None]:
    """Each node's front's split of the rollout model, as its maps hold it."""
    return {node: splits_on_disk(folder).get(ROLLOUT_MODEL) for node, folder in front_folders(server).items()}


def test_both_nodes_fronts_apply_a_rollouts_weights(server):
    """``simple`` makes room (unloaded, loaded again after): the rollout model's two versions,
    a replica of 0.9 CPU each (the head has room for one). A rollout at 30%, then at 80%: each
    node's front splits version-less requests by the same weight, over HTTP and gRPC, whichever
    node the version's replica is on (a connection's runs at a replica of its node, HAProxy's
    pick request by request for one on the other node)."""
    head = httpclient.InferenceServerClient(f"{HERE_IP}:{PORT}", network_timeout=300.0)
    head.unload_model("simple")
    try:
        head.load_model(ROLLOUT_MODEL, config=rollout_config())
        settings = {"rollout_steps": "30,80,100", "rollout_automatic": "false", "rollout_latency_slack_ms": "1000"}
        doc = _rollout(HERE_IP, "start", {"stable_version": "1", "candidate_version": "2", "parameters": settings})
        assert (doc["state"], doc["weight"]) == ("PROGRESSING", 30)
        for weight in (30, 80):
            if weight != 30:
                assert _rollout(THERE_IP, "weight", {"weight": weight})["weight"] == weight
            wait_until(lambda: _fronts_split(server) == {HERE_IP: (weight, "2", ""), THERE_IP: (weight, "2", "")}
                       and ready(THERE_IP), f"both fronts to split at {weight}%", timeout_s=30)
            for ip in (HERE_IP, THERE_IP):
                # A connection's calls go to one version in runs, so the share needs many calls.
                # (A gRPC connection's two runs are about 2 * GRPC_RUN_REQUESTS calls together.)
                http_seen, grpc_seen = _versions(ip, 1000, 6 * GRPC_RUN_REQUESTS)
                assert abs(http_seen["2"] / 1000 - weight / 100) <= 0.1, (ip, weight, http_seen)
                assert abs(grpc_seen["2"] / grpc_seen.total() - weight / 100) <= 0.1, (ip, weight, grpc_seen)
        assert _rollout(HERE_IP, "abort", {})["state"] == "ABORTED"
    finally:
        head.unload_model(ROLLOUT_MODEL)
        head.load_model("simple")
        head.close()
        # A node's front stops while the node runs no model replica, and starts with its next one.
        wait_until(lambda: ready(THERE_IP) and THERE_IP in front_folders(server), "the second node's front to be back",
                   timeout_s=60)


def test_a_node_front_that_dies_is_started_again(server):
    folder = front_folders(server)[THERE_IP]
    os.kill(int((folder / "supervisor.pid").read_text()), signal.SIGKILL)
    wait_until(lambda: not ready(THERE_IP), "the second node's front to stop answering", timeout_s=30)
    # Started again on the next publication after the first back-off (RETRY_FIRST_S, 2 s).
    wait_until(lambda: ready(THERE_IP), "the second node's front to be started again", timeout_s=90)
    client = httpclient.InferenceServerClient(f"{THERE_IP}:{PORT}")
    np.testing.assert_array_equal(client.infer("simple", add_sub_inputs(A, A)).as_numpy("OUTPUT0"), 2 * A)
    assert ready(HERE_IP)
