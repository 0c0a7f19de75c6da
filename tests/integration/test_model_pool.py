"""Pooled hosting on a server of its own (the test repository, nothing loaded at start,
``--pool-max-models 3``): model versions whose config asks for the pool share the pool's
replica process, each answering, counting and failing as its own model, and the pool keeps
within its budget. (The session server pools every model it can, with no budget.)"""

from __future__ import annotations

import concurrent.futures
import json
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import (HTTP_PORT, LOAD_TIMEOUT_S, add_sub_inputs, http_json, metric_value, pids_titled, port_flags,
                      start_server, stop_server, stop_shared_server)
from model_factory import on_demand
from waiting import wait_until

pytestmark = pytest.mark.own_cluster

POOL_MAX_MODELS = 3  # this server's --pool-max-models
POOLED = [on_demand("pool_a"), on_demand("pool_b"), on_demand("pool_c")]
BROKEN = on_demand("pool_broken")
EXTRA = on_demand("pool_d")  # one past the pool's --pool-max-models with POOLED
# The index's reason for a pooled version its replica does not hold loaded now.
NOT_LOADED = "not loaded now (--pool-max-models)"
POOL_REPLICAS = "ServeReplica:rayinfer-pool:"


def config(name: str, **extra) -> str:
    """The on-demand add/sub model's config, asking for the pool."""
    doc = {
        "name": name, "platform": "onnxruntime_onnx", "max_batch_size": 8,
        "input": [{"name": n, "data_type": "TYPE_INT32", "dims": [16]} for n in ("INPUT0", "INPUT1")],
        "output": [{"name": n, "data_type": "TYPE_INT32", "dims": [16]} for n in ("OUTPUT0", "OUTPUT1")],
        "parameters": {"rayinfer_hosting": {"string_value": "pool"}},
    }
    doc.update(extra)
    return json.dumps(doc)


def index_row(name: str) -> dict:
    status, rows = http_json("POST", "/v2/repository/index")
    assert status == 200
    (row,) = [r for r in rows if r["name"] == name]
    return row


@pytest.fixture(scope="module")
def server(model_repository, tmp_path_factory):
    """This module's server, on the session server's ports (which it stops first: one Ray
    cluster at a time on a small machine)."""
    stop_shared_server()
    log = tmp_path_factory.mktemp("pool_server") / "rayinfer.log"
    proc = start_server(model_repository, log, [
        "--model-control-mode", "explicit", *port_flags(HTTP_PORT), "--pool-max-models", str(POOL_MAX_MODELS),
        "--openai-api=false",  # (no /v1 here: one replica less)
    ])
    try:
        yield {"url": f"127.0.0.1:{HTTP_PORT}", "grpc_url": f"127.0.0.1:{HTTP_PORT + 1}",
               "metrics_url": f"http://127.0.0.1:{HTTP_PORT + 2}/metrics"}
    finally:
        stop_server(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server["url"], network_timeout=LOAD_TIMEOUT_S)

    def load(name: str) -> None:
        with httpclient.InferenceServerClient(server["url"], network_timeout=LOAD_TIMEOUT_S) as own:
            own.load_model(name, config=config(name))

    with concurrent.futures.ThreadPoolExecutor(len(POOLED)) as loads:  # at once: each ends in the pool
        list(loads.map(load, POOLED))
    yield c
    for name in [*POOLED, BROKEN, EXTRA]:
        c.unload_model(name)
    c.close()


def add_sub(c, model: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    a = np.full((1, 16), seed, dtype=np.int32)
    b = np.arange(16, dtype=np.int32).reshape(1, 16)
    result = c.infer(model, add_sub_inputs(a, b))
    return result.as_numpy("OUTPUT0"), result.as_numpy("OUTPUT1")


def test_pooled_models_share_one_process_and_each_answers_over_both_protocols(server, client):
    assert len(pids_titled(POOL_REPLICAS)) == 1
    for name in POOLED:
        assert not pids_titled(f"ServeReplica:{name}:"), f"{name} has a replica of its own"
        assert index_row(name)["state"] == "READY"
        total, difference = add_sub(client, name, 7)
        assert (total == 7 + np.arange(16)).all() and (difference == 7 - np.arange(16)).all()
    grpc = grpcclient.InferenceServerClient(server["grpc_url"])
    try:
        for name in POOLED:
            a = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
            a.set_data_from_numpy(np.ones((1, 16), np.int32))
            b = grpcclient.InferInput("INPUT1", [1, 16], "INT32")
            b.set_data_from_numpy(np.ones((1, 16), np.int32))
            assert (grpc.infer(name, [a, b]).as_numpy("OUTPUT0") == 2).all()
            assert grpc.is_model_ready(name)
            assert grpc.get_model_metadata(name).name == name
            assert grpc.get_model_config(name).config.parameters["rayinfer_hosting"].string_value == "pool"
    finally:
        grpc.close()


def test_each_pooled_model_keeps_its_own_statistics_and_metrics(server, client):
    before = {name: client.get_inference_statistics(name)["model_stats"][0]["inference_stats"]["success"]["count"]
              for name in POOLED[:2]}
    for _ in range(5):
        add_sub(client, POOLED[0], 1)
    for _ in range(3):
        add_sub(client, POOLED[1], 1)

    def counts() -> dict[str, int]:
        return {name: client.get_inference_statistics(name)["model_stats"][0]["inference_stats"]["success"]["count"]
                - before[name] for name in POOLED[:2]}

    wait_until(lambda: counts() == {POOLED[0]: 5, POOLED[1]: 3}, "each model's own success count")
    wait_until(lambda: metric_value(server, f'nv_inference_request_success{{model="{POOLED[1]}",version="1"}}')
               >= 3, "the metric of the second pooled model")


def test_a_model_that_fails_in_the_pool_leaves_its_neighbours_serving(server, client):
    pool = pids_titled(POOL_REPLICAS)
    with pytest.raises(InferenceServerException) as failure:
        # An input the ONNX model does not have: the model's own load fails, in the pool's replica.
        client.load_model(BROKEN, config=config(BROKEN, input=[
            {"name": "NOT_AN_INPUT", "data_type": "TYPE_INT32", "dims": [16]},
            {"name": "INPUT1", "data_type": "TYPE_INT32", "dims": [16]}]))
    assert "NOT_AN_INPUT" in str(failure.value)
    row = index_row(BROKEN)
    assert row["state"] == "UNAVAILABLE" and "NOT_AN_INPUT" in row["reason"]
    assert pids_titled(POOL_REPLICAS) == pool  # the pool was not restarted
    for name in POOLED:
        assert (add_sub(client, name, 2)[0] == 2 + np.arange(16)).all()


def test_a_model_that_asks_for_the_pool_and_cannot_have_it_is_refused_with_the_reason(client):
    with pytest.raises(InferenceServerException) as failure:
        client.load_model(BROKEN, config=config(BROKEN, instance_group=[{"count": 2, "kind": "KIND_CPU"}]))
    assert "asks for the pool" in str(failure.value) and "2 instances" in str(failure.value)


def test_unloading_a_pooled_model_keeps_the_others_in_the_same_process(server, client):
    pool = pids_titled(POOL_REPLICAS)
    client.unload_model(POOLED[2])
    assert index_row(POOLED[2])["state"] == "UNAVAILABLE"
    with pytest.raises(InferenceServerException):
        add_sub(client, POOLED[2], 1)
    for name in POOLED[:2]:
        assert (add_sub(client, name, 3)[0] == 3 + np.arange(16)).all()
    assert pids_titled(POOL_REPLICAS) == pool
    client.load_model(POOLED[2], config=config(POOLED[2]))
    assert (add_sub(client, POOLED[2], 4)[0] == 4 + np.arange(16)).all()
    assert pids_titled(POOL_REPLICAS) == pool


def test_one_grpc_stream_reaches_each_pooled_model_it_names(server, client):
    """A stream's requests for several pooled models, on one connection: each is answered by the
    model it names (the pool's versions share one deployment, not one route)."""
    import queue

    answers: queue.Queue = queue.Queue()
    grpc = grpcclient.InferenceServerClient(server["grpc_url"])
    try:
        grpc.start_stream(callback=lambda result, error: answers.put((result, error)))
        for i, name in enumerate([*POOLED, *POOLED]):
            a = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
            a.set_data_from_numpy(np.full((1, 16), i, np.int32))
            b = grpcclient.InferInput("INPUT1", [1, 16], "INT32")
            b.set_data_from_numpy(np.zeros((1, 16), np.int32))
            grpc.async_stream_infer(name, [a, b], request_id=str(i))
        got = [answers.get(timeout=30) for _ in range(2 * len(POOLED))]
        grpc.stop_stream()
    finally:
        grpc.close()
    assert all(error is None for _, error in got), [error for _, error in got if error is not None][:1]
    named = {r.get_response().id: r.get_response().model_name for r, _ in got}
    assert named == {str(i): name for i, name in enumerate([*POOLED, *POOLED])}


def test_loading_a_pooled_model_again_reloads_it_in_the_same_process_under_traffic(server, client):
    """A reload of a pooled model while clients call it over HTTP and gRPC: the new load takes
    over with no request failed, in the same process."""
    pool = pids_titled(POOL_REPLICAS)
    errors: list[str] = []
    answered = [0]
    stop = threading.Event()

    def traffic(use_grpc: bool) -> None:
        c = (grpcclient.InferenceServerClient(server["grpc_url"]) if use_grpc else
             httpclient.InferenceServerClient(server["url"], network_timeout=60))
        try:
            while not stop.is_set():
                try:
                    total = grpc_add_sub(c, POOLED[0], 5) if use_grpc else add_sub(c, POOLED[0], 5)[0]
                    if not (total == 5 + np.arange(16)).all():
                        errors.append(f"a wrong answer {total}")
                    answered[0] += 1
                except Exception as exc:  # noqa: BLE001  # every failure is reported below
                    errors.append(f"{'gRPC' if use_grpc else 'HTTP'}: {exc}")
        finally:
            c.close()

    threads = [threading.Thread(target=traffic, args=(use_grpc,)) for use_grpc in (False, True)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: answered[0] > 10, "the traffic to start")
        for batch in (4, 8):
            client.load_model(POOLED[0], config=config(POOLED[0], max_batch_size=batch))
            assert client.get_model_config(POOLED[0])["max_batch_size"] == batch
        seen = answered[0]
        wait_until(lambda: answered[0] > seen + 10, "the traffic to go on after the reloads")
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert not errors, errors[:5]
    assert pids_titled(POOL_REPLICAS) == pool


def loaded(name: str) -> bool:
    """Whether the pool holds ``name`` loaded now (the index says which it does not)."""
    return NOT_LOADED not in index_row(name).get("reason", "")


def copies(server, name: str) -> float:
    """The version's loaded copies, by the metrics port (absent: 0)."""
    return metric_value(server, f'rayinfer_model_copies{{model="{name}",version="1"}}')


def success_count(c, name: str) -> int:
    return c.get_inference_statistics(name)["model_stats"][0]["inference_stats"]["success"]["count"]


def grpc_add_sub(grpc, name: str, seed: int) -> np.ndarray:
    a = grpcclient.InferInput("INPUT0", [1, 16], "INT32")
    a.set_data_from_numpy(np.full((1, 16), seed, np.int32))
    b = grpcclient.InferInput("INPUT1", [1, 16], "INT32")
    b.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
    return grpc.infer(name, [a, b]).as_numpy("OUTPUT0")


def test_past_max_models_the_least_recently_used_model_is_unloaded_and_loads_again_when_asked(server, client):
    assert len(POOLED) == POOL_MAX_MODELS
    pool = pids_titled(POOL_REPLICAS)
    for name in POOLED:  # POOLED[0] is now the least recently used
        add_sub(client, name, 1)
    client.load_model(EXTRA, config=config(EXTRA))
    wait_until(lambda: not loaded(POOLED[0]), "the least recently used model unloaded")
    assert index_row(POOLED[0])["state"] == "READY"
    wait_until(lambda: copies(server, POOLED[0]) == 0 and copies(server, EXTRA) == 1,
               "the metrics port to count the copies loaded")
    assert all(loaded(name) for name in (*POOLED[1:], EXTRA))
    assert client.is_model_ready(POOLED[0])  # ready (it loads on its next request) ...
    assert not loaded(POOLED[0])  # ... and asking did not load it
    before = success_count(client, POOLED[0])
    # Its next request, over HTTP, loads it again; another idle model makes room.
    total, difference = add_sub(client, POOLED[0], 6)
    assert (total == 6 + np.arange(16)).all() and (difference == 6 - np.arange(16)).all()
    wait_until(lambda: loaded(POOLED[0]) and not loaded(POOLED[1]), "the next least recently used one unloaded")
    # Its figures go on from before it was unloaded.
    wait_until(lambda: success_count(client, POOLED[0]) == before + 1, "the statistics kept across the unload")
    # An unloaded model asked over gRPC loads again too.
    grpc = grpcclient.InferenceServerClient(server["grpc_url"])
    try:
        assert (grpc_add_sub(grpc, POOLED[1], 8) == 8 + np.arange(16)).all()
        assert grpc.get_model_metadata(POOLED[1]).name == POOLED[1]
    finally:
        grpc.close()
    assert pids_titled(POOL_REPLICAS) == pool


def test_models_unloaded_and_loaded_again_under_load_lose_no_request(server, client):
    """Three clients cycle over four pooled models (one more than the pool keeps loaded), each
    request over HTTP or gRPC in turn: models are unloaded and loaded again all along, and every
    request is answered, and answered right."""
    models = [*POOLED, EXTRA]
    pool = pids_titled(POOL_REPLICAS)
    errors: list[str] = []
    answered: list[int] = []
    unloaded_seen: set[str] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            status, rows = http_json("POST", "/v2/repository/index")
            unloaded_seen.update(r["name"] for r in rows if NOT_LOADED in r.get("reason", ""))
            stop.wait(0.05)

    def work(worker: int) -> None:
        http = httpclient.InferenceServerClient(server["url"], network_timeout=120)
        grpc = grpcclient.InferenceServerClient(server["grpc_url"])
        try:
            for i in range(20):
                name, seed = models[(worker + i) % len(models)], worker * 100 + i
                try:
                    if i % 2:
                        total = grpc_add_sub(grpc, name, seed)
                    else:
                        total = add_sub(http, name, seed)[0]
                except Exception as exc:  # noqa: BLE001  # every failure is reported below
                    errors.append(f"{name} ({'gRPC' if i % 2 else 'HTTP'}): {exc}")
                    continue
                if not (total == seed + np.arange(16)).all():
                    errors.append(f"{name}: a wrong answer {total}")
                answered.append(1)
        finally:
            http.close()
            grpc.close()

    watcher = threading.Thread(target=watch)
    watcher.start()
    workers = [threading.Thread(target=work, args=(w,)) for w in range(3)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    stop.set()
    watcher.join()
    assert not errors, errors[:5]
    assert len(answered) == 60
    assert unloaded_seen, "no model was unloaded while the clients ran"
    assert pids_titled(POOL_REPLICAS) == pool


PY_POOLED = ("py_pooled_a", "py_pooled_b")  # tests/python_models.py: OUT = IN + 1 (a), IN + 10 (b)


def py_ask(c, model: str, value: int, **parameters) -> tuple[int, str]:
    """(OUT, DIR) of one pooled Python model for IN = value, over HTTP or gRPC (``c``'s module)."""
    module = grpcclient if isinstance(c, grpcclient.InferenceServerClient) else httpclient
    tensor = module.InferInput("IN", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[value]], np.int32))
    result = c.infer(model, [tensor], parameters=parameters or None)
    return int(result.as_numpy("OUT")[0][0]), result.as_numpy("DIR")[0][0].decode()


@pytest.fixture(scope="module")
def py_pooled(client):
    for name in PY_POOLED:
        client.load_model(name)
    yield PY_POOLED
    for name in PY_POOLED:
        client.unload_model(name)


def crowd_out(c, names: tuple[str, ...]) -> None:
    """Ask the three add/sub models until the pool (three loaded) has unloaded ``names`` (a
    request may still reach an unloaded model's listener while it drains, loading nothing)."""
    def unloaded() -> bool:
        for name in POOLED:
            add_sub(c, name, 1)
        return not any(loaded(name) for name in names)

    wait_until(unloaded, f"{', '.join(names)} unloaded")


def test_python_models_share_the_pool_each_with_its_own_folder_and_bls_calls(server, client, py_pooled):
    """Two Python models in the pool's one process: each answers with its own config and its own
    pb_utils.get_model_dir(), and one calls the other by BLS (loaded again if the pool had
    unloaded it), over HTTP and gRPC."""
    pool = pids_titled(POOL_REPLICAS)
    assert not pids_titled("ServeReplica:py_pooled_")  # no replica of their own
    grpc = grpcclient.InferenceServerClient(server["grpc_url"])
    try:
        for c in (client, grpc):
            for name, offset in zip(PY_POOLED, (1, 10)):
                out, folder = py_ask(c, name, 5)
                assert out == 5 + offset and folder.endswith(f"/{name}"), (name, out, folder)
            assert py_ask(c, "py_pooled_a", 5, via="py_pooled_b") == (5 + 1 + 5 + 10, py_ask(c, "py_pooled_a", 0)[1])
        # The pool keeps three models loaded: with the three add/sub models asked, both Python
        # models are unloaded; a's next request loads it again, and its BLS call loads b again.
        crowd_out(client, PY_POOLED)
        assert py_ask(grpc, "py_pooled_a", 2, via="py_pooled_b")[0] == 2 + 1 + 2 + 10
        wait_until(lambda: loaded("py_pooled_a") and loaded("py_pooled_b"), "both loaded again")
    finally:
        grpc.close()
    assert pids_titled(POOL_REPLICAS) == pool


def test_python_models_in_one_process_count_their_own_metric_family_once(server, client, py_pooled):
    """Both models report the process's families with their statistics; each request counts
    once (a label of this test's own starts at zero)."""
    def requests(name: str) -> float:
        return metric_value(server, f'pooled_python_requests{{model="{name}",tag="once"}}')

    for _ in range(3):
        py_ask(client, "py_pooled_a", 1, tag="once")
    py_ask(client, "py_pooled_b", 1, tag="once")
    wait_until(lambda: (requests("py_pooled_a"), requests("py_pooled_b")) == (3, 1), "one count per request")


def test_an_ensemble_of_pooled_models_loads_its_unloaded_steps_again(server, client, py_pooled):
    """ens_pooled's two steps are the pooled Python models: with both unloaded past
    --pool-max-models, the ensemble's next request loads them again, over HTTP and gRPC."""
    client.load_model("ens_pooled")
    grpc = grpcclient.InferenceServerClient(server["grpc_url"])
    try:
        for c in (client, grpc):
            assert ens_pooled(c, 5) == 5 + 1 + 10
        for c in (grpc, client):
            crowd_out(client, PY_POOLED)
            assert ens_pooled(c, 7) == 7 + 1 + 10
    finally:
        grpc.close()
        client.unload_model("ens_pooled")


def ens_pooled(c, value: int) -> int:
    module = grpcclient if isinstance(c, grpcclient.InferenceServerClient) else httpclient
    tensor = module.InferInput("IN", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[value]], np.int32))
    return int(c.infer("ens_pooled", [tensor]).as_numpy("OUT")[0][0])


def seq_pooled(c, sequence_id: int, value: int, start: bool = False, end: bool = False) -> int:
    """One request of a seq_pooled sequence: the sequence's running sum from 100."""
    module = grpcclient if isinstance(c, grpcclient.InferenceServerClient) else httpclient
    tensor = module.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[value]], np.int32))
    result = c.infer("seq_pooled", [tensor], sequence_id=sequence_id, sequence_start=start, sequence_end=end)
    return int(result.as_numpy("OUTPUT")[0][0])


def test_a_pooled_sequence_model_is_not_unloaded_while_it_holds_a_sequence(server, client):
    """seq_pooled keeps each sequence's sum in its implicit state: with two sequences open, the
    pool unloads others past --pool-max-models, never it; once they end it is unloaded as any."""
    client.load_model("seq_pooled")
    grpc = grpcclient.InferenceServerClient(server["grpc_url"])
    try:
        assert not pids_titled("ServeReplica:seq_pooled:")
        assert seq_pooled(grpc, 9001, 5, start=True) == 105
        assert seq_pooled(client, 9002, 1, start=True) == 101
        for _ in range(3):  # each round loads add/sub models again, past the budget
            for name in (*POOLED, EXTRA):
                add_sub(client, name, 1)
        assert loaded("seq_pooled")
        assert seq_pooled(grpc, 9001, 5) == 110 and seq_pooled(client, 9002, 1) == 102
        assert seq_pooled(grpc, 9001, 5, end=True) == 115 and seq_pooled(client, 9002, 1, end=True) == 103
        crowd_out(client, ("seq_pooled",))
        assert seq_pooled(grpc, 9003, 7, start=True, end=True) == 107  # loaded again, a new sequence
    finally:
        grpc.close()
        client.unload_model("seq_pooled")
