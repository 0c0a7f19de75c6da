"""Builds the test model repository: small ONNX models covering the features under test."""

from __future__ import annotations

from pathlib import Path

from onnx import TensorProto, helper

from backend_models import write_backend_test_models
from ensemble_models import write_ensemble_models
from python_models import write_python_models
from rollout_models import write_rollout_models
from schedule_models import write_schedule_models
from sequence_models import write_sequence_test_models
from torchscript_models import write_torchscript_models
from rayinfer.cluster.example_backends import write_backend_examples
from rayinfer.cluster.example_repository import add_sub_model, finish_onnx, write_example_repository, write_model

ADD_SUB_IO = """input [
  { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] }
]
"""

# Model name -> config.pbtxt; every one runs add_sub_model(INT32) unless built otherwise below.
CONFIGS = {
    # Long queue delay: concurrent requests are merged into batches larger than 1.
    "batched": 'backend: "onnxruntime"\nmax_batch_size: 8\n' + ADD_SUB_IO
    + "dynamic_batching { max_queue_delay_microseconds: 300000 }\n",
    # A preferred size is dispatched at once instead of waiting out the (very long) delay.
    "preferred": 'backend: "onnxruntime"\nmax_batch_size: 8\n' + ADD_SUB_IO
    + "dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 5000000 }\n",
    "nobatch": 'platform: "onnxruntime_onnx"\nmax_batch_size: 0\n' + ADD_SUB_IO,
    # The response cache, shared by its two replicas (the server runs with --cache-config).
    "cached": 'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n' + ADD_SUB_IO
    + "instance_group [ { count: 2 kind: KIND_CPU } ]\nresponse_cache { enable: true }\n",
    "on_demand": 'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n' + ADD_SUB_IO,
    "versioned": 'platform: "onnxruntime_onnx"\nmax_batch_size: 8\nversion_policy: { all { } }\n' + ADD_SUB_IO,
    "broken_config": 'platform: "onnxruntime_onnx"\nmax_batch_size: 8\ninput [ { name: "INPUT0" ',
    "missing_file": 'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n' + ADD_SUB_IO,
    "corrupt": 'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n' + ADD_SUB_IO,
    # A TensorRT plan on this CPU-only server: reported UNAVAILABLE, saying it needs a GPU.
    "plan_without_gpu": 'platform: "tensorrt_plan"\nmax_batch_size: 8\n' + ADD_SUB_IO,
    "vardims": """backend: "onnxruntime"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 300000 }
""",
    # Y = 2 X with class labels: Triton's classification extension (tests/compat/test_classification.py).
    "classes": """backend: "onnxruntime"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] label_filename: "labels.txt" } ]
""",
}
# The labels of "classes": classes 0-3 are named, class 4 has an empty line, later ones none.
CLASS_LABELS = "zero\none\ntwo\nthree\n\n"


def double_model():
    """Y = X + X on [batch, n] FP32 with a variable n."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "X"], ["Y"])], "double",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", "n"])],
    )
    return finish_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def mul_sub_model():
    """Version 2 of ``versioned``: OUTPUT0 = INPUT0 * INPUT1, OUTPUT1 = INPUT0 - INPUT1."""
    shape = ["batch", 16]
    graph = helper.make_graph(
        [helper.make_node("Mul", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
         helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])], "mul_sub",
        [helper.make_tensor_value_info(n, TensorProto.INT32, shape) for n in ("INPUT0", "INPUT1")],
        [helper.make_tensor_value_info(n, TensorProto.INT32, shape) for n in ("OUTPUT0", "OUTPUT1")],
    )
    return finish_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


# Copies of the "on_demand" model that the test server does not load at start (explicit model
# control). Each test that loads, reloads or unloads a model on demand (or needs one never
# loaded) has its own copy, so that no test depends on what another left loaded or unloaded.
ON_DEMAND_MODELS = tuple(f"on_demand_{suffix}" for suffix in (
    "never_loaded",    # test_model_control: a model not named at start is unloaded
    "load_unload",     # test_model_control: load serves the model and unload removes it
    "reload_http",     # test_model_control: reloading under traffic, one copy per protocol
    "reload_grpc",
    "override",        # test_model_control: load with a config override
    "bad_parameters",  # test_model_control: load requests refused (never loaded)
    "bad_paths",       # test_model_control: file parameters outside the model folder (never loaded)
    "files",           # test_model_control: load with model files in the request
    "grpc_override",   # test_tritonclient_grpc: load, override and unload
    "grpc_files",      # test_tritonclient_grpc: files, a partial override and bad paths
    "poll_added",      # test_poll_mode: copied into the poll server's own repository
    "bls_control",     # test_python_bls: loaded and unloaded by a Python model (pb_utils)
    "replica_loss",    # test_model_control: one of two replicas killed under traffic
    "pool_a",          # test_model_pool: served in the model pool (a config override asks for it)
    "pool_b",
    "pool_c",
    "pool_d",          # test_model_pool: one more than --pool-max-models (3) on the test server
    "pool_broken",     # test_model_pool: fails to load in the pool, its neighbours serve on
))


# Served dedicated whatever the session server's --model-hosting (pool): the default hosting's
# own mechanisms (a reload's new replicas, replicas started and stopped) under traffic.
DEDICATED_ON_DEMAND = ("on_demand_load_unload", "on_demand_reload_http", "on_demand_reload_grpc")
DEDICATED = 'parameters { key: "rayinfer_hosting" value: { string_value: "dedicated" } }\n'


def on_demand(suffix: str) -> str:
    """The name of the on-demand model ``on_demand_<suffix>`` (one of ``ON_DEMAND_MODELS``)."""
    name = f"on_demand_{suffix}"
    if name not in ON_DEMAND_MODELS:
        raise ValueError(f"no on-demand model {name!r} in the test repository; add it to ON_DEMAND_MODELS")
    return name


def build_test_repository(root: Path) -> Path:
    """The example repository plus the models above; returns its path."""
    write_example_repository(root)
    add_sub = add_sub_model(TensorProto.INT32)
    for name in ("batched", "preferred", "versioned", "corrupt", "cached"):
        write_model(root, name, CONFIGS[name], add_sub)
    for name in ON_DEMAND_MODELS:
        write_model(root, name, CONFIGS["on_demand"] + (DEDICATED if name in DEDICATED_ON_DEMAND else ""), add_sub)
    write_model(root, "nobatch", CONFIGS["nobatch"], add_sub_model(TensorProto.INT32, batch=False))
    write_model(root, "versioned", None, mul_sub_model(), version=2)
    write_model(root, "vardims", CONFIGS["vardims"], double_model())
    write_model(root, "classes", CONFIGS["classes"], double_model())
    (root / "classes" / "labels.txt").write_text(CLASS_LABELS)
    write_model(root, "autocomplete", None, add_sub)  # no config.pbtxt at all
    (root / "corrupt" / "1" / "model.onnx").write_bytes(b"this is not an ONNX model")
    (root / "plan_without_gpu" / "1").mkdir(parents=True)
    (root / "plan_without_gpu" / "config.pbtxt").write_text(CONFIGS["plan_without_gpu"])
    (root / "plan_without_gpu" / "1" / "model.plan").write_bytes(b"a TensorRT engine would be here")
    (root / "broken_config" / "1").mkdir(parents=True)
    (root / "broken_config" / "config.pbtxt").write_text(CONFIGS["broken_config"])
    (root / "missing_file" / "1").mkdir(parents=True)
    (root / "missing_file" / "config.pbtxt").write_text(CONFIGS["missing_file"])
    write_python_models(root)
    write_rollout_models(root)
    write_torchscript_models(root)
    write_ensemble_models(root)
    write_schedule_models(root)
    write_sequence_test_models(root)
    write_backend_examples(root)
    write_backend_test_models(root)
    return root
