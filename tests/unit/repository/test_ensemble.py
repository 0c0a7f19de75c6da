"""An ensemble's step graph: parsing, the checks against its members' configs, deploy order."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format

from rayinfer.protocol.errors import ModelConfigError
from rayinfer.repository.ensemble import (
    check_members,
    decoupled_members,
    dependency_waves,
    member_names,
    parse_ensemble,
)
from rayinfer.repository.model_config import ModelConfig, spec_from_config

ADD_SUB = """name: "add_sub" backend: "onnxruntime" max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
"""
IO = """max_batch_size: 8
input [ { name: "A" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "B" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "S" data_type: TYPE_INT32 dims: [ 16 ] } ]
"""


def step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = "".join(f' input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    maps += "".join(f' output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: -1{maps} }}'


def config(steps: list[str], io: str = IO, extra: str = "") -> ModelConfig:
    text = f'name: "ens" platform: "ensemble"\n{io}ensemble_scheduling {{ step [ {", ".join(steps)} ] }}\n{extra}'
    return text_format.Parse(text, ModelConfig())


def parse(steps: list[str], io: str = IO, extra: str = ""):
    return parse_ensemble(config(steps, io, extra), Path("repo/ens"))


def member(text: str, name: str = "add_sub"):
    parsed = text_format.Parse(text.replace('name: "add_sub"', f'name: "{name}"'), ModelConfig())
    return spec_from_config(parsed, Path(f"repo/{name}/config.pbtxt"))


AB = {"INPUT0": "A", "INPUT1": "B"}


def test_steps_are_ordered_after_the_steps_they_read_from():
    plan = parse([
        step("add_sub", {"INPUT0": "T", "INPUT1": "B"}, {"OUTPUT0": "S"}),
        step("add_sub", AB, {"OUTPUT0": "T"}),
    ])
    assert [s.index for s in plan.steps] == [1, 0]
    assert plan.members == (("add_sub", ""),)
    assert plan.steps[0].label == "step 1 (model 'add_sub')"


@pytest.mark.parametrize("steps, io, message", [
    ([], IO, "needs ensemble_scheduling with at least one step"),
    ([step("ens", AB, {"OUTPUT0": "S"})], IO, "step 0 calls the ensemble itself"),
    ([step("m", AB, {})], IO, "step 0 (model 'm') maps no output"),
    ([step("m", AB, {"OUTPUT0": "S"}), step("m", AB, {"OUTPUT0": "S"})], IO,
     "step 1 (model 'm') writes 'S', which step 0 (model 'm') writes too"),
    ([step("m", AB, {"OUTPUT0": "A"})], IO, "step 0 (model 'm') writes 'A', which is an input of the ensemble"),
    ([step("m", {"INPUT0": "A", "INPUT1": "NOPE"}, {"OUTPUT0": "S"})], IO,
     "step 0 (model 'm') reads 'NOPE', which is neither an input of the ensemble nor an output of any step"),
    ([step("m", AB, {"OUTPUT0": "X"})], IO, "output 'S' is not written by any step"),
    ([step("m", {"INPUT0": "A"}, {"OUTPUT0": "S"})], IO, "input 'B' is not read by any step"),
    ([step("m", AB, {"OUTPUT0": "S", "OUTPUT1": "LOST"})], IO,
     "step 0 (model 'm') writes 'LOST', which no step reads and is not an output of the ensemble"),
    ([step("m", {"INPUT0": "A", "INPUT1": "Y"}, {"OUTPUT0": "S", "OUTPUT1": "X"}),
      step("m", {"INPUT0": "X", "INPUT1": "B"}, {"OUTPUT0": "Y"})], IO,
     "its steps form a cycle: step 0 (model 'm') and step 1 (model 'm') wait for each other's outputs"),
])
def test_graph_errors_name_the_file_and_the_step(steps, io, message):
    with pytest.raises(ModelConfigError) as raised:
        parse(steps, io)
    assert str(raised.value).startswith("repo/ens/config.pbtxt: ensemble 'ens': ")
    assert message in str(raised.value)


def test_conditions_come_from_parameters_and_make_their_outputs_optional():
    io = IO.replace('output [ { name: "S"', 'output [ { name: "S2" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "S"')
    plan = parse([step("m", AB, {"OUTPUT0": "S"}), step("m", {"INPUT0": "S", "INPUT1": "B"}, {"OUTPUT0": "S2"})], io,
                 'parameters { key: "step_1_run_if_present" value: { string_value: "S" } }')
    assert plan.steps[1].run_if_present == "S" and plan.optional_tensors == frozenset({"S2"})
    with pytest.raises(ModelConfigError, match="'step_x_run_if' is not step_<index>_run_if_present"):
        parse([step("m", AB, {"OUTPUT0": "S"})], IO, 'parameters { key: "step_x_run_if" value: { string_value: "A" } }')
    with pytest.raises(ModelConfigError, match="a condition names step 3, but the ensemble has 1 steps"):
        parse([step("m", AB, {"OUTPUT0": "S"})], IO, 'parameters { key: "step_3_run_if" value: { string_value: "A" } }')


@pytest.mark.parametrize("io, steps, message", [
    (IO, [step("add_sub", {"INPUT0": "A", "INPUT9": "B"}, {"OUTPUT0": "S"})],
     "step 0 (model 'add_sub') maps 'INPUT9', which is not an input of model 'add_sub' (its inputs: INPUT0, INPUT1)"),
    (IO, [step("add_sub", AB, {"OUTPUT7": "S"})],
     "step 0 (model 'add_sub') maps 'OUTPUT7', which is not an output of model 'add_sub'"),
    (IO.replace('name: "A" data_type: TYPE_INT32', 'name: "A" data_type: TYPE_FP32'), [step("add_sub", AB, {"OUTPUT0": "S"})],
     "step 0 (model 'add_sub') input 'INPUT0' is INT32, but tensor 'A' from the ensemble's input is FP32"),
    (IO.replace('name: "B" data_type: TYPE_INT32 dims: [ 16 ]', 'name: "B" data_type: TYPE_INT32 dims: [ 4 ]'),
     [step("add_sub", AB, {"OUTPUT0": "S"})],
     "step 0 (model 'add_sub') input 'INPUT1' has shape [-1,16], but tensor 'B' from the ensemble's input has shape [-1,4]"),
    (IO.replace("max_batch_size: 8", "max_batch_size: 32"), [step("add_sub", AB, {"OUTPUT0": "S"})],
     "step 0 (model 'add_sub') allows batches of 8, fewer than the ensemble's max_batch_size 32"),
    (IO.replace('output [ { name: "S" data_type: TYPE_INT32', 'output [ { name: "S" data_type: TYPE_FP32'),
     [step("add_sub", AB, {"OUTPUT0": "S"})], "output 'S' is FP32, but step 0 (model 'add_sub') writes INT32"),
])
def test_member_checks_name_the_step_and_the_tensor(io, steps, message):
    cfg = config(steps, io)
    plan = parse_ensemble(cfg, Path("repo/ens"))
    with pytest.raises(ModelConfigError) as raised:
        check_members(plan, spec_from_config(cfg, Path("repo/ens/config.pbtxt")), {("add_sub", ""): member(ADD_SUB)},
                      Path("repo/ens"))
    assert message in str(raised.value)


def test_an_unmapped_required_input_is_an_error_and_a_fitting_plan_passes():
    io = IO.replace('input [ { name: "A" data_type: TYPE_INT32 dims: [ 16 ] }, ', "input [ ")
    cfg = config([step("add_sub", {"INPUT1": "B"}, {"OUTPUT0": "S"})], io)
    with pytest.raises(ModelConfigError, match="step 0 \\(model 'add_sub'\\) does not map input 'INPUT0'"):
        check_members(parse_ensemble(cfg, Path("repo/ens")), spec_from_config(cfg, Path("x")),
                      {("add_sub", ""): member(ADD_SUB)}, Path("repo/ens"))
    cfg = config([step("add_sub", AB, {"OUTPUT0": "S"})])
    check_members(parse_ensemble(cfg, Path("repo/ens")), spec_from_config(cfg, Path("x")),
                  {("add_sub", ""): member(ADD_SUB)}, Path("repo/ens"))


def test_members_deploy_before_their_ensembles_and_cycles_are_found():
    cfg = config([step("add_sub", AB, {"OUTPUT0": "S"})])
    assert member_names(cfg) == ["add_sub"]
    assert member_names(text_format.Parse(ADD_SUB, ModelConfig())) == []
    waves, cycle = dependency_waves({"outer": ["inner", "m"], "inner": ["m"], "m": [], "elsewhere": ["served"]})
    assert waves == [["elsewhere", "m"], ["inner"], ["outer"]] and cycle == []
    waves, cycle = dependency_waves({"a": ["b"], "b": ["a"], "m": []})
    assert waves == [["m"]] and cycle == ["a", "b"]


def test_decoupled_steps_must_lie_on_one_path():
    decoupled = member(ADD_SUB.replace('backend: "onnxruntime"', 'backend: "python"') +
                       "model_transaction_policy { decoupled: true }", name="gen")
    io = IO.replace('output [ { name: "S"', 'output [ { name: "S2" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "S"')
    chain = config([step("gen", AB, {"OUTPUT0": "T"}), step("gen", {"INPUT0": "T", "INPUT1": "B"}, {"OUTPUT0": "S"})])
    check_members(parse_ensemble(chain, Path("repo/ens")), spec_from_config(chain, Path("x")),
                  {("gen", ""): decoupled}, Path("repo/ens"))
    assert decoupled_members({("gen", ""): decoupled, ("add_sub", ""): member(ADD_SUB)}) == {("gen", "")}
    side_by_side = config([step("gen", AB, {"OUTPUT0": "S"}), step("gen", AB, {"OUTPUT0": "S2"})], io)
    with pytest.raises(ModelConfigError, match="step 0 \\(model 'gen'\\) and step 1 \\(model 'gen'\\) are decoupled "
                                               "and neither feeds the other"):
        check_members(parse_ensemble(side_by_side, Path("repo/ens")), spec_from_config(side_by_side, Path("x")),
                      {("gen", ""): decoupled}, Path("repo/ens"))


def test_the_batching_parameter_is_a_whole_number_and_needs_batches():
    steps = [step("m", AB, {"OUTPUT0": "S"})]
    with pytest.raises(ModelConfigError, match="'max_queue_delay_microseconds' must be a whole number of microseconds"):
        parse(steps, IO, 'parameters { key: "max_queue_delay_microseconds" value: { string_value: "soon" } }')
    with pytest.raises(ModelConfigError, match="'max_queue_delay_microseconds' needs max_batch_size >= 1"):
        parse(steps, IO.replace("max_batch_size: 8", "max_batch_size: 0"),
              'parameters { key: "max_queue_delay_microseconds" value: { string_value: "10" } }')
    assert parse(steps).batch_delay_us is None


def test_steps_in_place_is_off_unless_the_parameter_says_true():
    steps = [step("m", AB, {"OUTPUT0": "S"})]
    assert parse(steps).steps_in_place is False
    assert parse(steps, IO, 'parameters { key: "steps_in_place" value: { string_value: "True" } }').steps_in_place
    assert not parse(steps, IO, 'parameters { key: "steps_in_place" value: { string_value: "false" } }').steps_in_place
    with pytest.raises(ModelConfigError, match="parameter 'steps_in_place' must be 'true' or 'false', got 'yes please'"):
        parse(steps, IO, 'parameters { key: "steps_in_place" value: { string_value: "yes please" } }')
