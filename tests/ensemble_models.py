"""Ensembles of the test repository, over the example's ``simple`` (INT32 add/sub, [16], batches
of up to 8), ``simple_identity`` (BYTES), the decoupled ``py_repeat`` and Python members of
their own, plus broken ensembles that tests load to see the error."""

from __future__ import annotations

from pathlib import Path


_INT16 = 'data_type: TYPE_INT32 dims: [ 16 ]'

# OUTPUT = 2 * INPUT; an input holding -13 fails the request (the step failure tests use it).
DOUBLE_CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 16 ] } ]
dynamic_batching { max_queue_delay_microseconds: 2000 }
instance_group [ { kind: KIND_CPU } ]
"""
DOUBLE_MODEL = '''import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            if (x == -13).any():
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("unlucky input -13")))
                continue
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", (2 * x).astype(np.int32))]))
        return responses
'''


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str], version: int = -1) -> str:
    maps = "".join(f' input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items())
    maps += "".join(f' output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items())
    return f'{{ model_name: "{model}" model_version: {version}{maps} }}'


def _ensemble(name: str, inputs: list[str], outputs: list[str], steps: list[str], max_batch_size: int = 8,
              extra: str = "") -> str:
    return (f'name: "{name}"\nplatform: "ensemble"\nmax_batch_size: {max_batch_size}\n'
            f'input [ {", ".join(inputs)} ]\noutput [ {", ".join(outputs)} ]\n'
            f'ensemble_scheduling {{ step [ {", ".join(steps)} ] }}\n{extra}')


def _int(name: str, optional: bool = False) -> str:
    return f'{{ name: "{name}" {_INT16}{" optional: true" if optional else ""} }}'


ADD_SUB = {"INPUT0": "A", "INPUT1": "B"}
ENSEMBLES = {
    # (a + b) + (a - b) = 2a and (a + b) - (a - b) = 2b: two steps in a chain, one member twice.
    "ens_chain": _ensemble("ens_chain", [_int("A"), _int("B")], [_int("TWICE_A"), _int("TWICE_B")], [
        _step("simple", ADD_SUB, {"OUTPUT0": "SUM", "OUTPUT1": "DIFF"}),
        _step("simple", {"INPUT0": "SUM", "INPUT1": "DIFF"}, {"OUTPUT0": "TWICE_A", "OUTPUT1": "TWICE_B"}),
    ]),
    # ens_chain with its own requests batched (rayinfer's max_queue_delay_microseconds parameter).
    "ens_chain_batched": _ensemble("ens_chain_batched", [_int("A"), _int("B")], [_int("TWICE_A"), _int("TWICE_B")], [
        _step("simple", ADD_SUB, {"OUTPUT0": "SUM", "OUTPUT1": "DIFF"}),
        _step("simple", {"INPUT0": "SUM", "INPUT1": "DIFF"}, {"OUTPUT0": "TWICE_A", "OUTPUT1": "TWICE_B"}),
    ], extra='parameters { key: "max_queue_delay_microseconds" value: { string_value: "5000" } }\n'),
    # A diamond: add/sub and two doublings run side by side, then add/sub of the doubled.
    "ens_diamond": _ensemble("ens_diamond", [_int("A"), _int("B")],
                             [_int("SUM"), _int("DIFF"), _int("SUM2"), _int("DIFF2")], [
        _step("simple", ADD_SUB, {"OUTPUT0": "SUM", "OUTPUT1": "DIFF"}),
        _step("ens_double", {"INPUT": "A"}, {"OUTPUT": "A2"}),
        _step("ens_double", {"INPUT": "B"}, {"OUTPUT": "B2"}),
        _step("simple", {"INPUT0": "A2", "INPUT1": "B2"}, {"OUTPUT0": "SUM2", "OUTPUT1": "DIFF2"}),
    ]),
    # An ensemble as a step: 2a + 2b and 2a - 2b.
    "ens_nested": _ensemble("ens_nested", [_int("X"), _int("Y")], [_int("OUT_SUM"), _int("OUT_DIFF")], [
        _step("ens_chain", {"A": "X", "B": "Y"}, {"TWICE_A": "X2", "TWICE_B": "Y2"}),
        _step("simple", {"INPUT0": "X2", "INPUT1": "Y2"}, {"OUTPUT0": "OUT_SUM", "OUTPUT1": "OUT_DIFF"}),
    ]),
    # BYTES through a Python member.
    "ens_strings": _ensemble("ens_strings", ['{ name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] }'],
                             ['{ name: "ECHO" data_type: TYPE_STRING dims: [ -1 ] }'],
                             [_step("simple_identity", {"INPUT0": "TEXT"}, {"OUTPUT0": "ECHO"})]),
    # Conditional steps (rayinfer's parameters): doubling SUM only when FLAG is true, doubling
    # EXTRA only when it is given.
    "ens_conditional": _ensemble(
        "ens_conditional",
        [_int("A"), '{ name: "FLAG" data_type: TYPE_BOOL dims: [ 1 ] optional: true }', _int("EXTRA", optional=True)],
        [_int("SUM"), _int("SUM2"), _int("EXTRA2")], [
            _step("simple", {"INPUT0": "A", "INPUT1": "A"}, {"OUTPUT0": "SUM"}),
            _step("ens_double", {"INPUT": "SUM"}, {"OUTPUT": "SUM2"}),
            _step("ens_double", {"INPUT": "EXTRA"}, {"OUTPUT": "EXTRA2"}),
        ],
        extra='parameters { key: "step_1_run_if" value: { string_value: "FLAG" } }\n'
              'parameters { key: "step_2_run_if_present" value: { string_value: "EXTRA" } }\n',
    ),
    # A decoupled member (py_repeat: one response per element of VALUES) then a step per response:
    # the ensemble streams one response per element.
    "ens_stream": _ensemble(
        "ens_stream", ['{ name: "VALUES" data_type: TYPE_INT32 dims: [ -1 ] }'],
        ['{ name: "SQUARE" data_type: TYPE_INT32 dims: [ 1 ] }', '{ name: "INDEX" data_type: TYPE_UINT32 dims: [ 1 ] }'],
        [_step("py_repeat", {"IN": "VALUES"}, {"OUT": "VALUE", "IDX": "INDEX"}),
         _step("ens_square", {"INPUT": "VALUE"}, {"OUTPUT": "SQUARE"})], max_batch_size=0),
    # Loaded on demand: loading it loads its member; unloading with unload_dependents unloads both.
    "ens_on_demand": _ensemble("ens_on_demand", [_int("A")], [_int("A2")],
                               [_step("ens_on_demand_member", {"INPUT": "A"}, {"OUTPUT": "A2"})]),
    # Its steps run in the ensemble's own replica (rayinfer's steps_in_place parameter): PID
    # tells which process ran ens_pid_double.
    "ens_in_place": _ensemble("ens_in_place", [_int("A"), _int("B")],
                              [_int("SUM"), _int("DIFF"), _int("SUM2"), '{ name: "PID" data_type: TYPE_INT64 dims: [ 1 ] }'], [
        _step("simple", ADD_SUB, {"OUTPUT0": "SUM", "OUTPUT1": "DIFF"}),
        _step("ens_pid_double", {"INPUT": "SUM"}, {"OUTPUT": "SUM2", "PID": "PID"}),
    ], extra='parameters { key: "steps_in_place" value: { string_value: "true" } }\n'),
    # The same, its own requests batched too: each batch's steps run in place at once.
    "ens_in_place_batched": _ensemble("ens_in_place_batched", [_int("A"), _int("B")],
                                      [_int("DIFF"), _int("SUM2"), '{ name: "PID" data_type: TYPE_INT64 dims: [ 1 ] }'], [
        _step("simple", ADD_SUB, {"OUTPUT0": "SUM", "OUTPUT1": "DIFF"}),
        _step("ens_pid_double", {"INPUT": "SUM"}, {"OUTPUT": "SUM2", "PID": "PID"}),
    ], extra='parameters { key: "steps_in_place" value: { string_value: "true" } }\n'
             'parameters { key: "max_queue_delay_microseconds" value: { string_value: "5000" } }\n'),
    # test_model_pool: its two steps are pooled Python models (tests/python_models.py): OUT = IN + 11.
    "ens_pooled": _ensemble("ens_pooled", ['{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }'],
                            ['{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }'], [
        _step("py_pooled_a", {"IN": "IN"}, {"OUT": "PLUS_ONE"}),
        _step("py_pooled_b", {"IN": "PLUS_ONE"}, {"OUT": "OUT"}),
    ], max_batch_size=4),
    # Broken: each load fails with a message naming the step.
    "ensbad_unknown_model": _ensemble("ensbad_unknown_model", [_int("A")], [_int("Z")],
                                      [_step("no_such_model", {"INPUT": "A"}, {"OUTPUT": "Z"})]),
    "ensbad_dtype": _ensemble("ensbad_dtype", ['{ name: "A" data_type: TYPE_FP32 dims: [ 16 ] }', _int("B")],
                              [_int("S"), _int("D")], [_step("simple", ADD_SUB, {"OUTPUT0": "S", "OUTPUT1": "D"})]),
    "ensbad_unmapped": _ensemble("ensbad_unmapped", [_int("A")], [_int("S"), _int("D")],
                                 [_step("simple", {"INPUT0": "A"}, {"OUTPUT0": "S", "OUTPUT1": "D"})]),
    "ensbad_batch": _ensemble("ensbad_batch", [_int("A"), _int("B")], [_int("S"), _int("D")],
                              [_step("simple", ADD_SUB, {"OUTPUT0": "S", "OUTPUT1": "D"})], max_batch_size=16),
    "ensbad_cycle": _ensemble("ensbad_cycle", [_int("A")], [_int("S"), _int("Y")], [
        _step("simple", {"INPUT0": "A", "INPUT1": "D"}, {"OUTPUT0": "S", "OUTPUT1": "X"}),
        _step("simple", {"INPUT0": "X", "INPUT1": "A"}, {"OUTPUT0": "Y", "OUTPUT1": "D"}),
    ]),
    "ensbad_unused": _ensemble("ensbad_unused", [_int("A"), _int("B"), _int("C")], [_int("S"), _int("D")],
                               [_step("simple", ADD_SUB, {"OUTPUT0": "S", "OUTPUT1": "D"})]),
}


SQUARE_CONFIG = """name: "ens_square"
backend: "python"
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
"""
SQUARE_MODEL = '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUTPUT", pb_utils.get_input_tensor_by_name(r, "INPUT").as_numpy() ** 2)]) for r in requests]
'''


# ens_double's model with one more output: the PID of the process that executed it. Dedicated on
# the session server (which pools what it can): a pooled member does not run in place.
PID_DOUBLE_CONFIG = DOUBLE_CONFIG.replace("{name}", "ens_pid_double").replace(
    'output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 16 ] } ]',
    'output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] } ]'
) + 'parameters { key: "rayinfer_hosting" value: { string_value: "dedicated" } }\n'  # in place: not pooled
PID_DOUBLE_MODEL = DOUBLE_MODEL.replace("import numpy as np", "import os\n\nimport numpy as np").replace(
    '[pb_utils.Tensor("OUTPUT", (2 * x).astype(np.int32))]',
    '[pb_utils.Tensor("OUTPUT", (2 * x).astype(np.int32)),\n'
    '                                                             pb_utils.Tensor("PID", np.full((len(x), 1), os.getpid(), np.int64))]')


def write_ensemble_models(root: Path) -> None:
    for name, config in ENSEMBLES.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
    for name in ("ens_double", "ens_on_demand_member"):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(DOUBLE_CONFIG.replace("{name}", name))
        (root / name / "1" / "model.py").write_text(DOUBLE_MODEL)
    (root / "ens_pid_double" / "1").mkdir(parents=True)
    (root / "ens_pid_double" / "config.pbtxt").write_text(PID_DOUBLE_CONFIG)
    (root / "ens_pid_double" / "1" / "model.py").write_text(PID_DOUBLE_MODEL)
    (root / "ens_square" / "1").mkdir(parents=True)
    (root / "ens_square" / "config.pbtxt").write_text(SQUARE_CONFIG)
    (root / "ens_square" / "1" / "model.py").write_text(SQUARE_MODEL)


# Members of no ensemble here but their own.
MEMBERS = ("ens_double", "ens_on_demand_member", "ens_square", "ens_pid_double")
# The example repository's text pipeline.
NLP_MODELS = ("nlp_tokenizer", "nlp_encoder", "nlp_head", "nlp_ensemble")
# Not loaded at start: loaded by tests through the repository API, or (the text pipeline) by
# test_triton_example_repository's own server.
ENSEMBLE_NOT_LOADED_AT_START = (
    "ensbad_unknown_model", "ensbad_dtype", "ensbad_unmapped", "ensbad_batch", "ensbad_cycle", "ensbad_unused",
    "ens_on_demand", "ens_on_demand_member", "ens_pooled", *NLP_MODELS,
)
# Unloaded when test_ensembles ends, so that the tests after it do not share the two cores with
# these replicas (they load at start, in parallel, which costs less than loading them one by one).
ENSEMBLE_MODELS = tuple(m for m in (*ENSEMBLES, *MEMBERS) if m not in ENSEMBLE_NOT_LOADED_AT_START)
