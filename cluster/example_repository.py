"""Writes the example model repository: small models built in code, no downloaded weights.

``simple``, ``simple_string`` and ``simple_identity`` have the names, tensors and semantics of
Triton's own example models, so Triton's HTTP client examples for them run unmodified
(``simple_identity`` is a Python model, ``model.py``); ``mlp`` is the benchmark MLP
(256 -> 1024 -> 1024 -> 10) with dynamic batching; ``nlp_ensemble`` is a text pipeline of
three models (:mod:`example_nlp`); ``simple_sequence``, ``simple_dyna_sequence`` and
``simple_string_dyna_sequence`` are stateful models for Triton's sequence client examples
(:mod:`example_sequences`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rayinfer.cluster.model_files import finish_onnx, write_model, write_python_model

__all__ = ["add_sub_model", "finish_onnx", "mlp_model", "write_example_repository", "write_model", "write_python_model"]

SIMPLE_CONFIG = """name: "simple"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
"""

SIMPLE_STRING_CONFIG = """name: "simple_string"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_STRING dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_STRING dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_STRING dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_STRING dims: [ 16 ] }
]
"""

SIMPLE_IDENTITY_CONFIG = """name: "simple_identity"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
"""

# A Python model (Triton's Python backend): the whole dynamic batch arrives as a list of requests.
SIMPLE_IDENTITY_MODEL = '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """OUTPUT0 = INPUT0, BYTES elements as numpy object arrays."""

    def execute(self, requests):
        responses = []
        for request in requests:
            data = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", data)]))
        return responses
'''

MLP_CONFIG = """name: "mlp"
backend: "onnxruntime"
max_batch_size: 64
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 256 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 10 ] } ]
dynamic_batching { max_queue_delay_microseconds: 500 }
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "intra_op_thread_count" value: { string_value: "1" } }
"""


def add_sub_model(elem_type: int, batch: bool = True):
    """OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1 on [batch, 16] tensors.

    For string tensors the inputs are parsed as integers and the results written back as
    strings, as Triton's ``simple_string`` does.
    """
    from onnx import TensorProto, helper

    shape = ["batch", 16] if batch else [16]
    nodes = []
    a, b = "INPUT0", "INPUT1"
    if elem_type == TensorProto.STRING:
        nodes += [helper.make_node("Cast", ["INPUT0"], ["a"], to=TensorProto.INT32),
                  helper.make_node("Cast", ["INPUT1"], ["b"], to=TensorProto.INT32)]
        a, b = "a", "b"
        sum_name, diff_name = "sum", "diff"
    else:
        sum_name, diff_name = "OUTPUT0", "OUTPUT1"
    nodes += [helper.make_node("Add", [a, b], [sum_name]), helper.make_node("Sub", [a, b], [diff_name])]
    if elem_type == TensorProto.STRING:
        nodes += [helper.make_node("Cast", ["sum"], ["OUTPUT0"], to=TensorProto.STRING),
                  helper.make_node("Cast", ["diff"], ["OUTPUT1"], to=TensorProto.STRING)]
    graph = helper.make_graph(
        nodes, "add_sub",
        [helper.make_tensor_value_info(n, elem_type, shape) for n in ("INPUT0", "INPUT1")],
        [helper.make_tensor_value_info(n, elem_type, shape) for n in ("OUTPUT0", "OUTPUT1")],
    )
    return finish_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def mlp_model(dims: tuple[int, ...] = (256, 1024, 1024, 10), seed: int = 0):
    """FP32 MLP with ReLU between Gemm layers; weights from a fixed seed."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits, nodes, x = [], [], "INPUT0"
    for i in range(len(dims) - 1):
        w = (rng.standard_normal((dims[i], dims[i + 1])) / np.sqrt(dims[i])).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"W{i}"),
                  numpy_helper.from_array(np.zeros(dims[i + 1], np.float32), f"B{i}")]
        last = i == len(dims) - 2
        y = "OUTPUT0" if last else f"h{i}"
        nodes.append(helper.make_node("Gemm", [x, f"W{i}", f"B{i}"], [y if last else f"g{i}"]))
        if not last:
            nodes.append(helper.make_node("Relu", [f"g{i}"], [y]))
        x = y
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", dims[0]])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", dims[-1]])],
        initializer=inits,
    )
    return finish_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def write_example_repository(repository: Path) -> list[Path]:
    """Create the example repository (idempotent) and return the model folders written."""
    from onnx import TensorProto

    from rayinfer.cluster.example_llm import write_language_model
    from rayinfer.cluster.example_nlp import write_nlp_pipeline
    from rayinfer.cluster.example_sequences import write_sequence_models

    return [
        write_model(repository, "simple", SIMPLE_CONFIG, add_sub_model(TensorProto.INT32)),
        write_model(repository, "simple_string", SIMPLE_STRING_CONFIG, add_sub_model(TensorProto.STRING)),
        write_python_model(repository, "simple_identity", SIMPLE_IDENTITY_CONFIG, SIMPLE_IDENTITY_MODEL),
        write_model(repository, "mlp", MLP_CONFIG, mlp_model()),
        *write_nlp_pipeline(repository),
        *write_language_model(repository),
        *write_sequence_models(repository),
    ]
