"""ModelCore and its HTTP and gRPC translators over a real ONNX Runtime model, and the executor
contract with a decoupled executor (a stand-in answering from its own threads; no Ray)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf import text_format
from onnx import TensorProto
from tritonclient.grpc import service_pb2 as pb

from rayinfer.adapters.loader import load_runner
from rayinfer.cluster.example_repository import add_sub_model, write_model
from rayinfer.protocol.errors import InternalError, InvalidArgError, NotFoundError, UnsupportedError
from rayinfer.protocol.statistics import ModelStatistics
from rayinfer.protocol.types import InferInput, InferOutput, InferRequest, InferResponse
from rayinfer.repository.model_config import ModelConfig, spec_from_config
from rayinfer.serving import model_grpc, model_http
from rayinfer.serving.model_core import ModelCore
from rayinfer.serving.routes import ModelRoute

IO = """input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
"""
BATCHED = 'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n' + IO + "dynamic_batching { max_queue_delay_microseconds: 200000 }\n"


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    write_model(root, "addsub", BATCHED, add_sub_model(TensorProto.INT32))
    return root


def _core(repository: Path, statistics: Any = None) -> ModelCore:
    runner, entry = load_runner(repository, "addsub", 1)
    return ModelCore(runner, entry.versions, statistics)


def _body(a: list[int], b: list[int], **parameters: Any) -> bytes:
    doc: dict[str, Any] = {"inputs": [
        {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": a},
        {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": b},
    ]}
    if parameters:
        doc["parameters"] = parameters
    return json.dumps(doc).encode()


def test_http_requests_are_batched_and_each_gets_its_own_answer(repository: Path) -> None:
    async def main() -> list[Any]:
        core = _core(repository)
        route = ModelRoute("addsub", "", "infer")
        calls = [model_http.respond(core, "POST", route, {}, _body([i] * 16, [1] * 16)) for i in range(4)]
        bad = model_http.respond(core, "POST", route, {}, b'{"inputs": [{"name": "INPUT0"}]}')
        answers = await asyncio.gather(*calls, bad)
        return [answers, core.snapshot()]

    answers, snapshot = asyncio.run(main())
    for i, (status, _, body) in enumerate(answers[:4]):
        assert status == 200
        outputs = {o["name"]: o["data"] for o in json.loads(body)["outputs"]}
        assert outputs == {"OUTPUT0": [i + 1] * 16, "OUTPUT1": [i - 1] * 16}
    status, _, body = answers[4]
    assert status == 400 and "INPUT0" in json.loads(body)["error"]
    # Four requests, one execution of four rows; the rejected request is not counted.
    assert snapshot["execution_count"] == 1 and snapshot["inference_count"] == 4
    assert snapshot["durations"]["success"][0] == 4 and snapshot["durations"]["fail"][0] == 0


def test_requests_with_different_parameters_are_executed_apart(repository: Path) -> None:
    async def main() -> dict[str, Any]:
        core = _core(repository)
        route = ModelRoute("addsub", "", "infer")
        await asyncio.gather(
            model_http.respond(core, "POST", route, {}, _body([1] * 16, [1] * 16, temperature=1)),
            model_http.respond(core, "POST", route, {}, _body([1] * 16, [1] * 16, temperature=2)),
            # Differing only in how the answer is encoded: merged with the first.
            model_http.respond(core, "POST", route, {}, _body([1] * 16, [1] * 16, temperature=1,
                                                            binary_data_output=True)),
        )
        return core.snapshot()

    snapshot = asyncio.run(main())
    assert snapshot["execution_count"] == 2
    assert sorted(snapshot["batch_stats"]) == [1, 2]


def test_queue_policy_refuses_and_rejects_with_tritons_errors(tmp_path: Path) -> None:
    # Requests wait 200 ms for a batch: two fill the queue; a third is refused at once; one whose
    # own 1 ms timeout expires while it waits is rejected without running, counted as REJECTED.
    policy = ("dynamic_batching { max_queue_delay_microseconds: 200000 default_queue_policy { "
              "max_queue_size: 2 default_timeout_microseconds: 10000000 allow_timeout_override: true } }\n")
    write_model(tmp_path, "addsub", BATCHED.split("dynamic_batching")[0] + policy, add_sub_model(TensorProto.INT32))

    async def main() -> tuple[list[Any], list[Any], dict[str, Any]]:
        runner, entry = load_runner(tmp_path, "addsub", 1)
        core = ModelCore(runner, entry.versions)
        route = ModelRoute("addsub", "", "infer")

        def call(request_id: str, **parameters: Any) -> Any:
            body = json.loads(_body([1] * 16, [1] * 16, **parameters))
            body["id"] = request_id
            return model_http.respond(core, "POST", route, {}, json.dumps(body).encode())

        full = await asyncio.gather(call("r1"), call("r2"), call("r3"))
        expired = await asyncio.gather(call("r4", timeout=1000), call("r5"))
        return full, expired, core.snapshot()

    full, expired, snapshot = asyncio.run(main())
    assert [status for status, _, _ in full] == [200, 200, 503]
    assert json.loads(full[2][2]) == {"error": "[request id: r3] Exceeds maximum queue size"}
    assert [status for status, _, _ in expired] == [503, 200]
    assert json.loads(expired[0][2]) == {"error": "Request timeout expired"}
    # The refused request is not counted (as in Triton); the expired one is a failure.
    assert snapshot["durations"]["success"][0] == 3 and snapshot["durations"]["fail"][0] == 1
    assert snapshot["failure_reasons"] == {"REJECTED": 1}


def test_model_routes_over_http(repository: Path) -> None:
    async def main() -> list[Any]:
        core = _core(repository)
        return [
            await model_http.respond(core, "GET", ModelRoute("addsub"), {}, b""),
            await model_http.respond(core, "GET", ModelRoute("addsub", "1", "ready"), {}, b""),
            await model_http.respond(core, "GET", ModelRoute("addsub", "2", "ready"), {}, b""),
            await model_http.respond(core, "GET", ModelRoute("addsub", "", "config"), {}, b""),
            await model_http.respond(core, "GET", ModelRoute("addsub", "", "stats"), {}, b""),
            await model_http.respond(core, "GET", ModelRoute("addsub", "", "infer"), {}, b""),
        ]

    metadata, ready, other_version, config, stats, get_infer = asyncio.run(main())
    assert json.loads(metadata[2])["inputs"][0] == {"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]}
    assert ready[0] == 200
    assert other_version[0] == 404
    assert "version 2 is not found" in json.loads(other_version[2])["error"]
    assert json.loads(config[2])["max_batch_size"] == 8
    assert json.loads(stats[2])["model_stats"][0]["name"] == "addsub"
    assert get_infer[0] == 404


def test_grpc_calls_and_statistics_from_the_source(repository: Path) -> None:
    reported: list[tuple[str, dict[str, Any]]] = []

    async def statistics(version: str, snapshot: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        reported.append((version, snapshot))
        return [("1", snapshot), ("2", snapshot)]

    async def main() -> list[Any]:
        core = _core(repository, statistics)
        request = pb.ModelInferRequest(model_name="addsub")
        for name in ("INPUT0", "INPUT1"):
            request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
            request.raw_input_contents.append(np.arange(16, dtype=np.int32).tobytes())
        payload = await model_grpc.call_serialized(core, "ModelInfer", request.SerializeToString())
        stats = await model_grpc.call(core, "ModelStatistics", pb.ModelStatisticsRequest(name="addsub"))
        with pytest.raises(NotFoundError, match="version 7 is not found"):
            await model_grpc.call(core, "ModelReady", pb.ModelReadyRequest(name="addsub", version="7"))
        with pytest.raises(InternalError, match="^Unable to parse request$"):
            await model_grpc.call_serialized(core, "ModelConfig", b"\xff\xff")
        return [pb.ModelInferResponse.FromString(payload), stats]

    response, stats = asyncio.run(main())
    out0 = np.frombuffer(response.raw_output_contents[0], dtype=np.int32)
    np.testing.assert_array_equal(out0, np.arange(16) * 2)
    assert [(s.name, s.version) for s in stats.model_stats] == [("addsub", "1"), ("addsub", "2")]
    assert reported and reported[0][0] == "" and reported[0][1]["execution_count"] == 1


class _Repeat:
    """A decoupled executor: answers each request ``COUNT`` times from a thread of its own."""

    decoupled = True
    version = "1"

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.stats = ModelStatistics()

    def prepare(self, request: InferRequest) -> Any:
        count = int(request.inputs[0].data.reshape(-1)[0])
        return type("Prepared", (), {"request": request, "rows": 1, "sender": None, "count": count,
                                     "arrival_ns": time.perf_counter_ns()})()

    def execute(self, batch: list[Any]) -> None:
        if any(prepared.count < 0 for prepared in batch):
            raise ValueError("a negative count")

        def answer(prepared: Any) -> None:
            for n in range(prepared.count):
                array = np.array([n], dtype=np.int32)
                prepared.sender.send(InferResponse("repeat", "1", [InferOutput("OUT", "INT32", (1,), array)]))
            prepared.sender.send(final=True)

        for prepared in batch:
            threading.Thread(target=answer, args=(prepared,)).start()
        return None


def _decoupled_spec(tmp_path: Path, name: str) -> Any:
    config = text_format.Parse(
        f'name: "{name}" backend: "python" max_batch_size: 0 '
        'input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ] '
        'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]', ModelConfig())
    return spec_from_config(config, tmp_path / "config.pbtxt")


def test_a_decoupled_executor_streams_zero_to_many_responses(tmp_path: Path) -> None:
    spec = _decoupled_spec(tmp_path, "repeat")

    def request(count: int) -> InferRequest:
        return InferRequest("repeat", inputs=[InferInput("IN", "INT32", (1,), np.array([count], dtype=np.int32))])

    async def main() -> list[Any]:
        core = ModelCore(_Repeat(spec), ["1"])
        three = [r.outputs[0].data[0] async for r in core.stream(core.prepare(request(3)))]
        none = [r async for r in core.stream(core.prepare(request(0)))]
        failed = [r async for r in core.stream(core.prepare(request(-1)))]
        assert len(failed) == 1 and "a negative count" in failed[0].message
        status, _, body = await model_http.infer(core, {}, b"{}")
        with pytest.raises(UnsupportedError, match="ModelInfer RPC doesn't support"):
            await model_grpc.call(core, "ModelInfer", pb.ModelInferRequest(model_name="repeat"))
        return [three, none, status, body]

    three, none, status, body = asyncio.run(main())
    assert three == [0, 1, 2]
    assert none == []
    assert status == 501 and "decoupled transaction policy" in json.loads(body)["error"]


class _FinalFirst(_Repeat):
    """A decoupled executor that sends its final response, then returns only once released."""

    def __init__(self, spec: Any) -> None:
        super().__init__(spec)
        self.release = threading.Event()

    def prepare(self, request: InferRequest) -> Any:
        return type("Prepared", (), {"request": request, "rows": 1, "sender": None, "arrival_ns": time.perf_counter_ns(),
                                     "trace": None})()

    def execute(self, batch: list[Any]) -> None:
        for prepared in batch:
            prepared.sender.send(InferResponse("final_first", "1", []), final=True)
        self.release.wait(10)
        return None


def test_a_decoupled_requests_trace_ends_when_its_execution_has_returned(tmp_path: Path) -> None:
    """The final response may reach the caller before ``execute`` returns: the trace is taken
    once both happened, with the execution's timestamps and REQUEST_END last."""
    executor = _FinalFirst(_decoupled_spec(tmp_path, "final_first"))
    core = ModelCore(executor, ["1"])
    core.tracer.configure({"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "-1"}, version=1)
    finish = core.tracer.finish

    async def main() -> tuple[int, list[Any]]:
        finished = asyncio.Event()

        def finish_and_tell(*args: Any, **kwargs: Any) -> None:
            finish(*args, **kwargs)
            finished.set()

        core.tracer.finish = finish_and_tell  # type: ignore[method-assign]
        responses = [r async for r in core.stream(core.prepare(InferRequest("final_first")))]
        early = len(core.tracer.collect())  # the execution has not returned yet: no trace
        executor.release.set()
        await asyncio.wait_for(finished.wait(), 10)
        return len(responses) - early, core.tracer.collect()

    answered, traces = asyncio.run(main())
    assert answered == 1 and len(traces) == 1
    names = [name for name, _ in traces[0]["timestamps"]]
    assert names[0] == "REQUEST_START" and names[-1] == "REQUEST_END" and "COMPUTE_END" in names


class _Counting:
    """An executor that records how many executions overlap; the first is slow (20 ms: the next
    ones go to the model thread), the rest short (0.5 ms: once the average says so, the core
    runs them on its loop, while the thread may still have some)."""

    version = "1"

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.stats = ModelStatistics()
        self.running = self.most = self.calls = 0
        self._lock = threading.Lock()

    def prepare(self, request: InferRequest) -> Any:
        return type("Prepared", (), {"request": request, "rows": 1, "sender": None})()

    def execute(self, batch: list[Any]) -> list[Any]:
        with self._lock:
            self.running += 1
            self.calls += 1
            self.most = max(self.most, self.running)
            first = self.calls == 1
        threading.Event().wait(0.02 if first else 0.0005)
        with self._lock:
            self.running -= 1
        return [InferResponse("count", "1", []) for _ in batch]


def test_executions_never_overlap_when_they_move_from_the_thread_to_the_loop(tmp_path: Path) -> None:
    config = text_format.Parse(
        'name: "count" backend: "python" max_batch_size: 0 '
        'input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ] '
        'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]', ModelConfig())
    executor = _Counting(spec_from_config(config, tmp_path / "config.pbtxt"))

    async def main() -> None:
        core = ModelCore(executor, ["1"])
        request = InferRequest("count", inputs=[InferInput("IN", "INT32", (1,), np.array([1], dtype=np.int32))])
        # No dynamic batching: every request is its own execution; they arrive one by one.
        pending = []
        for _ in range(300):
            pending.append(asyncio.ensure_future(core.infer(core.prepare(request))))
            await asyncio.sleep(0.0002)  # paces arrivals (the test's load), waits for nothing
        await asyncio.gather(*pending)

    asyncio.run(main())
    assert executor.calls == 300
    assert executor.most == 1


def test_an_output_requested_twice_is_refused_over_http_and_grpc(repository: Path) -> None:
    """Triton's current release: 400 / INVALID_ARGUMENT naming the output (2.51 answered it once)."""
    doc = json.loads(_body([1] * 16, [1] * 16))
    doc["outputs"] = [{"name": "OUTPUT0"}, {"name": "OUTPUT1"}, {"name": "OUTPUT0"}]
    message = pb.ModelInferRequest(model_name="addsub")
    for name in ("INPUT0", "INPUT1"):
        message.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        message.raw_input_contents.append(np.ones(16, np.int32).tobytes())
    message.outputs.add(name="OUTPUT1")
    message.outputs.add(name="OUTPUT1")

    async def main() -> tuple[Any, Any]:
        core = _core(repository)
        http = await model_http.respond(core, "POST", ModelRoute("addsub", "", "infer"), {}, json.dumps(doc).encode())
        with pytest.raises(InvalidArgError) as grpc_error:
            await model_grpc.call_serialized(core, "ModelInfer", message.SerializeToString())
        return http, grpc_error.value

    (status, _, body), grpc_error = asyncio.run(main())
    assert status == 400
    assert json.loads(body)["error"] == "Duplicate output name 'OUTPUT0' is not allowed in a request"
    assert grpc_error.message == "Duplicate output name 'OUTPUT1' is not allowed in a request"
