"""Explicit model control on the real test server: load and unload over the repository API."""

from __future__ import annotations

import concurrent.futures
import functools
import socket
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import LOAD_TIMEOUT_S, add_sub_inputs, front_folder, http, http_json, pids_titled, ray_actor_classes, read_map
from model_factory import on_demand
from waiting import wait_until


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server["url"], network_timeout=LOAD_TIMEOUT_S)
    yield c
    c.close()


def index_row(name: str) -> dict:
    status, rows = http_json("POST", "/v2/repository/index")
    assert status == 200
    (row,) = [r for r in rows if r["name"] == name]
    return row


def add_sub(client, model: str) -> np.ndarray:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    return client.infer(model, add_sub_inputs(a, a)).as_numpy("OUTPUT0")


def test_a_model_not_named_at_start_is_unloaded(client):
    model = on_demand("never_loaded")  # no test loads it
    assert index_row(model)["state"] == "UNAVAILABLE"
    assert index_row(model)["reason"] == "unloaded"
    assert not client.is_model_ready(model)
    with pytest.raises(InferenceServerException, match=f"Request for unknown model: '{model}'"):
        add_sub(client, model)


def call_until(stop, server, protocol: str, model: str, outcomes: list[str]) -> None:
    """Call the add/sub ``model`` over ``protocol`` until ``stop`` is set: "ok" or the failure
    for each call in ``outcomes``."""
    import tritonclient.grpc as grpcclient

    if protocol == "http":
        c, infer = httpclient.InferenceServerClient(server["url"], network_timeout=60.0), add_sub
    else:
        c, infer = grpcclient.InferenceServerClient(server["grpc_url"]), grpc_add_sub
    try:
        while not stop.is_set():
            try:
                np.testing.assert_array_equal(infer(c, model), np.arange(16).reshape(1, 16) * 2)
                outcomes.append("ok")
            except Exception as exc:  # every failure is a finding (tritonclient's repr has no message)
                outcomes.append(f"{type(exc).__name__}: {exc}")
    finally:
        c.close()


def test_loads_and_unloads_in_a_row_under_traffic(server, client):
    """A model loaded, served and unloaded twice while other models answer HTTP and gRPC calls
    throughout: no call to them fails or hangs, and each load and unload takes effect. The second
    load adds no actor class to Ray (the first one's is reused: Ray keeps every class it saw)."""
    import threading

    model = on_demand("load_unload")
    stop = threading.Event()
    calls: dict[str, list[str]] = {"http": [], "grpc": []}
    threads = [threading.Thread(target=call_until, args=(stop, server, p, "batched", calls[p])) for p in calls]
    for thread in threads:
        thread.start()
    classes = []
    try:
        for _ in range(2):
            try:
                client.load_model(model)  # answers when the model is ready, as Triton does
                assert pids_titled(f"ServeReplica:{model}:")  # replicas of its own (DEDICATED_ON_DEMAND)
                classes.append(ray_actor_classes(server))
                assert client.is_model_ready(model)
                assert index_row(model)["state"] == "READY"
                np.testing.assert_array_equal(add_sub(client, model), np.arange(16).reshape(1, 16) * 2)
            finally:
                client.unload_model(model)
            wait_until(lambda: not client.is_model_ready(model), f"'{model}' to be no longer ready", timeout_s=60)
            wait_until(lambda: index_row(model)["state"] == "UNAVAILABLE",
                       f"the index to show '{model}' UNAVAILABLE", timeout_s=60)
            assert index_row(model) == {"name": model, "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
            with pytest.raises(InferenceServerException, match=f"Request for unknown model: '{model}'"):
                add_sub(client, model)
    finally:  # the callers stop even when an assertion above fails
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not any(t.is_alive() for t in threads), "a call to a served model hung"
    for protocol, outcomes in calls.items():
        assert outcomes and set(outcomes) == {"ok"}, (protocol, [o for o in outcomes if o != "ok"][:3])
    assert classes[1] == classes[0], f"Ray's actor classes after each load: {classes}"


def test_load_errors_name_the_model(server):
    status, doc = http_json("POST", "/v2/repository/models/nope/load")
    assert (status, doc) == (500, {"error": "failed to load 'nope', failed to poll from model repository"})
    status, doc = http_json("POST", "/v2/repository/models/broken_config/load")
    assert status == 400
    assert doc["error"].startswith("failed to load 'broken_config': ") and "config.pbtxt" in doc["error"]
    status, doc = http_json("POST", "/v2/repository/models/simple/load", b"{not json")
    assert (status, doc["error"]) == (400, "failed to parse the request JSON buffer: Missing a name for object member. at 1")


def test_unloading_an_unknown_model_is_not_an_error(server):
    assert http("POST", "/v2/repository/models/nope/unload")[0] == 200


def grpc_add_sub(c, model: str) -> np.ndarray:
    import tritonclient.grpc as grpcclient

    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    return c.infer(model, inputs).as_numpy("OUTPUT0")


def front_listeners(server, model: str) -> set[str]:
    """``host|port`` of every listener the front routes ``model``'s calls to."""
    return {v for k, v in read_map(front_folder(server) / "listeners.map").items() if k.split("/")[0] == model}


def refuses_connections(listener: str) -> bool:
    host, port = listener.rsplit("|", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except OSError:
        return True
    return False


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_reloading_a_changed_model_under_traffic_fails_no_request(server, client, model_repository, protocol):
    """The old version serves until the new one is ready; a reload never drops a request."""
    import concurrent.futures
    import threading

    model = on_demand(f"reload_{protocol}")
    config = model_repository / model / "config.pbtxt"
    original = config.read_text()
    stop = threading.Event()
    outcomes: list[str] = []

    def reloaded(reload: concurrent.futures.Future, states: set[str]) -> bool:
        states.add(index_row(model)["state"])  # the serving version stays READY while the new one starts
        return reload.done()

    try:
        client.load_model(model)
        assert pids_titled(f"ServeReplica:{model}:")  # replicas of its own (DEDICATED_ON_DEMAND): Serve's redeploy
        old = wait_until(lambda: front_listeners(server, model), f"the front to route '{model}' to its replica",
                         timeout_s=30)
        config.write_text(original + "dynamic_batching { max_queue_delay_microseconds: 100 }\n")
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            try:
                futures = [pool.submit(call_until, stop, server, protocol, model, outcomes) for _ in range(4)]
                wait_until(lambda: outcomes.count("ok") >= 4 or set(outcomes) - {"ok"}, "the workers' first answers",
                           timeout_s=60)
                before = outcomes.count("ok")
                # geventhttpclient's clients must stay on the thread that made them.
                reload = pool.submit(lambda: httpclient.InferenceServerClient(
                    server["url"], network_timeout=LOAD_TIMEOUT_S).load_model(model))
                states: set[str] = set()
                wait_until(lambda: reloaded(reload, states), f"the reload of '{model}' to answer", timeout_s=240)
                reload.result()
                assert states <= {"READY"}
                assert client.get_model_config(model)["dynamic_batching"]["max_queue_delay_microseconds"] == 100
                # Traffic goes on until the old replica is out of the front's routes and its
                # listener no longer accepts connections (Serve is stopping it); calls still in
                # flight on it are answered before the workers are joined below.
                wait_until(lambda: not old & front_listeners(server, model) and all(map(refuses_connections, old)),
                           f"the old replica of '{model}' to leave the front's routes and close its listener {old}",
                           timeout_s=60)
            finally:  # the workers stop even when an assertion above fails
                stop.set()
            for f in futures:
                f.result()
        assert [o for o in outcomes if o != "ok"] == []
        assert outcomes.count("ok") > before > 0
    finally:
        stop.set()
        config.write_text(original)
        client.unload_model(model)


def test_a_replica_killed_under_traffic_fails_only_its_calls_at_once_and_is_replaced(server, client):
    """SIGKILL to one of two replicas while HTTP and gRPC clients call the model: the calls in
    flight on it (and those sent to it before its route goes) fail fast with the front's error,
    none hangs, the other replica serves on, Serve starts a new replica, and the server's log
    names the lost replica with Ray's record of its death."""
    import json
    import os
    import signal
    import threading

    model = on_demand("replica_loss")
    config = {
        "name": model, "platform": "onnxruntime_onnx", "max_batch_size": 8,
        "input": [{"name": n, "data_type": "TYPE_INT32", "dims": [16]} for n in ("INPUT0", "INPUT1")],
        "output": [{"name": n, "data_type": "TYPE_INT32", "dims": [16]} for n in ("OUTPUT0", "OUTPUT1")],
        "instance_group": [{"count": 2, "kind": "KIND_CPU"}],
    }
    def replicas() -> set[int]:
        return pids_titled(f"ServeReplica:{model}:")

    stop = threading.Event()
    calls: dict[str, list[str]] = {"http": [], "grpc": []}
    threads = [threading.Thread(target=call_until, args=(stop, server, p, model, calls[p])) for p in calls]
    try:
        client.load_model(model, config=json.dumps(config))
        first = replicas()
        assert len(first) == 2
        for thread in threads:
            thread.start()
        wait_until(lambda: all(c.count("ok") >= 20 for c in calls.values()), "calls answered by both replicas",
                   timeout_s=60)
        killed_at = {p: len(c) for p, c in calls.items()}
        os.kill(min(first), signal.SIGKILL)
        wait_until(lambda: all(c[killed_at[p]:].count("ok") >= 50 for p, c in calls.items()),
                   "the surviving replica to answer", timeout_s=30)
        wait_until(lambda: len(replicas()) == 2 and len(replicas() - first) == 1, "Serve to replace the killed replica",
                   timeout_s=60)
    finally:  # the callers stop even when an assertion above fails
        stop.set()
        for thread in threads:
            thread.join(60)
        client.unload_model(model)
    assert not any(t.is_alive() for t in threads), "a call hung"
    # The server's log says which replica was lost and why, as Ray recorded its death.
    lost = wait_until(lambda: [line for line in server["log"].read_text().splitlines()
                               if "was lost" in line and model in line], "the lost replica in the log", timeout_s=30)
    assert "died" in lost[0] or "exit" in lost[0].lower(), lost[0]
    for protocol, outcomes in calls.items():
        assert set(outcomes[:killed_at[protocol]]) == {"ok"}, protocol
        failed = [o for o in outcomes[killed_at[protocol]:] if o != "ok"]
        # The calls in flight on the killed replica, and the few sent to it before its route went.
        assert len(failed) <= 20, (protocol, failed[:3])
        assert all("503" in o or "502" in o or "UNAVAILABLE" in o or "closed" in o.lower() for o in failed), failed[:3]


def test_load_with_a_config_override(client):
    import json

    model = on_demand("override")
    config = {
        "name": model, "platform": "onnxruntime_onnx", "max_batch_size": 4,
        "input": [{"name": n, "data_type": "TYPE_INT32", "dims": [16]} for n in ("INPUT0", "INPUT1")],
        "output": [{"name": n, "data_type": "TYPE_INT32", "dims": [16]} for n in ("OUTPUT0", "OUTPUT1")],
        "dynamic_batching": {"max_queue_delay_microseconds": 50},
    }
    try:
        client.load_model(model, config=json.dumps(config))
        served = client.get_model_config(model)
        assert served["max_batch_size"] == 4
        assert served["dynamic_batching"]["max_queue_delay_microseconds"] == 50
        np.testing.assert_array_equal(add_sub(client, model), np.arange(16).reshape(1, 16) * 2)
        client.load_model(model)  # without an override: config.pbtxt again
        assert client.get_model_config(model)["max_batch_size"] == 8
    finally:
        client.unload_model(model)


def test_bad_load_parameters_are_rejected_with_the_reason(server):
    model = on_demand("bad_parameters")  # never loaded
    status, doc = http_json("POST", f"/v2/repository/models/{model}/load", {"parameters": {"config": "{oops"}})
    assert status == 400 and "failed to parse the configuration override" in doc["error"]
    status, doc = http_json(
        "POST", f"/v2/repository/models/{model}/load", {"parameters": {"file:1/model.onnx": "AAAA"}}
    )
    assert status == 400 and "'file:' parameters need the 'config' parameter" in doc["error"]
    assert index_row(model)["state"] == "UNAVAILABLE"


@pytest.mark.parametrize("path", ["../../escaped.onnx", "/tmp/escaped.onnx", "1/../../escaped.onnx", "A" * 256])
def test_file_parameters_never_write_outside_the_model_directory(server, path, tmp_path):
    import tempfile

    model = on_demand("bad_paths")  # never loaded
    before = set(Path(tempfile.gettempdir()).iterdir())
    status, doc = http_json("POST", f"/v2/repository/models/{model}/load",
                            {"parameters": {"config": "{}", f"file:{path}": "AAAA"}})
    assert status == 400 and f"Invalid file path 'file:{path}'" in doc["error"]
    after = set(Path(tempfile.gettempdir()).iterdir())
    assert not [p for p in after - before if "escaped" in p.name]
    assert index_row(model)["state"] == "UNAVAILABLE"


def test_load_with_model_files_in_the_request(client, model_repository):
    import base64
    import json

    name = on_demand("files")
    model = (model_repository / name / "1" / "model.onnx").read_bytes()
    config = {"backend": "onnxruntime", "max_batch_size": 2}  # inputs and outputs auto-completed
    try:
        status, doc = http_json("POST", f"/v2/repository/models/{name}/load", {"parameters": {
            "config": json.dumps(config), "file:1/model.onnx": base64.b64encode(model).decode()}})
        assert (status, doc) == (200, None)
        assert client.get_model_config(name)["max_batch_size"] == 2
        np.testing.assert_array_equal(add_sub(client, name), np.arange(16).reshape(1, 16) * 2)
        assert index_row(name)["state"] == "READY"
    finally:
        client.unload_model(name)
    assert not client.is_model_ready(name)  # unload answers once the model is gone


_ANSWER_SEVEN = b'''import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([7], np.int32))]) for r in requests]
'''


ODD_NAMES = ["a model#1", "mod\u00e8le", "twin@v2", "100%"]


@pytest.fixture(scope="module")
def odd_names(server):
    """A Python model under each of ODD_NAMES, loaded with its files in the request (all at
    once: the server runs loads of different models together), unloaded after the module."""
    config = '{"backend": "python", "output": [{"name": "OUT", "data_type": "TYPE_INT32", "dims": [1]}]}'

    def each(action: str, name: str) -> None:
        with httpclient.InferenceServerClient(server["url"], network_timeout=LOAD_TIMEOUT_S) as http:
            if action == "load":
                http.load_model(name, config=config, files={"file:1/model.py": _ANSWER_SEVEN})
            else:
                http.unload_model(name)

    with concurrent.futures.ThreadPoolExecutor(len(ODD_NAMES)) as pool:
        list(pool.map(functools.partial(each, "load"), ODD_NAMES))
        yield
        list(pool.map(functools.partial(each, "unload"), ODD_NAMES))


@pytest.mark.parametrize("name", ODD_NAMES)
def test_a_model_named_with_any_characters_triton_allows_loads_and_serves(server, client, odd_names, name):
    """Triton refuses only empty names, blank ones and '..' or '/'; Ray Serve's names take
    fewer characters, so rayinfer escapes the others there. Both protocols serve the model."""
    import tritonclient.grpc as grpcclient

    grpc = grpcclient.InferenceServerClient(server["grpc_url"])
    try:
        assert client.infer(name, []).as_numpy("OUT")[0] == 7
        assert grpc.infer(name, []).as_numpy("OUT")[0] == 7
        assert client.get_model_metadata(name)["name"] == name and index_row(name)["state"] == "READY"
        assert client.is_model_ready(name) and grpc.is_model_ready(name)
    finally:
        grpc.close()


@pytest.mark.parametrize("name, message", [
    ("bad..name", "invalid model name 'bad..name', model name must not contain path traversal characters"),
    ("%20", "model name must not contain only whitespace characters")])
def test_a_name_triton_refuses_gets_tritons_message(client, name, message):
    with pytest.raises(InferenceServerException) as caught:
        client.load_model(name.replace("%20", " "), config="{}", files={"file:1/model.py": _ANSWER_SEVEN})
    assert message in caught.value.message() and caught.value.status() == "400"
