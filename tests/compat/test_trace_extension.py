"""Triton's trace extension through unmodified tritonclient, over HTTP and gRPC: the settings as
Triton reports them (the session server starts with ``--trace-config triton,file=...``), a
model's own settings over the server's, Triton's errors, and trace files with Triton's
timestamps (and tensors) for the requests the rate samples."""

from __future__ import annotations

import queue
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from trace_files import ORDER, trace_files, trace_settings, traces_by_id
from waiting import wait_until

def _update(module: Any, client: Any, settings: dict[str, Any], model: str | None = None) -> None:
    client.update_trace_settings(model_name=model, settings=settings)


def _infer(module: Any, client: Any, times: int) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
    for tensor in inputs:
        tensor.set_data_from_numpy(a)
    for _ in range(times):
        client.infer("simple", inputs)


def test_the_server_settings_come_from_the_command_line(proto: tuple[Any, Any], server: dict) -> None:
    module, client = proto
    assert trace_settings(module, client) == {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
                                         "log_frequency": "0", "trace_file": str(server["trace_file"]),
                                         "trace_mode": "triton"}
    metadata = client.get_server_metadata()
    extensions = metadata["extensions"] if isinstance(metadata, dict) else list(metadata.extensions)
    assert "trace" in extensions


def test_a_models_settings_trace_its_requests_to_files(proto: tuple[Any, Any], server: dict) -> None:
    module, client = proto
    before = trace_files(server["trace_file"])
    _update(module, client, {"trace_level": ["TIMESTAMPS", "TENSORS"], "trace_rate": "2", "log_frequency": "1"},
            "simple")
    try:
        assert trace_settings(module, client, "simple")["trace_level"] == ["TIMESTAMPS", "TENSORS"]
        assert trace_settings(module, client)["trace_level"] == ["OFF"]  # the server's stay
        _infer(module, client, 4)  # every second request: two traces, one file each
        new = wait_until(lambda: len(trace_files(server["trace_file"]) - before) >= 2 and trace_files(server["trace_file"]) - before,
                         "two trace files", timeout_s=30, interval_s=0.3)
    finally:
        _update(module, client, {"trace_level": None, "trace_rate": None, "log_frequency": None}, "simple")
    assert trace_settings(module, client, "simple") == trace_settings(module, client)
    traces = traces_by_id(new)
    assert len(traces) == 2
    for entries in traces.values():
        assert entries[0]["model_name"] == "simple" and entries[0]["model_version"] == 1
        stamps = [s for e in entries for s in e.get("timestamps", [])]
        # The protocol's stamps too: the front relayed the request to a replica's listener.
        received, sent = (("GRPC_WAITREAD_START", "GRPC_WAITREAD_END"), ("GRPC_SEND_START", "GRPC_SEND_END")) \
            if module is grpcclient else (("HTTP_RECV_START", "HTTP_RECV_END"), ("HTTP_SEND_START", "HTTP_SEND_END"))
        assert [s["name"] for s in stamps] == [*received, *ORDER, *sent]
        assert all(a["ns"] <= b["ns"] for a, b in zip(stamps, stamps[1:]))
        tensors = {(e["activity"], e["tensor"]["name"]) for e in entries if "tensor" in e}
        assert {("TENSOR_QUEUE_INPUT", "INPUT0"), ("TENSOR_BACKEND_OUTPUT", "OUTPUT0")} <= tensors
        output = next(e["tensor"] for e in entries if e.get("activity") == "TENSOR_BACKEND_OUTPUT"
                      and e["tensor"]["name"] == "OUTPUT0")
        assert output["shape"] == "1,16" and output["dtype"] == "INT32"
        assert output["data"].split(",")[:3] == ["0", "2", "4"]


def test_the_count_stops_tracing(proto: tuple[Any, Any], server: dict) -> None:
    module, client = proto
    before = trace_files(server["trace_file"])
    _update(module, client, {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "1",
                             "log_frequency": "1"}, "simple")
    try:
        _infer(module, client, 3)
        wait_until(lambda: trace_settings(module, client, "simple")["trace_count"] == "0", "the count to reach 0",
                   timeout_s=30, interval_s=0.3)
        assert len(traces_by_id(trace_files(server["trace_file"]) - before)) == 1
    finally:
        _update(module, client, {"trace_level": None, "trace_rate": None, "trace_count": None, "log_frequency": None},
                "simple")


def test_a_decoupled_models_request_is_traced_to_its_final_response(server: dict) -> None:
    """``py_repeat`` (decoupled) on a gRPC stream: one trace for the request, Triton's timestamps
    in order up to the final response, and at the TENSORS level each response's output."""
    client = grpcclient.InferenceServerClient(server["grpc_url"])
    before = trace_files(server["trace_file"])
    _update(grpcclient, client, {"trace_level": ["TIMESTAMPS", "TENSORS"], "trace_rate": "1", "log_frequency": "1"},
            "py_repeat")
    answers: queue.Queue = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: answers.put(error or result))
        inp = grpcclient.InferInput("IN", [3], "INT32")
        inp.set_data_from_numpy(np.array([4, 5, 6], np.int32))
        client.async_stream_infer("py_repeat", [inp])
        outs = [answers.get(timeout=30) for _ in range(3)]
        client.stop_stream()
        new = wait_until(lambda: trace_files(server["trace_file"]) - before, "a trace file", timeout_s=30, interval_s=0.3)
    finally:
        _update(grpcclient, client, {"trace_level": None, "trace_rate": None, "log_frequency": None}, "py_repeat")
        client.close()
    assert [int(o.as_numpy("OUT")[0]) for o in outs] == [4, 5, 6]
    traces = traces_by_id(new)
    assert len(traces) == 1
    entries = next(iter(traces.values()))
    assert entries[0]["model_name"] == "py_repeat"
    stamps = [s for e in entries for s in e.get("timestamps", [])]
    names = [s["name"] for s in stamps]
    # When the /v2 replica, which reads the stream and writes its responses, began and ended
    # reading the request, and began and ended writing each response (as they came: the first
    # may leave before the execution has returned).
    assert [n for n in names if not n.startswith("GRPC_SEND")] == ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", *ORDER]
    assert [n for n in names if n.startswith("GRPC_SEND")] == ["GRPC_SEND_START", "GRPC_SEND_END"] * 3
    assert names.index("GRPC_SEND_START") > names.index("COMPUTE_START")
    assert all(a["ns"] <= b["ns"] for a, b in zip(stamps, stamps[1:]))
    outputs = [e["tensor"]["data"] for e in entries if e.get("activity") == "TENSOR_BACKEND_OUTPUT"
               and e["tensor"]["name"] == "OUT"]
    assert outputs == ["4", "5", "6"]


def test_a_stream_request_is_traced_from_its_read_to_its_responses_write(server: dict) -> None:
    """``simple`` on a gRPC stream: the /v2 replica reads the request and writes its response;
    its trace has Triton's stream stamps, GRPC_WAITREAD_START / _END first and GRPC_SEND_START
    / _END last, on one clock with the model's."""
    client = grpcclient.InferenceServerClient(server["grpc_url"])
    before = trace_files(server["trace_file"])
    _update(grpcclient, client, {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "1",
                                 "log_frequency": "1"}, "simple")
    answers: queue.Queue = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: answers.put(error or result))
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
        for tensor in inputs:
            tensor.set_data_from_numpy(a)
        client.async_stream_infer("simple", inputs)
        answer = answers.get(timeout=30)
        client.stop_stream()
        new = wait_until(lambda: trace_files(server["trace_file"]) - before, "a trace file", timeout_s=30, interval_s=0.3)
    finally:
        _update(grpcclient, client, {"trace_level": None, "trace_rate": None, "trace_count": None,
                                     "log_frequency": None}, "simple")
        client.close()
    assert not isinstance(answer, Exception), answer
    traces = traces_by_id(new)
    assert len(traces) == 1
    stamps = [s for e in next(iter(traces.values())) for s in e.get("timestamps", [])]
    assert [s["name"] for s in stamps] == ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", *ORDER, "GRPC_SEND_START",
                                           "GRPC_SEND_END"]
    assert all(a["ns"] <= b["ns"] for a, b in zip(stamps, stamps[1:]))


def test_a_bls_request_given_its_requests_trace_is_traced_as_its_child(proto: tuple[Any, Any], server: dict) -> None:
    """``py_bls`` passes ``trace=request.trace()`` to its BLS request, as Triton's BLS tracing
    does: one traced request gives its own trace and its call's to ``nobatch``, a child."""
    module, client = proto
    before = trace_files(server["trace_file"])
    _update(module, client, {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "1",
                             "log_frequency": "1"}, "py_bls")
    inputs = [module.InferInput("INPUT0", [16], "INT32"), module.InferInput("INPUT1", [16], "INT32"),
              module.InferInput("MODEL_NAME", [1], "BYTES")]
    for tensor in inputs[:2]:
        tensor.set_data_from_numpy(np.arange(16, dtype=np.int32))
    inputs[2].set_data_from_numpy(np.array([b"nobatch"], dtype=object))
    try:
        client.infer("py_bls", inputs)
        new = wait_until(lambda: len(trace_files(server["trace_file"]) - before) >= 2 and trace_files(server["trace_file"]) - before,
                         "two trace files", timeout_s=30, interval_s=0.3)
    finally:
        _update(module, client, {"trace_level": None, "trace_rate": None, "trace_count": None, "log_frequency": None},
                "py_bls")
    heads = {trace_id: entries[0] for trace_id, entries in traces_by_id(new).items()}
    (parent_id,) = [i for i, head in heads.items() if head["model_name"] == "py_bls"]
    assert sorted((h["model_name"], h["parent_id"]) for h in heads.values()) == [("nobatch", parent_id), ("py_bls", 0)]


def test_wrong_settings_get_tritons_errors(proto: tuple[Any, Any]) -> None:
    module, client = proto
    for settings, model, message in (
        ({"trace_file": "/tmp/elsewhere.json"}, None, "trace file location can not be updated through network protocol"),
        ({"trace_level": ["OFF", "TIMESTAMPS"]}, None, "Expect only one trace level 'OFF' is specified"),
        ({"trace_rate": "often"}, None, "Unable to parse 'trace_rate', got: often"),
        ({"trace_count": "-2"}, None, "Unable to parse 'trace_count'. Expecting value >= -1, got:-2"),
        ({"trace_rate": "1"}, "no_such_model", "Request for unknown model : no_such_model"),
    ):
        with pytest.raises(InferenceServerException) as caught:
            _update(module, client, settings, model)
        assert message in str(caught.value)
    assert trace_settings(module, client)["trace_rate"] == "1000"
