"""The opentelemetry trace mode without a server: --trace-config's opentelemetry settings, and
a real ONNX model's traced requests exported over OTLP/HTTP to a real receiver on loopback
(Triton's three spans and their events, a client's trace context, a step's span under its
caller's, and the Python backend's view of the context)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto

from otlp_receiver import OtlpReceiver
from rayinfer.adapters.loader import load_runner
from rayinfer.adapters.python_backend import triton_python_backend_utils as pb_utils
from rayinfer.cluster.example_repository import add_sub_model, write_model
from rayinfer.protocol.types import InferInput, InferRequest
from rayinfer.serving import otel
from rayinfer.serving.model_core import ModelCore
from rayinfer.serving.protocol_stamps import PROTOCOL_STAMPS, ProtocolStamps
from rayinfer.serving.trace import TraceSettings, settings_from_flags
from waiting import wait_until

CONFIG = """platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
"""
CLIENT = "00-0af7651916cd43dd8448eb211c12666c-b7ad6b7169242424-01"


def test_flags_give_the_exporters_settings() -> None:
    settings = settings_from_flags(["mode=opentelemetry", "opentelemetry,url=collector:4318/v1/traces",
                                    "opentelemetry,resource=service.name=rayinfer-test",
                                    "opentelemetry,resource=test.key=test.value", "opentelemetry,bsp_schedule_delay=100",
                                    "level=TIMESTAMPS", "rate=1"])
    assert settings["trace_mode"] == "opentelemetry"
    assert settings["opentelemetry"] == {"url": "http://collector:4318/v1/traces", "bsp_max_queue_size": 2048,
                                         "bsp_schedule_delay": 100, "bsp_max_export_batch_size": 512,
                                         "resource": {"service.name": "rayinfer-test", "test.key": "test.value"}}
    assert TraceSettings(settings).of("m")["trace_mode"] == "opentelemetry"  # what the trace API reports
    assert TraceSettings(settings).opentelemetry == settings["opentelemetry"]
    assert "opentelemetry" not in settings_from_flags(["opentelemetry,url=x:1"])  # the triton mode by default
    for wrong in (["mode=zipkin"], ["opentelemetry,colour=red"], ["opentelemetry,bsp_max_queue_size=x"],
                  ["opentelemetry,resource=novalue"]):
        with pytest.raises(ValueError):
            settings_from_flags(wrong)


@pytest.fixture()
def receiver() -> Iterator[OtlpReceiver]:
    taken = OtlpReceiver()
    yield taken
    taken.close()


def _core(tmp_path: Path, name: str) -> ModelCore:
    write_model(tmp_path, name, CONFIG, add_sub_model(TensorProto.INT32))
    runner, entry = load_runner(tmp_path, name, 1)
    return ModelCore(runner, entry.versions)


def _request(name: str, trace_parent: str | None = None) -> InferRequest:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    return InferRequest(name, "1", "r-7", inputs=[InferInput("INPUT0", "INT32", (1, 16), a),
                                                  InferInput("INPUT1", "INT32", (1, 16), a)], trace_parent=trace_parent)


def test_traced_requests_are_exported_as_tritons_spans(tmp_path: Path, receiver: OtlpReceiver) -> None:
    config = {**otel.default_config(), "url": receiver.url, "bsp_schedule_delay": 50,
              "resource": {"service.name": "rayinfer-test"}}
    settings = {"trace_level": ["TIMESTAMPS"], "trace_rate": "1000", "trace_count": "-1"}
    front, step = _core(tmp_path, "front_model"), _core(tmp_path, "step_model")
    front.tracer.configure(settings, version=1, opentelemetry=config)
    step.tracer.configure(settings, version=1, opentelemetry=config)

    async def main() -> None:
        # A client's request with its trace context, as a replica's listener receives it: traced
        # though the rate (1000) would not sample it.
        received = time.perf_counter_ns()
        stamps = ProtocolStamps("front_model", False, received, received + 1000,
                                [(b":path", b"/x"), (b"traceparent", CLIENT.encode())])
        PROTOCOL_STAMPS.set(stamps)
        prepared = front.prepare(_request("front_model"))
        await front.infer(prepared)
        assert stamps.finish is not None  # the listener ends the trace once the response has left
        sent = time.perf_counter_ns()
        stamps.finish(sent, sent + 1000)
        PROTOCOL_STAMPS.set(None)
        # A request it sends on (an ensemble's step, a BLS call) carries its link.
        await step.infer(step.prepare(_request("step_model", trace_parent=prepared.trace_link)))
        # The Python backend's view of the context (request.trace().get_context()).
        context = json.loads(pb_utils.InferenceTrace(prepared.trace_link).get_context())
        assert context["traceparent"].split("-")[1] == CLIENT.split("-")[1]

    asyncio.run(main())
    spans = wait_until(lambda: len(receiver.taken()) >= 5 and receiver.taken(), "five spans", timeout_s=20)
    by_name = {span["name"]: span for span in spans}
    assert sorted(by_name) == ["InferRequest", "compute", "front_model", "step_model"]
    assert [s["name"] for s in spans].count("compute") == 2
    root, model, child = by_name["InferRequest"], by_name["front_model"], by_name["step_model"]
    assert {s["trace_id"] for s in spans} == {CLIENT.split("-")[1]}  # the client's trace
    assert root["parent"] == CLIENT.split("-")[2]
    assert model["parent"] == root["span_id"] and child["parent"] == model["span_id"]
    assert {s["parent"] for s in spans if s["name"] == "compute"} == {model["span_id"], child["span_id"]}
    assert root["events"] == ["HTTP_RECV_START", "HTTP_RECV_END", "INFER_RESPONSE_COMPLETE", "HTTP_SEND_START",
                              "HTTP_SEND_END"]
    assert model["events"] == ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
    compute = next(s for s in spans if s["name"] == "compute" and s["parent"] == model["span_id"])
    assert compute["events"] == ["COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END"]
    assert model["attributes"] == {"triton.model_name": "front_model", "triton.model_version": 1,
                                   "triton.request_id": "r-7"}
    assert model["start"] <= compute["start"] <= compute["end"] <= model["end"] <= root["end"]
    assert root["resource"]["service.name"] == "rayinfer-test"
    # Without a client's context, the rate decides (1000: not this one).
    untraced = front.prepare(_request("front_model"))
    asyncio.run(front.infer(untraced))
    assert untraced.trace is None


def test_the_tensors_level_keeps_no_tensors_and_says_so_as_triton_does(tmp_path: Path, receiver: OtlpReceiver,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Triton's opentelemetry mode traces no tensors and logs that it does not: the request is
    still exported with its timestamps."""
    config = {**otel.default_config(), "url": receiver.url, "bsp_schedule_delay": 50}
    core = _core(tmp_path, "tensors_model")
    with caplog.at_level("ERROR", logger="rayinfer.serving.trace"):
        core.tracer.configure({"trace_level": ["TIMESTAMPS", "TENSORS"], "trace_rate": "1", "trace_count": "-1"},
                              version=1, opentelemetry=config)
    assert "Tensor level tracing is not supported by the mode: opentelemetry" in caplog.messages
    trace = core.tracer.sample()
    assert trace is not None and trace.exporter is not None and not trace.traces_tensors

    async def main() -> None:
        await core.infer(core.prepare(_request("tensors_model")))

    asyncio.run(main())
    spans = wait_until(lambda: [s for s in receiver.taken() if s["name"] == "tensors_model"] or None,
                       "the model's span to be exported", timeout_s=10)
    assert spans[0]["events"] == ["REQUEST_START", "QUEUE_START", "REQUEST_END"]
    core.tracer.configure({"trace_level": ["TIMESTAMPS", "TENSORS"], "trace_rate": "1", "trace_count": "-1"}, version=2)
    assert core.tracer.sample().traces_tensors  # Triton's own mode keeps them
