"""Explicit model control on the real test server: load and unload over the repository API."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import add_sub_inputs, http, http_json
from model_factory import ON_DEMAND


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server["url"], network_timeout=300.0)
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
    assert index_row(ON_DEMAND)["state"] == "UNAVAILABLE"
    assert index_row(ON_DEMAND)["reason"] == "unloaded"
    assert not client.is_model_ready(ON_DEMAND)
    with pytest.raises(InferenceServerException, match=f"Request for unknown model: '{ON_DEMAND}'"):
        add_sub(client, ON_DEMAND)


def test_load_serves_the_model_and_unload_removes_it(client):
    client.load_model(ON_DEMAND)  # answers when the model is ready, as Triton does
    assert client.is_model_ready(ON_DEMAND)
    assert index_row(ON_DEMAND)["state"] == "READY"
    np.testing.assert_array_equal(add_sub(client, ON_DEMAND), np.arange(16).reshape(1, 16) * 2)

    client.unload_model(ON_DEMAND)
    deadline = time.monotonic() + 60
    while client.is_model_ready(ON_DEMAND) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not client.is_model_ready(ON_DEMAND)
    while index_row(ON_DEMAND)["state"] != "UNAVAILABLE" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert index_row(ON_DEMAND) == {"name": ON_DEMAND, "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
    # The other models were not touched.
    np.testing.assert_array_equal(add_sub(client, "batched"), np.arange(16).reshape(1, 16) * 2)


def test_load_errors_name_the_model():
    status, doc = http_json("POST", "/v2/repository/models/nope/load")
    assert (status, doc) == (500, {"error": "failed to load 'nope', failed to poll from model repository"})
    status, doc = http_json("POST", "/v2/repository/models/broken_config/load")
    assert status == 400
    assert doc["error"].startswith("failed to load 'broken_config': ") and "config.pbtxt" in doc["error"]
    status, doc = http_json("POST", "/v2/repository/models/simple/load", b"{not json")
    assert status == 400 and "failed to parse the repository JSON" in doc["error"]


def test_unloading_an_unknown_model_is_not_an_error():
    assert http("POST", "/v2/repository/models/nope/unload")[0] == 200


def grpc_add_sub(c, model: str) -> np.ndarray:
    import tritonclient.grpc as grpcclient

    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    return c.infer(model, inputs).as_numpy("OUTPUT0")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_reloading_a_changed_model_under_traffic_fails_no_request(server, client, model_repository, protocol):
    """The old version serves until the new one is ready; a reload never drops a request."""
    import concurrent.futures
    import threading

    import tritonclient.grpc as grpcclient

    client.load_model(ON_DEMAND)
    config = model_repository / ON_DEMAND / "config.pbtxt"
    original = config.read_text()
    stop = threading.Event()
    results = {"ok": 0, "errors": []}

    def worker() -> None:
        if protocol == "http":
            c, infer = httpclient.InferenceServerClient(server["url"], network_timeout=60.0), add_sub
        else:
            c, infer = grpcclient.InferenceServerClient(server["grpc_url"]), grpc_add_sub
        try:
            while not stop.is_set():
                try:
                    np.testing.assert_array_equal(infer(c, ON_DEMAND), np.arange(16).reshape(1, 16) * 2)
                    results["ok"] += 1
                except Exception as exc:  # every failure is a finding
                    results["errors"].append(repr(exc))
        finally:
            c.close()

    try:
        config.write_text(original + "dynamic_batching { max_queue_delay_microseconds: 100 }\n")
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            try:
                futures = [pool.submit(worker) for _ in range(4)]
                time.sleep(1.0)
                before = results["ok"]
                # geventhttpclient's clients must stay on the thread that made them.
                reload = pool.submit(lambda: httpclient.InferenceServerClient(server["url"]).load_model(ON_DEMAND))
                states = set()
                while not reload.done():  # the serving version stays READY while the new one starts
                    states.add(index_row(ON_DEMAND)["state"])
                    time.sleep(0.2)
                reload.result()
                assert states <= {"READY"}
                assert client.get_model_config(ON_DEMAND)["dynamic_batching"]["max_queue_delay_microseconds"] == 100
                time.sleep(3.0)  # past the old replica's draining period
            finally:  # the workers stop even when an assertion above fails
                stop.set()
            for f in futures:
                f.result()
        assert results["errors"] == []
        assert results["ok"] > before > 0
    finally:
        stop.set()
        config.write_text(original)
        client.unload_model(ON_DEMAND)


def test_load_with_a_config_override(client):
    import json

    config = {
        "name": ON_DEMAND, "platform": "onnxruntime_onnx", "max_batch_size": 4,
        "input": [{"name": n, "data_type": "TYPE_INT32", "dims": [16]} for n in ("INPUT0", "INPUT1")],
        "output": [{"name": n, "data_type": "TYPE_INT32", "dims": [16]} for n in ("OUTPUT0", "OUTPUT1")],
        "dynamic_batching": {"max_queue_delay_microseconds": 50},
    }
    try:
        client.load_model(ON_DEMAND, config=json.dumps(config))
        served = client.get_model_config(ON_DEMAND)
        assert served["max_batch_size"] == 4
        assert served["dynamic_batching"]["max_queue_delay_microseconds"] == 50
        np.testing.assert_array_equal(add_sub(client, ON_DEMAND), np.arange(16).reshape(1, 16) * 2)
        client.load_model(ON_DEMAND)  # without an override: config.pbtxt again
        assert client.get_model_config(ON_DEMAND)["max_batch_size"] == 8
    finally:
        client.unload_model(ON_DEMAND)


def test_bad_load_parameters_are_rejected_with_the_reason():
    status, doc = http_json("POST", f"/v2/repository/models/{ON_DEMAND}/load", {"parameters": {"config": "{oops"}})
    assert status == 400 and "failed to parse the configuration override" in doc["error"]
    status, doc = http_json(
        "POST", f"/v2/repository/models/{ON_DEMAND}/load", {"parameters": {"file:1/model.onnx": "AAAA"}}
    )
    assert status == 400 and "'file:' parameters need the 'config' parameter" in doc["error"]
    assert index_row(ON_DEMAND)["state"] in ("UNAVAILABLE", "UNLOADING")


@pytest.mark.parametrize("path", ["../../escaped.onnx", "/tmp/escaped.onnx", "1/../../escaped.onnx", "A" * 256])
def test_file_parameters_never_write_outside_the_model_directory(path, tmp_path):
    import tempfile

    before = set(Path(tempfile.gettempdir()).iterdir())
    status, doc = http_json("POST", f"/v2/repository/models/{ON_DEMAND}/load",
                            {"parameters": {"config": "{}", f"file:{path}": "AAAA"}})
    assert status == 400 and f"Invalid file path 'file:{path}'" in doc["error"]
    after = set(Path(tempfile.gettempdir()).iterdir())
    assert not [p for p in after - before if "escaped" in p.name]
    assert index_row(ON_DEMAND)["state"] == "UNAVAILABLE"


def test_load_with_model_files_in_the_request(client, model_repository):
    import base64
    import json

    model = (model_repository / ON_DEMAND / "1" / "model.onnx").read_bytes()
    config = {"backend": "onnxruntime", "max_batch_size": 2}  # inputs and outputs auto-completed
    try:
        status, doc = http_json("POST", f"/v2/repository/models/{ON_DEMAND}/load", {"parameters": {
            "config": json.dumps(config), "file:1/model.onnx": base64.b64encode(model).decode()}})
        assert (status, doc) == (200, None)
        assert client.get_model_config(ON_DEMAND)["max_batch_size"] == 2
        np.testing.assert_array_equal(add_sub(client, ON_DEMAND), np.arange(16).reshape(1, 16) * 2)
        assert index_row(ON_DEMAND)["state"] == "READY"
    finally:
        client.unload_model(ON_DEMAND)
    assert not client.is_model_ready(ON_DEMAND)  # unload answers once the model is gone
