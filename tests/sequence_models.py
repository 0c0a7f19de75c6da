"""Models of the test repository for the sequence batcher (tests/compat/test_sequences.py).

- ``seq_state_direct`` (ONNX, direct strategy, four slots): an accumulator kept in the model's
  implicit state, ``ACC_OUT = ACC_IN + INPUT * READY``, whose initial state (100) is read from
  ``initial_state/start_value``.
- ``seq_ensemble``: an ensemble whose one step is ``seq_state_direct`` (its sequences pass
  through).
- ``seq_python`` (a Python model, oldest strategy): keeps a running sum per correlation id in
  the model itself (string ids), and answers with the sum and the request's flags.
- ``seq_stream`` (a decoupled Python model, two replicas): keeps a running sum per correlation
  id and answers each request twice (PART 0, then 1) with the sum and its process id, so a
  request that reached the replica not holding its sequence shows whether its responses were
  relayed from the one that does.
- ``seq_growing`` (ONNX, direct strategy, one slot, one replica): its implicit state grows by
  one element per request (``HISTORY_OUT = Concat(HISTORY_IN, INPUT)``, state dims ``[ -1 ]``,
  Triton's ``use_growable_memory``), and its answer is the whole history.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rayinfer.cluster.model_files import finish_onnx, write_model, write_python_model

INITIAL_VALUE = 100

SEQ_STATE_DIRECT_CONFIG = """name: "seq_state_direct"
platform: "onnxruntime_onnx"
max_batch_size: 4
sequence_batching {
  direct { }
  control_input [ { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] } ]
  state [ {
    input_name: "ACC_IN" output_name: "ACC_OUT" data_type: TYPE_INT32 dims: [ 1 ]
    initial_state { name: "start" data_type: TYPE_INT32 dims: [ 1 ] data_file: "start_value" }
  } ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""

# test_model_pool: the same accumulator in the model pool (one instance), loaded by the test; its
# sequences stay open for a minute of idleness while the test makes the pool unload others.
SEQ_POOLED_CONFIG = (SEQ_STATE_DIRECT_CONFIG.replace('name: "seq_state_direct"', 'name: "seq_pooled"')
                     .replace("direct { }", "direct { }\n  max_sequence_idle_microseconds: 60000000")
                     .replace("count: 2 kind: KIND_CPU", "count: 1 kind: KIND_CPU")
                     + 'parameters { key: "rayinfer_hosting" value: { string_value: "pool" } }\n')
SEQUENCE_NOT_LOADED_AT_START = ("seq_pooled",)

SEQ_PYTHON_CONFIG = """name: "seq_python"
backend: "python"
max_batch_size: 4
sequence_batching {
  oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 1000 }
  # Sequences outlive a replica's replacement in the tests (Triton's default is 1 s).
  max_sequence_idle_microseconds: 120000000
  control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START bool_false_true: [ false, true ] } ] } ]
  control_input [ { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] } ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "FLAGS" data_type: TYPE_INT32 dims: [ 1 ] },
          { name: "PID" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""

SEQ_PYTHON_MODEL = '''import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            sequence = request.correlation_id()
            corrid = pb_utils.get_input_tensor_by_name(request, "CORRID").as_numpy()[0, 0]
            start = bool(pb_utils.get_input_tensor_by_name(request, "START").as_numpy()[0, 0])
            # A string CORRID control holds "" for an integer correlation id (Triton's rule).
            if corrid.decode() != (sequence if isinstance(sequence, str) else "") or start != bool(request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START):
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("control inputs disagree with the request")))
                continue
            value = int(pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()[0, 0])
            total = value if start else self.sums[sequence] + value
            self.sums[sequence] = total
            if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
                del self.sums[sequence]
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", np.array([[total]], np.int32)),
                pb_utils.Tensor("FLAGS", np.array([[request.flags()]], np.int32)),
                pb_utils.Tensor("PID", np.array([[os.getpid()]], np.int32)),
            ]))
        return responses
'''


def seq_state_direct_model():
    from onnx import TensorProto as T, helper

    nodes = [helper.make_node("Mul", ["INPUT", "READY"], ["added"]),
             helper.make_node("Add", ["ACC_IN", "added"], ["ACC_OUT"]),
             helper.make_node("Identity", ["ACC_OUT"], ["OUTPUT"])]
    graph = helper.make_graph(
        nodes, "seq_state_direct",
        [helper.make_tensor_value_info(n, T.INT32, ["batch", 1]) for n in ("INPUT", "READY", "ACC_IN")],
        [helper.make_tensor_value_info(n, T.INT32, ["batch", 1]) for n in ("OUTPUT", "ACC_OUT")],
    )
    return finish_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


SEQ_STREAM_CONFIG = """name: "seq_stream"
backend: "python"
max_batch_size: 4
model_transaction_policy { decoupled: true }
sequence_batching {
  oldest { max_candidate_sequences: 8 }
  max_sequence_idle_microseconds: 120000000
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "PART" data_type: TYPE_INT32 dims: [ 1 ] },
          { name: "PID" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""

SEQ_STREAM_MODEL = '''import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.sums = {}

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            sequence = request.correlation_id()
            value = int(pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()[0, 0])
            if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                self.sums[sequence] = 0
            self.sums[sequence] += value
            for part in (0, 1):
                sender.send(pb_utils.InferenceResponse([
                    pb_utils.Tensor("SUM", np.array([[self.sums[sequence]]], np.int32)),
                    pb_utils.Tensor("PART", np.array([[part]], np.int32)),
                    pb_utils.Tensor("PID", np.array([[os.getpid()]], np.int32)),
                ]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END:
                del self.sums[sequence]
        return None
'''

SEQ_GROWING_CONFIG = """name: "seq_growing"
platform: "onnxruntime_onnx"
max_batch_size: 1
sequence_batching {
  direct { }
  max_sequence_idle_microseconds: 120000000
  state [ {
    input_name: "HISTORY_IN" output_name: "HISTORY_OUT" data_type: TYPE_INT32 dims: [ -1 ]
    initial_state { name: "empty" data_type: TYPE_INT32 dims: [ 1 ] zero_data: true }
    use_same_buffer_for_input_output: true
    use_growable_memory: true
  } ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "HISTORY" data_type: TYPE_INT32 dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


def seq_growing_model():
    from onnx import TensorProto as T, helper

    nodes = [helper.make_node("Concat", ["HISTORY_IN", "INPUT"], ["HISTORY_OUT"], axis=1),
             helper.make_node("Identity", ["HISTORY_OUT"], ["HISTORY"])]
    graph = helper.make_graph(
        nodes, "seq_growing",
        [helper.make_tensor_value_info("INPUT", T.INT32, ["batch", 1]),
         helper.make_tensor_value_info("HISTORY_IN", T.INT32, ["batch", "length"])],
        [helper.make_tensor_value_info(n, T.INT32, ["batch", "grown"]) for n in ("HISTORY_OUT", "HISTORY")],
    )
    return finish_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


SEQ_ENSEMBLE_CONFIG = """name: "seq_ensemble"
platform: "ensemble"
max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "TOTAL" data_type: TYPE_INT32 dims: [ 1 ] } ]
ensemble_scheduling { step [ {
  model_name: "seq_state_direct" model_version: -1
  input_map { key: "INPUT" value: "INPUT" }
  output_map { key: "OUTPUT" value: "TOTAL" }
} ] }
"""


# Iterative sequences (Triton's request rescheduling): a request runs again until its countdown
# reaches zero. ``iter_countdown`` (not decoupled) answers once, with how many times it ran;
# ``iter_stream`` (decoupled) answers each run with what is left; ``iter_not_iterative``
# reschedules without iterative_sequence (Triton's error).
ITER_CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 0
{scheduling}
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }}, {{ name: "CORRID" data_type: TYPE_INT64 dims: [ 1 ] }} ]
{policy}
"""
ITERATIVE = "sequence_batching { iterative_sequence: true }"
ITER_MODEL = '''import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))
        self.runs = {}  # correlation id -> executions so far

    def execute(self, requests):
        responses = []
        for request in requests:
            key = request.correlation_id()
            start = bool(request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START)
            runs = self.runs[key] = (0 if start or key not in self.runs else self.runs[key]) + 1
            left = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0]) - runs
            out = left if self.decoupled else runs
            response = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([out], np.int32)),
                                                   pb_utils.Tensor("CORRID", np.array([key if isinstance(key, int) else -1], np.int64))])
            if left > 0:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
            if self.decoupled:
                request.get_response_sender().send(response, flags=0 if left > 0 else pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                responses.append(None if left > 0 else response)
        return None if self.decoupled else responses
'''


def write_sequence_test_models(root: Path) -> None:
    decoupled = "model_transaction_policy { decoupled: true }"
    for name, scheduling, policy in (("iter_countdown", ITERATIVE, ""), ("iter_stream", ITERATIVE, decoupled),
                                     ("iter_not_iterative", "", "")):
        write_python_model(root, name, ITER_CONFIG.format(name=name, scheduling=scheduling, policy=policy), ITER_MODEL)
    for name, config in (("seq_state_direct", SEQ_STATE_DIRECT_CONFIG), ("seq_pooled", SEQ_POOLED_CONFIG)):
        folder = write_model(root, name, config, seq_state_direct_model())
        (folder / "initial_state").mkdir(exist_ok=True)
        (folder / "initial_state" / "start_value").write_bytes(np.array([INITIAL_VALUE], "<i4").tobytes())
    write_python_model(root, "seq_python", SEQ_PYTHON_CONFIG, SEQ_PYTHON_MODEL)
    write_model(root, "seq_growing", SEQ_GROWING_CONFIG, seq_growing_model())
    write_python_model(root, "seq_stream", SEQ_STREAM_CONFIG, SEQ_STREAM_MODEL)
    (root / "seq_ensemble" / "1").mkdir(parents=True, exist_ok=True)
    (root / "seq_ensemble" / "config.pbtxt").write_text(SEQ_ENSEMBLE_CONFIG)
