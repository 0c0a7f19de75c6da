"""Poll model control on a server of its own: models added, changed and removed on disk are
loaded, reloaded and unloaded, and the load API is refused with Triton's message. Its model pool
has two replicas, each keeping one version loaded, so that a busy pooled version is seen
getting a second copy (--pool-scale-up-rpm)."""

from __future__ import annotations

import shutil
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import (HTTP_PORT, add_sub_inputs, http_json, pids_titled, port_flags, start_server, stop_server,
                      stop_shared_server)
from model_factory import on_demand
from rollout_models import ROLLOUT_MODEL
from rayinfer.protocol.errors import Code, grpc_status_name, http_status
from waiting import wait_until

pytestmark = pytest.mark.own_cluster

PORT = HTTP_PORT + 100
SCALE_UP_RPM = 60  # one request a second: a second copy for a version asked more often


@pytest.fixture(scope="module")
def poll_server(model_repository, tmp_path_factory):
    stop_shared_server()  # one Ray cluster at a time on a small machine
    repo = tmp_path_factory.mktemp("poll_repo")
    shutil.copytree(model_repository / "simple", repo / "simple")
    log = tmp_path_factory.mktemp("poll_server") / "rayinfer.log"
    proc = start_server(repo, log, [
        "--model-control-mode", "poll", "--repository-poll-secs", "1", *port_flags(PORT), "--openai-api=false",
        "--pool-replicas", "2", "--pool-max-models", "1", "--pool-scale-up-rpm", str(SCALE_UP_RPM),
    ])
    try:
        yield repo, httpclient.InferenceServerClient(f"127.0.0.1:{PORT}", network_timeout=120.0), \
            grpcclient.InferenceServerClient(f"127.0.0.1:{PORT + 1}")
    finally:
        stop_server(proc)
    # SIGINT stops the server and its embedded Ray cleanly (no traceback, status 0).
    assert proc.returncode == 0, log.read_text()[-3000:]


def test_poll_adds_changes_and_removes_models(poll_server, model_repository):
    repo, http, grpc = poll_server
    assert http.is_model_ready("simple") and not http.is_model_ready("added")

    shutil.copytree(model_repository / on_demand("poll_added"), repo / "added")
    wait_until(lambda: http.is_model_ready("added") and grpc.is_model_ready("added"),
               "the poll to load 'added' (ready over HTTP and gRPC)")
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    np.testing.assert_array_equal(http.infer("added", add_sub_inputs(a, a)).as_numpy("OUTPUT0"), a * 2)
    assert http.get_model_config("added")["max_batch_size"] == 8

    config = repo / "added" / "config.pbtxt"
    config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 4"))
    # Metadata goes through Serve, gRPC's ModelConfig through the front, which stops routing to
    # the old replica once Serve no longer reports it RUNNING (the front's routes are refreshed
    # every 2 s), long before the old replica's draining period (30 s) ends.
    wait_until(lambda: http.get_model_config("added")["max_batch_size"] == 4,
               "the poll to reload 'added' (max_batch_size 4 over HTTP)")
    wait_until(lambda: grpc.get_model_config("added").config.max_batch_size == 4,
               "gRPC's ModelConfig to answer from the reloaded 'added'", timeout_s=10.0)

    shutil.rmtree(repo / "added")
    wait_until(lambda: not http.is_model_ready("added") and not grpc.is_model_ready("added"),
               "the poll to unload the removed 'added' (over HTTP and gRPC)")
    wait_until(lambda: "added" not in {m["name"] for m in http.get_model_repository_index()},
               "'added' to leave the repository index")
    assert http.is_model_ready("simple")


def test_poll_adds_changes_and_removes_a_pooled_model(poll_server, model_repository):
    """A model whose config asks for the model pool: loaded into the pool's replica, reloaded
    there when its config changes, unloaded when its folder goes."""
    repo, http, grpc = poll_server
    shutil.copytree(model_repository / on_demand("poll_added"), repo / "pooled")
    config = repo / "pooled" / "config.pbtxt"
    config.write_text(config.read_text() + 'parameters { key: "rayinfer_hosting" value: { string_value: "pool" } }\n')
    wait_until(lambda: http.is_model_ready("pooled") and grpc.is_model_ready("pooled"), "the poll to load 'pooled'")
    assert len(pids_titled("ServeReplica:rayinfer-pool:")) == 2 and not pids_titled("ServeReplica:pooled:")
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    np.testing.assert_array_equal(http.infer("pooled", add_sub_inputs(a, a)).as_numpy("OUTPUT1"), a * 0)

    config.write_text(config.read_text().replace("max_batch_size: 8", "max_batch_size: 4"))
    wait_until(lambda: http.get_model_config("pooled")["max_batch_size"] == 4
               and grpc.get_model_config("pooled").config.max_batch_size == 4, "the poll to reload 'pooled'")
    np.testing.assert_array_equal(http.infer("pooled", add_sub_inputs(a, a)).as_numpy("OUTPUT0"), a * 2)

    shutil.rmtree(repo / "pooled")
    wait_until(lambda: not http.is_model_ready("pooled") and not grpc.is_model_ready("pooled"),
               "the poll to unload the removed 'pooled'")
    assert http.is_model_ready("simple")


def test_the_load_api_is_refused_in_poll_mode(poll_server):
    _, http, grpc = poll_server
    for client, status in ((http, str(http_status(Code.UNAVAILABLE))),
                           (grpc, f"StatusCode.{grpc_status_name(Code.UNAVAILABLE)}")):
        with pytest.raises(InferenceServerException, match="explicit model load / unload is not allowed") as info:
            client.load_model("simple")
        assert info.value.status() == status


def test_a_new_version_folder_starts_its_own_rollout_and_is_promoted(poll_server, model_repository):
    """A model whose config asks for rollouts: its new version folder is rolled out beside the
    version before it, judged, promoted, and the version policy (latest 1) then unloads the old."""
    repo, http, _ = poll_server
    model = repo / "rolled"
    shutil.copytree(model_repository / ROLLOUT_MODEL, model)
    shutil.rmtree(model / "2")
    config = model / "config.pbtxt"
    config.write_text(config.read_text().replace(f'name: "{ROLLOUT_MODEL}"', 'name: "rolled"').replace(
        "num_versions: 2", "num_versions: 1") + "".join(
        f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n' for key, value in
        (("rollout_steps", "50,100"), ("rollout_step_seconds", "1"), ("rollout_step_requests", "10"),
         ("rollout_max_latency_ratio", "10"), ("rollout_latency_slack_ms", "50"))))
    wait_until(lambda: http.is_model_ready("rolled"), "the poll to load 'rolled'")
    tensor = httpclient.InferInput("INPUT0", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 1), np.float32))
    assert http.infer("rolled", [tensor]).get_response()["model_version"] == "1"
    shutil.copytree(model_repository / ROLLOUT_MODEL / "2", model / "2")

    def rollout() -> dict | None:
        status, doc = http_json("GET", "/v2/repository/models/rolled/rollout", port=PORT)
        return doc if status == 200 else None

    started = wait_until(rollout, "the poll to start a rollout of version 2")
    assert (started["stable_version"], started["candidate_version"]) == ("1", "2"), started
    answered: set[str] = set()

    def promoted() -> bool:
        for _ in range(10):
            answered.add(http.infer("rolled", [tensor]).get_response()["model_version"])
        return rollout()["state"] == "PROMOTED"

    wait_until(promoted, "the rollout to promote version 2", timeout_s=120)
    assert answered == {"1", "2"}
    wait_until(lambda: not http.is_model_ready("rolled", "1"), "version 1 to be unloaded (latest 1)")
    assert http.infer("rolled", [tensor]).get_response()["model_version"] == "2"
    shutil.rmtree(model)


def copies(name: str) -> float:
    """A version's loaded copies, by the metrics port (absent: 0)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT + 2}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(f'rayinfer_model_copies{{model="{name}",version="1"}} '):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_busy_pooled_model_gets_a_copy_on_the_other_pool_replica(poll_server, model_repository):
    """Two pooled models, two pool replicas keeping one loaded each: the one with fewer copies,
    asked about ten times a second on new connections (past --pool-scale-up-rpm 60), gets a copy
    on each replica, and no request fails while the copy loads."""
    repo, _, _ = poll_server
    names = ("spread_a", "spread_b")
    for name in names:
        shutil.copytree(model_repository / on_demand("poll_added"), repo / name)
        config = repo / name / "config.pbtxt"
        config.write_text(config.read_text() + 'parameters { key: "rayinfer_hosting" value: { string_value: "pool" } }\n')
    try:
        wait_until(lambda: all(http_json("GET", f"/v2/models/{name}/ready", port=PORT)[0] == 200 for name in names),
                   "the poll to load both models into the pool")
        target = min(names, key=copies)  # each replica keeps one: at most one copy of this one
        assert copies(target) <= 1
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        asked = 0

        def busy_until_copied() -> bool:
            nonlocal asked
            for _ in range(10):
                client = httpclient.InferenceServerClient(f"127.0.0.1:{PORT}", network_timeout=60.0)
                try:  # a new connection each time: the front spreads connections over the copies
                    np.testing.assert_array_equal(client.infer(target, add_sub_inputs(a, a)).as_numpy("OUTPUT0"), a * 2)
                finally:
                    client.close()
                asked += 1
                time.sleep(0.05)  # paces the load (about ten a second): a rate, not a wait for an event
            return copies(target) == 2

        wait_until(busy_until_copied, f"a second copy of the busy '{target}'", timeout_s=90)
        assert asked >= 10
    finally:
        for name in names:
            shutil.rmtree(repo / name)
    wait_until(lambda: all(http_json("GET", f"/v2/models/{name}/ready", port=PORT)[0] != 200 for name in names),
               "the poll to unload both")
