"""Which models the pool may host, and the ``rayinfer_hosting`` parameter's rules."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format

from rayinfer.protocol.errors import ModelConfigError
from rayinfer.repository.hosting import model_hosting, pool_obstacle
from rayinfer.repository.instance_groups import ReplicaPlan
from rayinfer.repository.model_config import ModelConfig, fill_defaults

PATH = Path("/models/m/config.pbtxt")
ONE_CPU = ReplicaPlan(1, "KIND_CPU")


def config(text: str) -> ModelConfig:
    parsed = text_format.Parse('name: "m"\n' + text, ModelConfig())
    fill_defaults(parsed)
    return parsed


def hosting(text: str, server: str = "dedicated", plan: ReplicaPlan = ONE_CPU) -> str:
    return model_hosting(config(text), PATH, plan, server)


ONNX = 'platform: "onnxruntime_onnx"\n'


def test_the_server_default_pools_only_models_that_need_nothing_of_their_own() -> None:
    assert hosting(ONNX) == "dedicated"
    assert hosting(ONNX, "pool") == "pool"
    for text, plan in [
        ('backend: "python"\n', ONE_CPU),
        (ONNX + "sequence_batching { }\n", ONE_CPU),
        ('platform: "ensemble"\n', ONE_CPU),
        (ONNX, ReplicaPlan(2, "KIND_CPU")),
        (ONNX, ReplicaPlan(1, "KIND_GPU", 1.0)),
        (ONNX + 'parameters { key: "autoscaling_max_replicas" value: { string_value: "4" } }\n', ONE_CPU),
    ]:
        assert hosting(text, "pool", plan) == "dedicated", text


def test_the_models_parameter_overrides_the_server() -> None:
    asks_pool = ONNX + 'parameters { key: "rayinfer_hosting" value: { string_value: "Pool" } }\n'
    asks_own = ONNX + 'parameters { key: "rayinfer_hosting" value: { string_value: "dedicated" } }\n'
    assert hosting(asks_pool) == "pool"
    assert hosting(asks_own, "pool") == "dedicated"


def test_a_model_that_asks_for_the_pool_and_cannot_have_it_is_refused_naming_the_file_and_why() -> None:
    text = ONNX + 'parameters { key: "rayinfer_hosting" value: { string_value: "pool" } }\n'
    with pytest.raises(ModelConfigError, match=r"/models/m/config.pbtxt: .*asks for the pool, but it has 3 instances"):
        hosting(text, plan=ReplicaPlan(3, "KIND_CPU"))
    with pytest.raises(ModelConfigError, match="must be one of dedicated, pool, got 'shared'"):
        hosting(ONNX + 'parameters { key: "rayinfer_hosting" value: { string_value: "shared" } }\n')
    assert "Python model" in (pool_obstacle(config('backend: "python"\n'), ONE_CPU) or "")
