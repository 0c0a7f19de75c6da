"""Ensembles through unmodified tritonclient, over HTTP and gRPC: step graphs, conditional steps,
errors naming the step, load-time validation, explicit-mode loading (models in
tests/ensemble_models.py)."""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import LOAD_TIMEOUT_S, tensor
from ensemble_models import ENSEMBLE_MODELS
from stream_answers import stream_answers
from trace_files import ORDER, trace_files, trace_settings, traces_by_id
from waiting import wait_until


@pytest.fixture(scope="module", autouse=True)
def ensembles(server):
    """The ensembles and their members, unloaded when this module ends (all at once: the server
    runs unloads of different models together)."""
    yield

    def unload(model: str) -> None:
        with httpclient.InferenceServerClient(server["url"], network_timeout=600.0) as client:
            client.unload_model(model)

    with concurrent.futures.ThreadPoolExecutor(len(ENSEMBLE_MODELS)) as pool:
        list(pool.map(unload, ENSEMBLE_MODELS))


def ints(module, **arrays: np.ndarray) -> list:
    return [tensor(module, name, array, "INT32") for name, array in arrays.items()]


def pair(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 1000, (1, 16)).astype(np.int32), rng.integers(0, 1000, (1, 16)).astype(np.int32))


def url_of(module, server: dict) -> str:
    return server["url"] if module is httpclient else server["grpc_url"]


_LOCAL = threading.local()


def thread_client(module, server: dict):
    """One client per thread and protocol (a client is not shared between threads)."""
    key = f"{module.__name__}:{url_of(module, server)}"
    client = getattr(_LOCAL, "clients", {}).get(key)
    if client is None:
        _LOCAL.clients = {**getattr(_LOCAL, "clients", {}), key: module.InferenceServerClient(url_of(module, server))}
        client = _LOCAL.clients[key]
    return client


def infer_concurrently(module, server: dict, model: str, pairs: list, outputs: tuple[str, str],
                       threads: int) -> list[tuple]:
    """``model`` on each (A, B) pair from ``threads`` threads at once; each pair's two outputs."""
    def one(ab: tuple[np.ndarray, np.ndarray]) -> tuple:
        result = thread_client(module, server).infer(model, ints(module, A=ab[0], B=ab[1]))
        return tuple(result.as_numpy(name) for name in outputs)

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, pairs))


def test_an_ensemble_output_asked_for_as_a_classification(proto):
    """Triton's classification extension on an ensemble's output: its top classes as strings."""
    module, client = proto
    a, b = pair(1)
    top = client.infer("ens_chain", ints(module, A=a, B=b),
                       outputs=[module.InferRequestedOutput("TWICE_A", class_count=2)]).as_numpy("TWICE_A")
    order = np.argsort(-a[0], kind="stable")[:2]
    expected = [[f"{2 * a[0][i]}:{i}".encode() for i in order]]
    assert [[e if isinstance(e, bytes) else e.encode() for e in row] for row in top.tolist()] == expected


def stats(client, module, model: str) -> dict:
    kwargs = {"as_json": True} if module is grpcclient else {}
    return client.get_inference_statistics(model, **kwargs)["model_stats"][0]


def test_steps_chain_fan_out_and_nest(proto):
    """A chain, a diamond whose middle steps run side by side, and an ensemble as a step."""
    module, client = proto
    a, b = pair(1)
    result = client.infer("ens_chain", ints(module, A=a, B=b))
    np.testing.assert_array_equal(result.as_numpy("TWICE_A"), 2 * a)
    np.testing.assert_array_equal(result.as_numpy("TWICE_B"), 2 * b)
    result = client.infer("ens_diamond", ints(module, A=a, B=b))
    np.testing.assert_array_equal(result.as_numpy("SUM"), a + b)
    np.testing.assert_array_equal(result.as_numpy("DIFF"), a - b)
    np.testing.assert_array_equal(result.as_numpy("SUM2"), 2 * a + 2 * b)
    np.testing.assert_array_equal(result.as_numpy("DIFF2"), 2 * a - 2 * b)
    result = client.infer("ens_nested", ints(module, X=a, Y=b))
    np.testing.assert_array_equal(result.as_numpy("OUT_SUM"), 2 * a + 2 * b)
    np.testing.assert_array_equal(result.as_numpy("OUT_DIFF"), 2 * a - 2 * b)


def test_only_the_requested_outputs_return(proto):
    module, client = proto
    a, b = pair(2)
    result = client.infer("ens_diamond", ints(module, A=a, B=b), outputs=[module.InferRequestedOutput("DIFF2")])
    np.testing.assert_array_equal(result.as_numpy("DIFF2"), 2 * a - 2 * b)
    assert result.as_numpy("SUM") is None and result.as_numpy("SUM2") is None


def test_bytes_pass_through_a_python_member(proto):
    module, client = proto
    text = np.array([["héllo".encode(), b"", b"\x00world"]], dtype=object)
    result = client.infer("ens_strings", [tensor(module, "TEXT", text, "BYTES")])
    np.testing.assert_array_equal(result.as_numpy("ECHO"), text)


def test_conditional_steps_run_only_when_their_condition_holds(proto):
    """step_1_run_if FLAG and step_2_run_if_present EXTRA: without them only SUM returns."""
    module, client = proto
    a, extra = pair(3)
    result = client.infer("ens_conditional", ints(module, A=a))
    np.testing.assert_array_equal(result.as_numpy("SUM"), 2 * a)
    assert result.as_numpy("SUM2") is None and result.as_numpy("EXTRA2") is None
    flag = tensor(module, "FLAG", np.array([[True]]), "BOOL")
    result = client.infer("ens_conditional", [*ints(module, A=a, EXTRA=extra), flag])
    np.testing.assert_array_equal(result.as_numpy("SUM2"), 4 * a)
    np.testing.assert_array_equal(result.as_numpy("EXTRA2"), 2 * extra)
    off = tensor(module, "FLAG", np.array([[False]]), "BOOL")
    result = client.infer("ens_conditional", [*ints(module, A=a), off])
    assert result.as_numpy("SUM2") is None


def test_concurrent_requests_get_their_own_results_and_members_batch_them(proto, server):
    """48 requests at once, each checked against its own inputs; the Python member with dynamic
    batching executes the doublings of many ensemble requests together."""
    module, client = proto
    before = stats(client, module, "ens_double")
    pairs = [pair(100 + i) for i in range(48)]

    results = infer_concurrently(module, server, "ens_diamond", pairs, ("SUM2", "DIFF"), threads=16)
    for (a, b), (sum2, diff) in zip(pairs, results):
        np.testing.assert_array_equal(sum2, 2 * a + 2 * b)
        np.testing.assert_array_equal(diff, a - b)
    after = stats(client, module, "ens_double")
    inferences = int(after["inference_count"]) - int(before.get("inference_count", 0))
    executions = int(after["execution_count"]) - int(before.get("execution_count", 0))
    assert inferences == 2 * 48
    assert executions < inferences  # some executions held several ensemble requests' rows


def test_a_failing_step_fails_only_its_request(proto, server):
    """Requests whose member step fails get an error naming the ensemble, step and model; the
    requests running beside them are answered, and the ensemble keeps serving."""
    module, client = proto
    good = [pair(200 + i) for i in range(6)]
    bad = np.full((1, 16), -13, dtype=np.int32)

    def one(a: np.ndarray, b: np.ndarray) -> object:
        try:
            return thread_client(module, server).infer("ens_diamond", ints(module, A=a, B=b)).as_numpy("SUM2")
        except InferenceServerException as exc:
            return exc

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, bad, good[0][1]) for _ in range(3)] + [pool.submit(one, *ab) for ab in good]
        results = [f.result() for f in futures]
    for error in results[:3]:
        assert isinstance(error, InferenceServerException)
        assert "in ensemble 'ens_diamond', step 1 (model 'ens_double') failed: unlucky input -13" in str(error)
    for (a, b), sum2 in zip(good, results[3:]):
        np.testing.assert_array_equal(sum2, 2 * a + 2 * b)
    a, b = pair(300)
    np.testing.assert_array_equal(client.infer("ens_diamond", ints(module, A=a, B=b)).as_numpy("SUM2"), 2 * a + 2 * b)


def test_the_ensemble_checks_requests_against_its_own_config(proto):
    module, client = proto
    a, b = pair(4)
    with pytest.raises(InferenceServerException, match="input 'A' data-type is 'FP32', but model 'ens_chain'"):
        client.infer("ens_chain", [tensor(module, "A", a.astype(np.float32), "FP32"), *ints(module, B=b)])
    with pytest.raises(InferenceServerException, match="batch-size must be <= 8 for 'ens_chain'"):
        client.infer("ens_chain", ints(module, A=np.zeros((9, 16), np.int32), B=np.zeros((9, 16), np.int32)))
    with pytest.raises(InferenceServerException, match="missing required input"):
        client.infer("ens_chain", ints(module, A=a))


def test_metadata_config_readiness_and_statistics(proto):
    module, client = proto
    kwargs = {"as_json": True} if module is grpcclient else {}
    metadata = client.get_model_metadata("ens_chain", **kwargs)
    assert metadata["platform"] == "ensemble"
    assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in metadata["inputs"]] == [
        ("A", "INT32", [-1, 16]), ("B", "INT32", [-1, 16])]
    config = client.get_model_config("ens_chain", **kwargs)
    config = config.get("config", config)
    assert config["platform"] == "ensemble"
    assert [s["model_name"] for s in config["ensemble_scheduling"]["step"]] == ["simple", "simple"]
    assert client.is_model_ready("ens_chain") and client.is_model_ready("ens_nested")
    before = int(stats(client, module, "ens_chain").get("inference_count", 0))
    a, b = pair(5)
    client.infer("ens_chain", ints(module, A=np.concatenate([a, b]), B=np.concatenate([b, a])))
    wait_until(lambda: int(stats(client, module, "ens_chain")["inference_count"]) == before + 2,
               "the ensemble's statistics to count the request's two rows")


BROKEN_ENSEMBLES = {
    "ensbad_unknown_model": "step 0 names model 'no_such_model', which is not in the model repository",
    "ensbad_dtype": "step 0 (model 'simple') input 'INPUT0' is INT32, but tensor 'A' from the ensemble's input is FP32",
    "ensbad_unmapped": "step 0 (model 'simple') does not map input 'INPUT1' of model 'simple'",
    "ensbad_batch": "step 0 (model 'simple') allows batches of 8, fewer than the ensemble's max_batch_size 16",
    "ensbad_cycle": "step 0 (model 'simple') and step 1 (model 'simple') wait for each other's outputs",
    "ensbad_unused": "input 'C' is not read by any step",
}


@pytest.fixture(scope="module")
def broken_loads(server):
    """Each broken ensemble's load error (all loaded at once: the server runs loads of different
    models together); unloaded after the module, as a load error counts against readiness."""

    def load(model: str) -> InferenceServerException | None:
        with httpclient.InferenceServerClient(server["url"], network_timeout=LOAD_TIMEOUT_S) as client:
            try:
                client.load_model(model)
            except InferenceServerException as exc:
                return exc
        return None

    def unload(model: str) -> None:
        with httpclient.InferenceServerClient(server["url"], network_timeout=LOAD_TIMEOUT_S) as client:
            client.unload_model(model)

    with concurrent.futures.ThreadPoolExecutor(len(BROKEN_ENSEMBLES)) as pool:
        yield dict(zip(BROKEN_ENSEMBLES, pool.map(load, BROKEN_ENSEMBLES)))
        list(pool.map(unload, BROKEN_ENSEMBLES))


@pytest.mark.parametrize("model, message", list(BROKEN_ENSEMBLES.items()))
def test_a_broken_ensemble_fails_to_load_naming_the_step(server, broken_loads, model, message):
    client = httpclient.InferenceServerClient(server["url"], network_timeout=LOAD_TIMEOUT_S)
    error = broken_loads[model]
    assert error is not None and f"failed to load '{model}'" in str(error) and message in str(error)
    assert not client.is_model_ready(model)
    row = next(r for r in client.get_model_repository_index() if r["name"] == model)
    assert row["state"] == "UNAVAILABLE" and message in row["reason"]
    assert client.is_model_ready("ens_chain")  # the others keep serving


def test_a_decoupled_member_streams_through_the_ensemble(server):
    """ens_stream: py_repeat answers once per element; each answer runs the next step, and the
    ensemble streams one response per element over gRPC (decoupled, like its member)."""
    import queue

    client = grpcclient.InferenceServerClient(server["grpc_url"])
    config = client.get_model_config("ens_stream", as_json=True)["config"]
    assert config["model_transaction_policy"]["decoupled"] is True
    received: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    try:
        client.async_stream_infer("ens_stream", [tensor(grpcclient, "VALUES", np.array([3, 5, 7], dtype=np.int32), "INT32")])
        client.async_stream_infer("ens_stream", [tensor(grpcclient, "VALUES", np.array([-2], dtype=np.int32), "INT32")])
        answers = stream_answers(received, 4, server)
    finally:
        client.stop_stream()
    assert [error for _, error in answers] == [None] * 4
    squares = sorted((int(r.as_numpy("INDEX")[0]), int(r.as_numpy("SQUARE")[0])) for r, _ in answers)
    assert squares == [(0, 4), (0, 9), (1, 25), (2, 49)]
    with pytest.raises(InferenceServerException, match="doesn't support models with decoupled transaction policy"):
        client.infer("ens_stream", [tensor(grpcclient, "VALUES", np.array([1], dtype=np.int32), "INT32")])
    http_client = httpclient.InferenceServerClient(server["url"])
    with pytest.raises(InferenceServerException, match="HTTP end point doesn't support models with decoupled"):
        http_client.infer("ens_stream", [tensor(httpclient, "VALUES", np.array([1], dtype=np.int32), "INT32")])


def test_loading_an_ensemble_loads_its_members_and_unload_dependents_removes_them(server):
    """Explicit mode: the ensemble's load loads its member; with the member unloaded the
    ensemble is not ready and says which step failed; unload_dependents takes the member along."""
    client = httpclient.InferenceServerClient(server["url"], network_timeout=LOAD_TIMEOUT_S)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    assert not client.is_model_ready("ens_on_demand_member")
    client.load_model("ens_on_demand")
    assert client.is_model_ready("ens_on_demand") and client.is_model_ready("ens_on_demand_member")
    np.testing.assert_array_equal(client.infer("ens_on_demand", ints(httpclient, A=a)).as_numpy("A2"), 2 * a)
    client.unload_model("ens_on_demand_member")
    wait_until(lambda: not client.is_model_ready("ens_on_demand"), "the ensemble to be not ready without its member")
    with pytest.raises(InferenceServerException, match="step 0 \\(model 'ens_on_demand_member'\\) failed"):
        client.infer("ens_on_demand", ints(httpclient, A=a))
    client.load_model("ens_on_demand_member")
    wait_until(lambda: client.is_model_ready("ens_on_demand"), "the ensemble to be ready with its member back")
    client.unload_model("ens_on_demand", unload_dependents=True)
    assert not client.is_model_ready("ens_on_demand")
    assert not client.is_model_ready("ens_on_demand_member")
    assert client.is_model_ready("simple")  # a member of other ensembles is not a dependent here


def test_an_ensemble_batching_its_requests_answers_each_with_its_own_rows(proto, server):
    """max_queue_delay_microseconds: concurrent requests run the steps together (fewer
    executions than requests), each answered with its own rows."""
    module, client = proto
    before = stats(client, module, "ens_chain_batched")
    pairs = [pair(400 + i) for i in range(24)]

    results = infer_concurrently(module, server, "ens_chain_batched", pairs, ("TWICE_A", "TWICE_B"), threads=8)
    for (a, b), (twice_a, twice_b) in zip(pairs, results):
        np.testing.assert_array_equal(twice_a, 2 * a)
        np.testing.assert_array_equal(twice_b, 2 * b)
    after = wait_until(lambda: (s := stats(client, module, "ens_chain_batched")) and
                       int(s["inference_count"]) - int(before.get("inference_count", 0)) == 24 and s,
                       "the ensemble's statistics to count the 24 requests")
    assert int(after["execution_count"]) - int(before.get("execution_count", 0)) < 24


def in_place_call(module, client, a: np.ndarray, b: np.ndarray):
    return client.infer("ens_in_place", ints(module, A=a, B=b))


def run_in_place_concurrently(proto, server, ensemble: str, seed: int) -> None:
    """24 requests to ``ensemble`` from 8 threads: each gets SUM2 = 2 * (A + B), all computed by
    one process, not one of ens_pid_double's own replicas."""
    module, client = proto
    direct_pid = int(client.infer("ens_pid_double", ints(module, INPUT=pair(seed)[0])).as_numpy("PID")[0, 0])
    pairs = [pair(seed + 1 + i) for i in range(24)]
    results = infer_concurrently(module, server, ensemble, pairs, ("SUM2", "PID"), threads=8)
    for (a, b), (sum2, _) in zip(pairs, results):
        np.testing.assert_array_equal(sum2, 2 * (a + b))
    pids = {int(pid[0, 0]) for _, pid in results}
    assert len(pids) == 1 and direct_pid not in pids


def test_steps_in_place_run_in_the_ensembles_process_and_count_as_the_members(proto, server):
    """steps_in_place: ens_pid_double runs in the ensemble's replica (not in a process of the
    member's own replicas), answers as its replicas do, and its executions there count in the
    member's statistics, batched by the member's own batcher."""
    module, client = proto
    before = stats(client, module, "ens_pid_double")
    run_in_place_concurrently(proto, server, "ens_in_place", 500)
    # At least 24: the ensemble's replica reports its in-place figures every 0.5 s, so ``before``
    # may still lack the last steps of the test before this one.
    after = wait_until(lambda: (s := stats(client, module, "ens_pid_double")) and
                       int(s["inference_count"]) - int(before.get("inference_count", 0)) >= 24 and s,
                       "the member's statistics to count the 24 steps run in place")
    inferences = int(after["inference_count"]) - int(before.get("inference_count", 0))
    assert int(after["execution_count"]) - int(before.get("execution_count", 0)) < inferences


def test_a_batched_ensembles_steps_in_place_run_its_batches(proto, server):
    """steps_in_place with the ensemble's own batching: each batch of ensemble requests runs its
    steps once, in the ensemble's replica, and every request gets its own rows back."""
    module, client = proto
    before = stats(client, module, "ens_in_place_batched")
    run_in_place_concurrently(proto, server, "ens_in_place_batched", 540)
    after = stats(client, module, "ens_in_place_batched")
    assert int(after["inference_count"]) - int(before.get("inference_count", 0)) == 24
    assert int(after["execution_count"]) - int(before.get("execution_count", 0)) < 24


def test_a_step_in_place_that_fails_names_the_step(proto):
    """The member's error, as a step sent to its replicas reports it; the ensemble serves on."""
    module, client = proto
    a, b = pair(530)
    with pytest.raises(InferenceServerException,
                       match=r"in ensemble 'ens_in_place', step 1 \(model 'ens_pid_double'\) failed: unlucky input -13"):
        in_place_call(module, client, np.full((1, 16), -13, np.int32), np.zeros((1, 16), np.int32))
    np.testing.assert_array_equal(in_place_call(module, client, a, b).as_numpy("SUM2"), 2 * (a + b))


def test_steps_in_place_follow_their_member_unloaded_and_loaded_again(server):
    """With the member unloaded, the step fails as a remote step would (no stale instance
    answers); loaded again, the ensemble runs a new instance of it in place."""
    client = httpclient.InferenceServerClient(server["url"], network_timeout=LOAD_TIMEOUT_S)
    a, b = pair(540)
    in_place_pid = int(in_place_call(httpclient, client, a, b).as_numpy("PID")[0, 0])
    client.unload_model("ens_pid_double")
    try:
        def refused() -> bool:
            try:
                in_place_call(httpclient, client, a, b)
            except InferenceServerException as exc:
                assert "step 1 (model 'ens_pid_double') failed" in str(exc)
                return True
            return False

        wait_until(refused, "the ensemble's step to fail without its member")
    finally:
        client.load_model("ens_pid_double")
    direct_pid = int(client.infer("ens_pid_double", ints(httpclient, INPUT=a)).as_numpy("PID")[0, 0])
    result = wait_until(lambda: (r := in_place_call(httpclient, client, a, b)) and
                        int(r.as_numpy("PID")[0, 0]) == in_place_pid and r,
                        "the step to run in place again")
    assert direct_pid != in_place_pid
    np.testing.assert_array_equal(result.as_numpy("SUM2"), 2 * (a + b))


@pytest.mark.parametrize("ensemble", ["ens_chain", "ens_in_place"])
def test_an_ensembles_steps_are_traced_as_its_children(proto, server, ensemble):
    """One traced request to an ensemble of two steps (``ens_chain``: to the members' replicas;
    ``ens_in_place``: run in the ensemble's replica): Triton's child traces, one per step, the
    member's name and timestamps and the ensemble's trace id as ``parent_id``; the steps follow
    the ensemble's settings and do not spend the members' counts."""
    module, client = proto
    before = trace_files(server["trace_file"])
    client.update_trace_settings(model_name=ensemble, settings={
        "trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "1", "log_frequency": "1"})
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [module.InferInput(name, [1, 16], "INT32") for name in ("A", "B")]
    for tensor in inputs:
        tensor.set_data_from_numpy(a)
    try:
        client.infer(ensemble, inputs)
        new = wait_until(lambda: len(files := trace_files(server["trace_file"]) - before) >= 3 and files,
                         "three trace files", timeout_s=30, interval_s=0.3)
        assert trace_settings(module, client, ensemble)["trace_count"] == "0"
        assert trace_settings(module, client, "simple")["trace_count"] == "-1"
    finally:
        client.update_trace_settings(model_name=ensemble, settings={
            "trace_level": None, "trace_rate": None, "trace_count": None, "log_frequency": None})
    traces = traces_by_id(new)
    heads = {trace_id: entries[0] for trace_id, entries in traces.items()}
    (parent_id,) = [i for i, head in heads.items() if head["model_name"] == ensemble]
    assert heads[parent_id]["parent_id"] == 0
    steps = sorted((head["model_name"], head["parent_id"]) for i, head in heads.items() if i != parent_id)
    members = ["simple", "simple"] if ensemble == "ens_chain" else ["ens_pid_double", "simple"]
    assert steps == [(member, parent_id) for member in members]
    for trace_id, entries in traces.items():
        stamps = [s for e in entries for s in e.get("timestamps", [])]
        names = [s["name"] for s in stamps]
        if trace_id == parent_id:
            assert names[0] in ("HTTP_RECV_START", "GRPC_WAITREAD_START") and "REQUEST_END" in names
        else:  # a step: no protocol of its own
            assert names == ORDER
        assert all(a["ns"] <= b["ns"] for a, b in zip(stamps, stamps[1:]))
