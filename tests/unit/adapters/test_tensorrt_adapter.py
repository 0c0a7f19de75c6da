"""TensorRT backend: Triton's rules on an engine's I/O (auto-complete, config checks, profiles)
without TensorRT, the errors of a replica that cannot run a plan, and, on a GPU with TensorRT,
an engine built from ONNX served through the loader."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from rayinfer.adapters.base import create_adapter
from rayinfer.adapters.loader import load_runner
from rayinfer.adapters.tensorrt.engine_io import (
    EngineTensor, Profile, allowed_profiles, auto_complete, check_config, pick_profile,
)
from rayinfer.protocol.errors import InvalidArgError, ModelConfigError
from rayinfer.protocol.types import InferInput, InferRequest
from rayinfer.repository.model_config import ModelConfig, mc

PATH = Path("m/config.pbtxt")
SMALL = Profile((1, 16), (4, 16), (8, 16))
LARGE = Profile((9, 16), (16, 16), (32, 16))


def batching_engine() -> list[EngineTensor]:
    return [
        EngineTensor("INPUT0", True, "FLOAT", (-1, 16), [SMALL, LARGE]),
        EngineTensor("INPUT1", True, "FLOAT", (-1, 16), [SMALL, LARGE]),
        EngineTensor("OUTPUT0", False, "FLOAT", (-1, 16)),
        EngineTensor("OUTPUT1", False, "HALF", (-1, 16)),
    ]


def config(text: str = "") -> ModelConfig:
    return text_format.Parse('name: "plan"\nplatform: "tensorrt_plan"\n' + text, ModelConfig())


def test_registry_knows_tensorrt() -> None:
    assert type(create_adapter("tensorrt")).__name__ == "TensorRTAdapter"


def test_auto_complete_from_a_batching_engine() -> None:
    filled = config()
    auto_complete(filled, batching_engine(), [0, 1])
    assert filled.max_batch_size == 32 and filled.HasField("dynamic_batching")
    assert [(t.name, list(t.dims)) for t in filled.input] == [("INPUT0", [16]), ("INPUT1", [16])]
    assert [mc.DataType.Name(t.data_type) for t in filled.output] == ["TYPE_FP32", "TYPE_FP16"]
    only_small = config()
    auto_complete(only_small, batching_engine(), [0])
    assert only_small.max_batch_size == 8


def test_auto_complete_from_a_fixed_shape_engine() -> None:
    fixed = [EngineTensor("X", True, "INT32", (2, 3), [Profile((2, 3), (2, 3), (2, 3))]),
             EngineTensor("Y", False, "INT32", (2, 3))]
    filled = config()
    auto_complete(filled, fixed, [0])
    assert filled.max_batch_size == 0 and not filled.HasField("dynamic_batching")
    assert [list(t.dims) for t in (*filled.input, *filled.output)] == [[2, 3], [2, 3]]


@pytest.mark.parametrize(("text", "message"), [
    ('max_batch_size: 8\ninput [ { name: "X" data_type: TYPE_FP32 dims: [ 16 ] } ]',
     "unexpected inference input 'X', allowed inputs are: INPUT0, INPUT1"),
    ('max_batch_size: 8\ninput [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]',
     "input 'INPUT0' is FLOAT in the engine but TYPE_INT32 in the config"),
    ('max_batch_size: 0\ninput [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]',
     "input 'INPUT0' has 2 dimensions [-1, 16] in the engine, but the config gives 1"),
    ('max_batch_size: 64', "max_batch_size 64 is larger than the engine's optimization profiles allow (32)"),
])
def test_config_checked_against_the_engine(text: str, message: str) -> None:
    with pytest.raises(ModelConfigError, match=re.escape(message)):
        check_config(config(text), batching_engine(), [0, 1], PATH)


def test_batching_config_on_an_engine_that_cannot_batch() -> None:
    fixed = [EngineTensor("X", True, "FLOAT", (2, 3), [Profile((2, 3), (2, 3), (2, 3))])]
    with pytest.raises(ModelConfigError, match="first dimensions are not all dynamic, so it cannot batch"):
        check_config(config("max_batch_size: 4"), fixed, [0], PATH)


def test_instance_group_profiles() -> None:
    assert allowed_profiles(config(), 2, PATH) == [0, 1]
    assert allowed_profiles(config('instance_group [ { kind: KIND_GPU profile: [ "1" ] } ]'), 2, PATH) == [1]
    with pytest.raises(ModelConfigError, match="profile '2' is not one of the engine's 2 optimization profiles"):
        allowed_profiles(config('instance_group [ { kind: KIND_GPU profile: [ "2" ] } ]'), 2, PATH)


def test_profile_choice() -> None:
    engine = batching_engine()
    small, large = {"INPUT0": (3, 16), "INPUT1": (3, 16)}, {"INPUT0": (20, 16), "INPUT1": (20, 16)}
    assert pick_profile("plan", engine, small, [0, 1], current=0) == 0
    assert pick_profile("plan", engine, large, [0, 1], current=0) == 1
    assert pick_profile("plan", engine, {"INPUT0": (9, 16), "INPUT1": (9, 16)}, [0, 1], current=1) == 1
    with pytest.raises(InvalidArgError, match=r"input 'INPUT0' shape \[40, 16\] is outside the engine's optimization "
                                              r"profiles \(profile 0: min \[1, 16\] max \[8, 16\]; profile 1"):
        pick_profile("plan", engine, {"INPUT0": (40, 16), "INPUT1": (40, 16)}, [0, 1], current=0)


def write_plan(root: Path, name: str, plan: bytes, text: str = "") -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text('platform: "tensorrt_plan"\n' + text)
    (root / name / "1" / "model.plan").write_bytes(plan)


def test_a_replica_without_a_gpu_says_the_plan_needs_one(tmp_path: Path) -> None:
    write_plan(tmp_path, "plan", b"not an engine")
    with pytest.raises(ModelConfigError, match="'plan' is a TensorRT plan and needs a GPU, but its replica has none"):
        load_runner(tmp_path, "plan", 1, on_gpu=False)


def test_without_tensorrt_the_error_names_the_extra(tmp_path: Path, monkeypatch) -> None:
    write_plan(tmp_path, "plan", b"not an engine", 'instance_group [ { kind: KIND_GPU } ]\n')
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt now raises ImportError
    with pytest.raises(ModelConfigError, match=r"needs TensorRT: install rayinfer with the gpu extra"):
        load_runner(tmp_path, "plan", 1, on_gpu=True)


def _gpu_with_tensorrt() -> bool:
    try:
        import tensorrt  # noqa: F401
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _gpu_with_tensorrt(), reason="needs an NVIDIA GPU and TensorRT (the gpu extra)")
def test_engine_built_from_onnx_serves_through_the_loader(tmp_path: Path) -> None:
    import tensorrt as trt
    from onnx import TensorProto

    from rayinfer.cluster.example_repository import add_sub_model

    log = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(log)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, log)
    assert parser.parse(add_sub_model(TensorProto.FLOAT).SerializeToString()), parser.get_error(0)
    build = builder.create_builder_config()
    for profile_range in (SMALL, LARGE):
        profile = builder.create_optimization_profile()
        for name in ("INPUT0", "INPUT1"):
            profile.set_shape(name, profile_range.min, profile_range.opt, profile_range.max)
        build.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, build)
    assert plan is not None
    write_plan(tmp_path, "plan", bytes(plan), 'instance_group [ { kind: KIND_GPU } ]\n')
    runner, _ = load_runner(tmp_path, "plan", 1, on_gpu=True)
    assert runner.spec.max_batch_size == 32  # auto-completed from the profiles

    def infer(rows: int) -> dict:
        a = np.arange(rows * 16, dtype=np.float32).reshape(rows, 16)
        b = np.full((rows, 16), 2, np.float32)
        request = InferRequest(model_name="plan", inputs=[InferInput("INPUT0", "FP32", a.shape, a),
                                                          InferInput("INPUT1", "FP32", b.shape, b)])
        result = runner.execute([runner.prepare(request)])[0]
        if isinstance(result, Exception):
            raise result
        out = {o.name: o.data for o in result.outputs}
        np.testing.assert_array_equal(out["OUTPUT0"], a + b)
        np.testing.assert_array_equal(out["OUTPUT1"], a - b)
        return out

    infer(3)  # profile 0
    infer(20)  # profile 1
    infer(1)  # back to profile 0
    runner.adapter.unload()
