"""A model's autoscaling parameters, what Serve is given for them (checked by Serve's own config
model), and the policy that adds the front's traffic to Serve's count."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from google.protobuf import text_format
from ray.serve.config import AutoscalingConfig

from rayinfer.deployments.autoscaling import LISTENER_ONGOING, POLICY, front_traffic_policy, serve_autoscaling_config
from rayinfer.protocol.errors import ModelConfigError
from rayinfer.repository.autoscaling import AutoscalingSpec, autoscaling_spec
from rayinfer.repository.model_config import ModelConfig

PATH = Path("repo/m/config.pbtxt")


def config(**parameters: str) -> ModelConfig:
    text = 'name: "m" backend: "python"\n' + "".join(
        f'parameters {{ key: "autoscaling_{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in parameters.items())
    return text_format.Parse(text, ModelConfig())


def test_no_parameter_no_autoscaling_and_defaults_otherwise():
    assert autoscaling_spec(config(), PATH) is None
    assert autoscaling_spec(config(max_replicas="3"), PATH) == AutoscalingSpec(min_replicas=1, max_replicas=3)
    spec = autoscaling_spec(config(min_replicas="2", max_replicas="4", target_ongoing_requests="1.5",
                                   upscale_delay_s="0", downscale_delay_s="5", look_back_period_s="2"), PATH)
    assert spec == AutoscalingSpec(2, 4, 1.5, 0.0, 5.0, 2.0)


@pytest.mark.parametrize("parameters, message", [
    ({"min_replicas": "1"}, "the autoscaling parameters need 'autoscaling_max_replicas'"),
    ({"max_replicas": "two"}, "parameter 'autoscaling_max_replicas' must be an integer, got 'two'"),
    ({"max_replicas": "2", "min_replicas": "-1"}, "parameter 'autoscaling_min_replicas' must be at least 0, got '-1'"),
    ({"max_replicas": "2", "downscale_to_zero_delay_s": "5"},
     "'autoscaling_downscale_to_zero_delay_s' needs 'autoscaling_min_replicas' 0"),
    ({"max_replicas": "2", "min_replicas": "3"}, "'autoscaling_min_replicas' (3) is more than 'autoscaling_max_replicas' (2)"),
    ({"max_replicas": "2", "upscale_delay_s": "-1"}, "parameter 'autoscaling_upscale_delay_s' must be at least 0"),
    ({"max_replicas": "2", "target": "1"}, "unknown parameter 'autoscaling_target'"),
    ({"max_replicas": "2", "look_back_period_s": "1"}, "parameter 'autoscaling_look_back_period_s' must be at least 2"),
])
def test_wrong_parameters_name_the_file_and_the_parameter(parameters: dict, message: str):
    with pytest.raises(ModelConfigError) as error:
        autoscaling_spec(config(**parameters), PATH)
    assert str(PATH) in error.value.message and message in error.value.message


def test_serve_accepts_the_config_and_starts_from_the_instance_count_within_the_range():
    spec = AutoscalingSpec(2, 4, 1.0, 0.0, 5.0, 2.0)
    for count, initial in ((1, 2), (3, 3), (8, 4)):
        rendered = serve_autoscaling_config(spec, count)
        checked = AutoscalingConfig(**rendered)  # Serve's own validation
        assert (checked.min_replicas, checked.max_replicas, checked.initial_replicas) == (2, 4, initial)
        assert checked.policy.policy_function == POLICY


def test_a_model_may_scale_to_zero_and_starts_on_its_instance_count():
    spec = autoscaling_spec(config(min_replicas="0", max_replicas="2", downscale_to_zero_delay_s="3"), PATH)
    assert spec == AutoscalingSpec(0, 2, downscale_to_zero_delay_s=3.0)
    checked = AutoscalingConfig(**serve_autoscaling_config(spec, 1))  # Serve's own validation
    assert (checked.min_replicas, checked.initial_replicas, checked.downscale_to_zero_delay_s) == (0, 1, 3.0)
    assert "downscale_to_zero_delay_s" not in serve_autoscaling_config(AutoscalingSpec(1, 2), 1)


def context(replicas: int, serve_count: float, listeners: dict, target: float = 2.0) -> SimpleNamespace:
    return SimpleNamespace(current_num_replicas=replicas, target_num_replicas=replicas, total_num_requests=serve_count,
                           aggregated_metrics={LISTENER_ONGOING: listeners} if listeners is not None else None,
                           config=SimpleNamespace(get_target_ongoing_requests=lambda: target))


def test_the_policy_counts_the_listeners_calls_beside_serves_own():
    assert front_traffic_policy(context(1, 0.0, {"r1": 6.0}))[0] == 3.0  # only the front's traffic
    assert front_traffic_policy(context(2, 1.0, {"r1": 2.0, "r2": 1.0}))[0] == 2.0
    assert front_traffic_policy(context(1, 0.0, None))[0] == 0.0  # no metric yet: Serve's bounds apply
    assert front_traffic_policy(context(0, 0.0, {}))[0] == 0  # no replica: Serve's target stands
