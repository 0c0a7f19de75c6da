"""rayinfer on a Ray cluster started on its own (`ray start --head` with `rayinfer ray-env`'s
settings), the two ways README.md gives: `rayinfer serve --ray-address auto`, and `rayinfer
config` rendered into a Serve config for `serve deploy`. Each is checked as a user would: ready,
inference over HTTP and gRPC, `serve status` naming every model version's application, the
metrics port; and stopping leaves the cluster running."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from onnx import TensorProto

from conftest import HTTP_PORT, add_sub_inputs, start_server, stop_server, stop_shared_server
from rayinfer.cluster.example_repository import SIMPLE_CONFIG, add_sub_model, write_model
from rayinfer.cluster.settings import RAY_ENVIRONMENT
from waiting import wait_until

pytestmark = pytest.mark.own_cluster

PORT = HTTP_PORT + 200
PORT_ARGS = ["--http-port", str(PORT), "--grpc-port", str(PORT + 1), "--metrics-port", str(PORT + 2),
             "--serve-http-port", str(PORT + 10), "--serve-grpc-port", str(PORT + 11)]
BIN = Path(sys.executable).parent
# Every model version's Serve application: the default (highest) version as <model>.
APPS = ("rayinfer", "simple", "simple@v1")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """A one-node Ray cluster of its own, with token authentication (a token of its own, as a
    cluster whose nodes share one), and a repository holding two versions of ``simple``."""
    stop_shared_server()  # one Ray cluster at a time on a small machine
    repo = tmp_path_factory.mktemp("cluster_repo")
    write_model(repo, "simple", SIMPLE_CONFIG + "version_policy: { all { } }\n", add_sub_model(TensorProto.INT32))
    (repo / "simple" / "2").mkdir()
    (repo / "simple" / "2" / "model.onnx").write_bytes((repo / "simple" / "1" / "model.onnx").read_bytes())
    env = {**os.environ, **RAY_ENVIRONMENT, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)  # for `rayinfer serve`, started by conftest's helper
        subprocess.run([str(BIN / "ray"), "start", "--head", "--num-cpus", "2", "--disable-usage-stats",
                        "--dashboard-host", "127.0.0.1"], env=env, check=True, capture_output=True, timeout=120)
        try:
            yield repo, env
        finally:
            subprocess.run([str(BIN / "ray"), "stop"], env=env, capture_output=True, timeout=120)


def serve_cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([str(BIN / "serve"), *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def served_apps(env: dict[str, str]) -> set[str]:
    """The applications `serve status` lists."""
    return set(yaml.safe_load(serve_cli(env, "status")).get("applications") or {})


def http_ready() -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v2/health/ready", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def check_serving(env: dict[str, str]) -> None:
    """Both versions answer over HTTP and gRPC; `serve status` names every application; the
    metrics port counts the inferences."""
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    http = httpclient.InferenceServerClient(f"127.0.0.1:{PORT}")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{PORT + 1}")
    for version in ("1", "2"):
        np.testing.assert_array_equal(
            http.infer("simple", add_sub_inputs(a, a), model_version=version).as_numpy("OUTPUT0"), 2 * a)
        inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(a)
        np.testing.assert_array_equal(grpc.infer("simple", inputs, model_version=version).as_numpy("OUTPUT1"), 0 * a)
    assert set(APPS) <= served_apps(env)
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT + 2}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'nv_inference_count{model="simple",version="2"} 2' in metrics
    grpc.close()


def test_rayinfer_serve_joins_the_cluster_and_leaves_it_running(cluster, tmp_path: Path):
    repo, env = cluster
    proc = start_server(repo, tmp_path / "rayinfer.log", ["--ray-address", "auto", *PORT_ARGS])
    try:
        wait_until(http_ready, "the server to be ready", timeout_s=120)
        check_serving(env)
    finally:
        stop_server(proc)
    assert proc.returncode == 0
    # Its own applications are deleted (Serve finishes deleting them after rayinfer exits), and
    # the cluster keeps running.
    wait_until(lambda: not served_apps(env) & set(APPS), "rayinfer's applications to be deleted", timeout_s=60)


def test_a_rendered_serve_config_deploys_with_serve_deploy(cluster, tmp_path: Path):
    repo, env = cluster
    # The front on the head node, as the KubeRay manifest has it (the only node here).
    rendered = subprocess.run([str(BIN / "rayinfer"), "config", "--model-repository", str(repo), *PORT_ARGS,
                               "--front-on-head"], env=env, capture_output=True, text=True, timeout=60,
                              check=True).stdout
    assert "front_on_head: true" in rendered
    (tmp_path / "serve.yaml").write_text(rendered)
    serve_cli(env, "deploy", str(tmp_path / "serve.yaml"))
    try:
        wait_until(http_ready, "the deployed server to be ready", timeout_s=240)
        check_serving(env)
    finally:
        serve_cli(env, "shutdown", "-y")
