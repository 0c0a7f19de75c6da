"""The ensemble executor over real ONNX Runtime members in this process (the deployment's step
caller goes by Ray handle; here a caller hands each step to the member's own ModelCore)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from onnx import TensorProto

from rayinfer.adapters.loader import load_runner
from rayinfer.cluster.example_repository import add_sub_model, write_model
from rayinfer.protocol.errors import InvalidArgError, ServingError
from rayinfer.protocol.types import InferInput, InferOutput, InferRequest, InferResponse
from rayinfer.repository.ensemble import parse_ensemble
from rayinfer.repository.model_config import ModelConfig, spec_from_config
from rayinfer.serving.ensemble import EnsembleExecutor
from rayinfer.serving.model_core import ModelCore

ADD_SUB = """name: "add_sub" platform: "onnxruntime_onnx" max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
"""
INT16 = "data_type: TYPE_INT32 dims: [ 16 ]"
# A diamond: steps 0 and 1 read only ensemble inputs, step 2 reads both; step 3 runs only if FLAG.
DIAMOND = f"""name: "diamond" platform: "ensemble" max_batch_size: 8
input [ {{ name: "A" {INT16} }}, {{ name: "B" {INT16} }},
        {{ name: "FLAG" data_type: TYPE_BOOL dims: [ 1 ] optional: true }} ]
output [ {{ name: "S" {INT16} }}, {{ name: "D" {INT16} }}, {{ name: "OUT" {INT16} }}, {{ name: "FLAGGED" {INT16} }} ]
ensemble_scheduling {{ step [
  {{ model_name: "add_sub" model_version: -1 input_map {{ key: "INPUT0" value: "A" }} input_map {{ key: "INPUT1" value: "B" }}
     output_map {{ key: "OUTPUT0" value: "S" }} }},
  {{ model_name: "add_sub" model_version: -1 input_map {{ key: "INPUT0" value: "A" }} input_map {{ key: "INPUT1" value: "B" }}
     output_map {{ key: "OUTPUT1" value: "D" }} }},
  {{ model_name: "add_sub" model_version: -1 input_map {{ key: "INPUT0" value: "S" }} input_map {{ key: "INPUT1" value: "D" }}
     output_map {{ key: "OUTPUT0" value: "OUT" }} }},
  {{ model_name: "add_sub" model_version: -1 input_map {{ key: "INPUT0" value: "S" }} input_map {{ key: "INPUT1" value: "S" }}
     output_map {{ key: "OUTPUT0" value: "FLAGGED" }} }}
] }}
parameters {{ key: "step_3_run_if" value: {{ string_value: "FLAG" }} }}
"""


@pytest.fixture(scope="module")
def member(tmp_path_factory: pytest.TempPathFactory) -> ModelCore:
    root = tmp_path_factory.mktemp("repo")
    write_model(root, "add_sub", ADD_SUB, add_sub_model(TensorProto.INT32))
    runner, entry = load_runner(root, "add_sub", 1)
    return ModelCore(runner, entry.versions)


class Caller:
    """Hands each step to the member's core; counts steps in flight; may hold or fail a step."""

    def __init__(self, core: ModelCore) -> None:
        self.core = core
        self.in_flight = self.most_in_flight = 0
        self.hold: asyncio.Event | None = None
        self.fail_when_s_is_given = False
        self.cancelled = 0

    async def __call__(self, request: InferRequest) -> InferResponse:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0)  # yield: the other ready steps start before this one answers
            names = {t.name: t for t in request.inputs}
            if self.fail_when_s_is_given and request.outputs[0].name == "OUTPUT1":
                raise InvalidArgError("the member refused it")
            if self.hold is not None and "OUTPUT0" == request.outputs[0].name and len(names) == 2:
                await self.hold.wait()
            return await self.core.infer(self.core.prepare(request))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1


def ensemble(caller: Caller) -> EnsembleExecutor:
    config = text_format.Parse(DIAMOND, ModelConfig())
    return EnsembleExecutor(spec_from_config(config, Path("diamond/config.pbtxt")),
                            parse_ensemble(config, Path("diamond")), 1, caller)


def request(executor: EnsembleExecutor, flag: bool | None = None):
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 3, dtype=np.int32)
    inputs = [InferInput("A", "INT32", (1, 16), a), InferInput("B", "INT32", (1, 16), b)]
    if flag is not None:
        inputs.append(InferInput("FLAG", "BOOL", (1, 1), np.array([[flag]])))
    return executor.prepare(InferRequest("diamond", inputs=inputs)), a, b


def test_independent_steps_run_together_and_results_flow(member):
    caller = Caller(member)
    executor = ensemble(caller)
    prepared, a, b = request(executor)
    response = asyncio.run(executor.execute_async(prepared))
    outputs = {o.name: o.data for o in response.outputs}
    np.testing.assert_array_equal(outputs["S"], a + b)
    np.testing.assert_array_equal(outputs["D"], a - b)
    np.testing.assert_array_equal(outputs["OUT"], 2 * a)
    assert "FLAGGED" not in outputs  # step 3 did not run: no FLAG
    assert caller.most_in_flight == 2  # steps 0 and 1 together
    assert executor.stats.snapshot()["inference_count"] == 1


def test_a_true_flag_runs_the_conditional_step(member):
    executor = ensemble(Caller(member))
    prepared, a, b = request(executor, flag=True)
    outputs = {o.name: o.data for o in asyncio.run(executor.execute_async(prepared)).outputs}
    np.testing.assert_array_equal(outputs["FLAGGED"], 2 * (a + b))
    prepared, _, _ = request(executor, flag=False)
    assert "FLAGGED" not in {o.name for o in asyncio.run(executor.execute_async(prepared)).outputs}


def test_a_failing_step_names_itself_keeps_its_code_and_cancels_the_rest(member):
    caller = Caller(member)
    caller.hold = asyncio.Event()  # step 0 waits forever
    caller.fail_when_s_is_given = True  # step 1 fails
    executor = ensemble(caller)
    prepared, _, _ = request(executor)

    async def run() -> object:
        return await asyncio.wait_for(executor.execute_async(prepared), 10)

    error = asyncio.run(run())
    assert isinstance(error, ServingError) and error.code.name == "INVALID_ARG"
    assert error.message == "in ensemble 'diamond', step 1 (model 'add_sub') failed: the member refused it"
    assert caller.cancelled == 1  # step 0, still held, was cancelled
    assert executor.stats.snapshot()["durations"]["fail"][0] == 1


# A decoupled first step (in-process stand-in: one response per row of A), then add_sub per
# response; a step reading only the inputs (step 2) is started before the fork and shared.
STREAMED = f"""name: "streamed" platform: "ensemble" max_batch_size: 0
input [ {{ name: "A" data_type: TYPE_INT32 dims: [ 3, 16 ] }}, {{ name: "B" data_type: TYPE_INT32 dims: [ 1, 16 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1, 16 ] }}, {{ name: "SHARED" data_type: TYPE_INT32 dims: [ 1, 16 ] }} ]
ensemble_scheduling {{ step [
  {{ model_name: "rows" model_version: -1 input_map {{ key: "IN" value: "A" }} output_map {{ key: "ROW" value: "ROW" }} }},
  {{ model_name: "add_sub" model_version: -1 input_map {{ key: "INPUT0" value: "ROW" }} input_map {{ key: "INPUT1" value: "B" }}
     output_map {{ key: "OUTPUT0" value: "OUT" }} }},
  {{ model_name: "add_sub" model_version: -1 input_map {{ key: "INPUT0" value: "B" }} input_map {{ key: "INPUT1" value: "B" }}
     output_map {{ key: "OUTPUT0" value: "SHARED" }} }}
] }}
"""


def test_a_decoupled_step_forks_one_response_per_member_response(member):
    class Sender:
        def __init__(self) -> None:
            self.sent: list = []

        def send(self, response=None, final=False) -> None:
            self.sent.append((response, final))

        async def send_async(self, response) -> None:
            self.send(response)

    caller = Caller(member)
    calls_to_shared = []

    async def call(request: InferRequest) -> InferResponse:
        if {t.name for t in request.inputs} and all(t.data is request.inputs[0].data for t in request.inputs):
            calls_to_shared.append(request)
        return await caller(request)

    async def stream(request: InferRequest):
        for row in request.inputs[0].data:
            await asyncio.sleep(0)  # yield between responses, as a member streaming them would
            yield InferResponse("rows", "1", outputs=[InferOutput("ROW", "INT32", (1, 16), row.reshape(1, 16))])

    config = text_format.Parse(STREAMED, ModelConfig())
    executor = EnsembleExecutor(spec_from_config(config, Path("streamed/config.pbtxt")),
                                parse_ensemble(config, Path("streamed")), 1, call, stream=stream,
                                decoupled_members=frozenset({("rows", "")}))
    assert executor.decoupled
    a = np.arange(48, dtype=np.int32).reshape(3, 16)
    b = np.ones((1, 16), dtype=np.int32)
    prepared = executor.prepare(InferRequest("streamed", inputs=[InferInput("A", "INT32", (3, 16), a),
                                                                 InferInput("B", "INT32", (1, 16), b)]))
    prepared.sender = Sender()
    assert asyncio.run(executor.execute_async(prepared)) is None
    *responses, (last, final) = prepared.sender.sent
    assert last is None and final and len(responses) == 3
    outs = sorted({o.name: o.data for o in response.outputs}["OUT"].tolist()[0] for response, _ in responses)
    assert outs == sorted((a[i] + 1).tolist() for i in range(3))
    assert all(({o.name: o.data for o in r.outputs}["SHARED"] == 2).all() for r, _ in responses)
    assert len(calls_to_shared) == 1  # the step the flows share ran once


def test_batched_requests_run_the_steps_once_with_all_their_rows(member):
    caller = Caller(member)
    rows_seen = []

    async def call(request: InferRequest) -> InferResponse:
        rows_seen.append(request.inputs[0].shape[0])
        return await caller(request)

    text = DIAMOND.replace('parameters {', 'parameters { key: "max_queue_delay_microseconds" value: { string_value: "100" } }\nparameters {')
    config = text_format.Parse(text, ModelConfig())
    plan = parse_ensemble(config, Path("diamond"))
    assert plan.batch_delay_us == 100
    executor = EnsembleExecutor(spec_from_config(config, Path("diamond/config.pbtxt")), plan, 1, call)
    core = ModelCore(executor, [1])
    first, a, b = request(executor)
    second = executor.prepare(InferRequest("diamond", id="2", inputs=[
        InferInput("A", "INT32", (2, 16), np.stack([a[0], 2 * a[0]])), InferInput("B", "INT32", (2, 16), np.stack([b[0], b[0]]))]))

    async def both():
        return await asyncio.gather(core.infer(first), core.infer(second))

    one, two = asyncio.run(both())
    np.testing.assert_array_equal({o.name: o.data for o in one.outputs}["OUT"], 2 * a)
    np.testing.assert_array_equal({o.name: o.data for o in two.outputs}["OUT"], np.stack([2 * a[0], 4 * a[0]]))
    assert two.id == "2" and {o.name: o.data.shape for o in two.outputs}["S"] == (2, 16)
    assert rows_seen == [3, 3, 3]  # steps 0, 1 and 2 ran once, with the three rows of both requests
    assert executor.stats.snapshot()["execution_count"] == 1
