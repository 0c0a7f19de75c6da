"""The trace extension without a server: --trace-config, Triton's checks of updates, a model's
settings over the server's, sampling by rate and count, and the trace files' form."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto
from tritonclient.grpc import service_pb2 as pb

from rayinfer.adapters.loader import load_runner
from rayinfer.cluster.example_repository import add_sub_model, write_model
from rayinfer.protocol.errors import ServingError
from rayinfer.protocol.types import InferRequest
from rayinfer.serving.model_core import ModelCore
from rayinfer.serving.model_grpc import stream_serialized
from rayinfer.serving.protocol_stamps import StreamTrace, wall_clock_offset_ns
from rayinfer.serving.trace import TraceSettings, Tracer, parse_update, settings_from_flags
from rayinfer.serving.trace_writer import TraceWriter


def test_flags_give_the_server_settings() -> None:
    settings = settings_from_flags(["triton,file=/tmp/t.json", "triton,log-frequency=5", "rate=10",
                                    "level=TENSORS", "level=TIMESTAMPS", "count=3"])
    assert settings == {"trace_level": ["TIMESTAMPS", "TENSORS"], "trace_rate": "10", "trace_count": "3",
                        "log_frequency": "5", "trace_file": "/tmp/t.json", "trace_mode": "triton"}
    for wrong in (["zipkin,url=x"], ["level=LOUD"], ["rate=x"], ["count=-5"], ["colour=red"]):
        with pytest.raises(ValueError):
            settings_from_flags(wrong)


def test_updates_are_checked_and_a_model_overrides_setting_by_setting() -> None:
    settings = TraceSettings(settings_from_flags(["triton,file=/t"]))
    settings.update("m", parse_update({"trace_rate": "1", "trace_level": ["TIMESTAMPS"]}))
    settings.update("", parse_update({"trace_count": "7"}))
    assert settings.of("m")["trace_rate"] == "1" and settings.of("m")["trace_count"] == "7"
    assert settings.of("")["trace_rate"] == "1000"
    settings.update("m", parse_update({"trace_rate": None}))
    assert settings.of("m")["trace_rate"] == "1000"
    settings.update("", parse_update({"trace_count": None}))
    assert settings.of("")["trace_count"] == "-1"
    assert TraceSettings.from_dict(json.loads(json.dumps(settings.as_dict()))).of("m") == settings.of("m")
    for update, message in (({"trace_file": "x"}, "trace file location can not be updated through network protocol"),
                            ({"trace_level": ["OFF", "TENSORS"]}, "Expect only one trace level 'OFF' is specified"),
                            ({"log_frequency": "-1"}, "Unable to parse 'log_frequency', value is out of range"),
                            ({"trace_rate": 5}, "attempt to access JSON non-string as string")):
        with pytest.raises(ServingError, match=message):
            parse_update(update)


def test_the_tracer_samples_every_rate_th_request_until_the_count_is_spent() -> None:
    tracer = Tracer("m", "1")
    assert not tracer.active
    tracer.configure({"trace_level": ["TIMESTAMPS"], "trace_rate": "3", "trace_count": "2"})
    sampled = [tracer.sample() is not None for _ in range(12)]
    assert sampled == [False, False, True, False, False, True] + [False] * 6
    assert not tracer.active
    tracer.configure({"trace_level": ["TIMESTAMPS"], "trace_rate": "3", "trace_count": "2"})  # version 0 again
    assert not tracer.active  # a replica registering anew does not get its spent count back
    tracer.configure({"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "1"}, version=1)
    assert tracer.sample() is not None and tracer.sample() is None
    tracer.configure({"trace_level": ["TIMESTAMPS"], "trace_rate": "0", "trace_count": "-1"}, version=2)
    assert all(tracer.sample() is None for _ in range(5))  # rate 0: none (as in Triton)


def test_a_spent_count_is_a_new_version_for_the_replicas() -> None:
    settings = TraceSettings(settings_from_flags([]))
    settings.update("m", parse_update({"trace_count": "3", "bogus": None}))  # unknown keys are ignored
    version = settings.version
    assert not settings.spend("m", 2) and settings.version == version
    assert settings.spend("m", 2) and settings.version == version + 1
    assert settings.of("m")["trace_count"] == "0" and not settings.spend("m", 1)


def test_the_writer_numbers_traces_and_writes_tritons_files(tmp_path: Path) -> None:
    tracer = Tracer("m", "2")
    tracer.configure({"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "-1"})
    settings = {"trace_file": str(tmp_path / "t.json"), "log_frequency": "2"}
    request = InferRequest("m", "2", "r1")
    for start in (10, 20, 30):
        trace = tracer.sample()
        assert trace is not None
        trace.stamps += [("REQUEST_END", start + 5), ("REQUEST_START", start)]
        tracer.finish(request, trace)
    writer = TraceWriter()
    writer.add(tracer.collect(), settings)
    first = json.loads((tmp_path / "t.json.0").read_text())
    assert first[0] == {"id": 1, "model_name": "m", "model_version": 2, "request_id": "r1", "parent_id": 0}
    assert first[1] == {"id": 1, "timestamps": [{"name": "REQUEST_START", "ns": 10}, {"name": "REQUEST_END", "ns": 15}]}
    assert {e["id"] for e in first} == {1, 2}
    writer.close()  # the third trace, at the end: the next numbered file
    assert [e["id"] for e in json.loads((tmp_path / "t.json.1").read_text())] == [3, 3]
    once = TraceWriter()
    once.add(Tracer("m", "2").collect() or [{"model_name": "m", "model_version": 2, "request_id": "",
                                             "timestamps": [("REQUEST_START", 1)], "tensors": []}],
             {**settings, "log_frequency": "0"})
    once.close()  # log_frequency 0: every trace to the file itself when the server stops
    assert [e["id"] for e in json.loads((tmp_path / "t.json").read_text())] == [1, 1]


def test_a_traced_requests_steps_are_traced_as_its_children(tmp_path: Path) -> None:
    """An ensemble's trace link makes a member trace its step whatever the member's own settings
    (off here), at the ensemble's levels; the writer gives the step's trace the ensemble's id as
    parent_id, whichever of the two arrives first."""
    ensemble, member = Tracer("ens", "1"), Tracer("member", "1")
    ensemble.configure({"trace_level": ["TIMESTAMPS", "TENSORS"], "trace_rate": "1", "trace_count": "-1"})
    parents = [ensemble.sample(), ensemble.sample()]
    assert all(parents) and parents[0].token != parents[1].token
    children = [member.child(parent.link) for parent in parents]
    assert not member.active and all(c is not None and c.traces_tensors for c in children)
    assert [c.parent for c in children] == [p.token for p in parents]
    assert {c.owner for c in children} == {"ens"}  # the ensemble's settings: its file and log frequency
    assert member.child(children[0].link).owner == "ens"  # a nested ensemble's steps too
    assert member.child("junk") is None and member.child("token;LOUD;ens") is None
    for trace in (*parents, *children):
        trace.stamps.append(("REQUEST_START", 1))
    request = InferRequest("x", "1")
    for tracer, trace in ((member, children[0]), (ensemble, parents[0]), (ensemble, parents[1]), (member, children[1])):
        tracer.finish(request, trace)
    writer = TraceWriter()
    settings = {"trace_file": str(tmp_path / "t.json"), "log_frequency": "0"}
    steps = member.collect()
    writer.add(steps[:1], settings)  # the first step's trace before its ensemble's
    writer.add(ensemble.collect(), settings)
    writer.add(steps[1:], settings)  # the second step's after
    writer.close()
    heads = {e["id"]: (e["model_name"], e["parent_id"]) for e in json.loads((tmp_path / "t.json").read_text())
             if "model_name" in e}
    assert heads == {1: ("ens", 0), 2: ("member", 1), 3: ("ens", 0), 4: ("member", 3)}


def test_protocol_stamps_name_the_protocol_and_may_have_no_send():
    from rayinfer.serving.protocol_stamps import ProtocolStamps

    http = ProtocolStamps("m", False, 10, 20)
    assert http.received == [("HTTP_RECV_START", 10), ("HTTP_RECV_END", 20)]
    assert http.send_stamps(30, 40) == [("HTTP_SEND_START", 30), ("HTTP_SEND_END", 40)]
    grpc = ProtocolStamps("m", True, 10, 20)
    assert [name for name, _ in grpc.received + grpc.send_stamps(30, 40)] == [
        "GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "GRPC_SEND_START", "GRPC_SEND_END"]
    assert grpc.send_stamps(0, 0) == []  # the client went away before the answer was written


STREAM_MODEL = """platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
"""


def _stream_request() -> bytes:
    request = pb.ModelInferRequest(model_name="m", id="s-1")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        request.raw_input_contents.append(np.arange(16, dtype=np.int32).tobytes())
    return request.SerializeToString()


def _stream_core(tmp_path: Path) -> ModelCore:
    write_model(tmp_path, "m", STREAM_MODEL, add_sub_model(TensorProto.INT32))
    runner, entry = load_runner(tmp_path, "m", 1)
    return ModelCore(runner, entry.versions)


def _answer(core: ModelCore) -> list:
    """What the model replica sends the /v2 replica for one stream request (read 2 and 1 µs ago,
    sent as wall-clock times)."""
    async def items() -> list:
        now = time.time_ns()
        return [item async for item in stream_serialized(core, _stream_request(), None, (now - 2000, now - 1000))]

    return asyncio.run(items())


def test_a_stream_requests_trace_takes_the_send_stamps_of_the_process_that_wrote_its_response(tmp_path: Path) -> None:
    """A real ONNX model's core answers a stream's request as the model replica does: its
    response, then the trace's token (the /v2 replica writes the response); the writer puts the
    /v2 replica's GRPC_SEND_START / _END into that trace whether they or the trace come first,
    and writes a trace whose response was never written (the client went away) at the end
    without them."""
    core = _stream_core(tmp_path)
    core.tracer.configure({"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "-1"}, version=1)

    answers = [_answer(core) for _ in range(3)]
    for answer in answers:
        assert len(answer) == 2 and isinstance(answer[0], bytes) and isinstance(answer[1], StreamTrace)
    traces = core.tracer.collect()
    assert [t["token"] for t in traces] == [a[1].token for a in answers] and all(t["awaits_send"] for t in traces)
    end = max(ns for t in traces for _, ns in t["timestamps"])
    settings = {"trace_file": str(tmp_path / "t.json"), "log_frequency": "0"}
    writer = TraceWriter()
    writer.sent(answers[0][1].token, [("GRPC_SEND_START", end + 1), ("GRPC_SEND_END", end + 2)])  # before its trace
    writer.add(traces, settings)
    writer.sent(answers[1][1].token, [("GRPC_SEND_START", end + 3), ("GRPC_SEND_END", end + 4)])  # after it
    writer.close()  # the third's response was never written: its trace without send stamps
    stamps = [[s["name"] for s in e["timestamps"]] for e in json.loads((tmp_path / "t.json").read_text())
              if "timestamps" in e]
    order = ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "REQUEST_START", "QUEUE_START", "COMPUTE_START",
             "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END", "REQUEST_END"]
    assert stamps == [order + ["GRPC_SEND_START", "GRPC_SEND_END"]] * 2 + [order]


def test_an_untraced_stream_request_names_no_trace(tmp_path: Path) -> None:
    core = _stream_core(tmp_path)

    answer = _answer(core)
    assert len(answer) == 1 and isinstance(answer[0], bytes) and core.tracer.collect() == []


def test_a_stream_traces_clock_offset_is_zero_on_one_node_and_taken_from_wall_clocks_across_nodes() -> None:
    """The /v2 replica's send stamps go onto the model replica's clock: one monotonic clock on a
    node; across nodes, through each process's wall clock less its trace clock."""
    trace = StreamTrace("t-1", 5_000_000, "node-a")  # model replica: wall = clock + 5 ms
    assert trace.clock_offset("node-a", 9_000_000) == 0
    # Reader: wall = clock + 8 ms, so the model replica's clock reads 3 ms more at one instant.
    assert trace.clock_offset("node-b", 8_000_000) == 3_000_000
    assert trace.clock_offset("node-b", 4_000_000) == -1_000_000
    # Read twice on one machine, the clocks' offset comes to (nearly) nothing.
    here = wall_clock_offset_ns()
    assert abs(StreamTrace("t-2", wall_clock_offset_ns(), "node-a").clock_offset("node-b", here)) < 1_000_000

def test_a_trace_file_appears_whole(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A reader polling the folder sees the file complete or not at all (the entries go to a
    hidden file that then takes the name); a folder it cannot write is logged, not raised."""
    from rayinfer.serving.trace_writer import _write

    path = tmp_path / "trace.json.1"
    _write(str(path), [{"id": 1, "model_name": "m"}])
    assert json.loads(path.read_text()) == [{"id": 1, "model_name": "m"}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json.1"]
    _write(str(tmp_path / "missing" / "trace.json.2"), [])
    assert "could not write the trace file" in caplog.text
