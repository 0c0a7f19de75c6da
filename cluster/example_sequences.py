"""Stateful example models for Triton's sequence batcher, built in code (ONNX, no weights).

They answer as Triton's own sequence examples do, so that Triton's sequence client examples
(``simple_*_sequence_*_client.py``, with and without ``--dyna``) run unmodified:

- ``simple_sequence`` (direct strategy; START and READY controls; integer or string sequence
  ids): OUTPUT = INPUT + 1 on a sequence's first request, else INPUT.
- ``simple_dyna_sequence`` (oldest strategy; START, END, READY and a UINT64 CORRID control):
  as ``simple_sequence``, plus the correlation id on the last request.
- ``simple_string_dyna_sequence`` (oldest; a string CORRID; implicit state): an accumulator,
  OUTPUT = the sum of the sequence's inputs so far, plus the (numeric) correlation id on the last
  request. The running sum is the model's implicit state (``sequence_batching.state``): the
  server keeps it between a sequence's requests.
"""

from __future__ import annotations

from pathlib import Path

from rayinfer.cluster.model_files import finish_onnx, write_model

_CONTROLS = {
    "START": 'control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]',
    "END": 'control_input [ { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] } ]',
    "READY": 'control_input [ { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] } ]',
}


def _config(name: str, strategy: str, controls: list[str], extra: str = "") -> str:
    lines = "\n  ".join([strategy] + [_CONTROLS[c] for c in controls] + ([extra] if extra else []))
    return f"""name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {{
  max_sequence_idle_microseconds: 5000000
  {lines}
}}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU }} ]
"""


SIMPLE_SEQUENCE_CONFIG = _config("simple_sequence", "direct { }", ["START", "READY"])
SIMPLE_DYNA_SEQUENCE_CONFIG = _config(
    "simple_dyna_sequence", "oldest { max_candidate_sequences: 8 }", ["START", "END", "READY"],
    'control_input [ { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] } ]')
SIMPLE_STRING_DYNA_SEQUENCE_CONFIG = _config(
    "simple_string_dyna_sequence", "oldest { max_candidate_sequences: 8 }", ["START", "END", "READY"],
    'control_input [ { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] } ]\n'
    '  state [ { input_name: "SUM_IN" output_name: "SUM_OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]')


def _graph(name: str, nodes: list, inputs: list[tuple[str, int]], outputs: list[str]):
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info(n, t, ["batch", 1]) for n, t in inputs],
        [helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", 1]) for n in outputs],
    )
    return finish_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def simple_sequence_model():
    """OUTPUT = INPUT + START."""
    from onnx import TensorProto as T, helper

    nodes = [helper.make_node("Add", ["INPUT", "START"], ["OUTPUT"])]
    return _graph("simple_sequence", nodes, [("INPUT", T.INT32), ("START", T.INT32), ("READY", T.INT32)], ["OUTPUT"])


def simple_dyna_sequence_model():
    """OUTPUT = INPUT + START + END * CORRID."""
    from onnx import TensorProto as T, helper

    nodes = [
        helper.make_node("Cast", ["CORRID"], ["corrid"], to=T.INT32),
        helper.make_node("Mul", ["END", "corrid"], ["last"]),
        helper.make_node("Add", ["INPUT", "START"], ["first"]),
        helper.make_node("Add", ["first", "last"], ["OUTPUT"]),
    ]
    inputs = [("INPUT", T.INT32), ("START", T.INT32), ("END", T.INT32), ("READY", T.INT32), ("CORRID", T.UINT64)]
    return _graph("simple_dyna_sequence", nodes, inputs, ["OUTPUT"])


def string_dyna_sequence_model():
    """SUM_OUT = INPUT + (START ? 0 : SUM_IN); OUTPUT = SUM_OUT + END * int(CORRID)."""
    from onnx import TensorProto as T, helper

    nodes = [
        helper.make_node("Cast", ["START"], ["start"], to=T.BOOL),
        helper.make_node("Add", ["SUM_IN", "INPUT"], ["added"]),
        helper.make_node("Where", ["start", "INPUT", "added"], ["SUM_OUT"]),
        helper.make_node("Cast", ["CORRID"], ["corrid"], to=T.INT32),
        helper.make_node("Mul", ["END", "corrid"], ["last"]),
        helper.make_node("Add", ["SUM_OUT", "last"], ["OUTPUT"]),
    ]
    inputs = [("INPUT", T.INT32), ("START", T.INT32), ("END", T.INT32), ("READY", T.INT32),
              ("CORRID", T.STRING), ("SUM_IN", T.INT32)]
    return _graph("simple_string_dyna_sequence", nodes, inputs, ["OUTPUT", "SUM_OUT"])


def write_sequence_models(repository: Path) -> list[Path]:
    """The three sequence models; returns their folders."""
    return [
        write_model(repository, "simple_sequence", SIMPLE_SEQUENCE_CONFIG, simple_sequence_model()),
        write_model(repository, "simple_dyna_sequence", SIMPLE_DYNA_SEQUENCE_CONFIG, simple_dyna_sequence_model()),
        write_model(repository, "simple_string_dyna_sequence", SIMPLE_STRING_DYNA_SEQUENCE_CONFIG,
                    string_dyna_sequence_model()),
    ]
