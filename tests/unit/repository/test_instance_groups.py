"""Instance groups as replicas and Ray resources (no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format

from rayinfer.protocol.errors import ModelConfigError
from rayinfer.repository.instance_groups import ReplicaPlan, replica_plan, resolve_instance_kinds, runs_on_gpu
from rayinfer.repository.model_config import ModelConfig, fill_defaults, mc

PATH = Path("/repo/m/config.pbtxt")


def _config(groups: str) -> ModelConfig:
    config = text_format.Parse(f'name: "m" backend: "onnxruntime" {groups}', ModelConfig())
    fill_defaults(config)
    return config


def plan(groups: str, gpus: bool = True, fallback: bool = False) -> ReplicaPlan:
    return replica_plan(_config(groups), PATH, auto_gpu=gpus, gpu_fallback=fallback)


def test_cpu_groups_add_up() -> None:
    assert plan("instance_group [ { count: 2 kind: KIND_CPU }, { count: 3 kind: KIND_CPU } ]") == ReplicaPlan(5, "KIND_CPU")


def test_a_sequence_model_runs_its_count_decoupled_or_not() -> None:
    """Sequences are routed to the replica owning their slot; a decoupled sequence model's
    streamed responses are relayed back through the replica that received the request."""
    sequences = "sequence_batching { } "
    assert plan(sequences + "instance_group [ { count: 3 kind: KIND_CPU } ]") == ReplicaPlan(3, "KIND_CPU")
    assert plan(sequences + "instance_group [ { count: 2 kind: KIND_GPU gpus: [ 0, 1 ] } ]") == \
        ReplicaPlan(4, "KIND_GPU", 0.5)
    decoupled = sequences + "model_transaction_policy { decoupled: true } "
    assert plan(decoupled + "instance_group [ { count: 3 kind: KIND_CPU } ]") == ReplicaPlan(3, "KIND_CPU")


def test_gpu_count_shares_one_gpu() -> None:
    assert plan("instance_group [ { count: 2 kind: KIND_GPU } ]") == ReplicaPlan(2, "KIND_GPU", 0.5)
    assert plan("instance_group [ { count: 1 kind: KIND_GPU } ]") == ReplicaPlan(1, "KIND_GPU", 1.0)
    assert plan("instance_group [ { count: 3 kind: KIND_GPU } ]").num_gpus == 0.3333


def test_a_gpu_fraction_per_model_lets_models_share_a_gpu() -> None:
    one = replica_plan(_config("instance_group [ { count: 1 kind: KIND_GPU } ]"), PATH, auto_gpu=True, gpu_fraction=0.25)
    assert one == ReplicaPlan(1, "KIND_GPU", 0.25)  # four such models on one GPU
    two = replica_plan(_config("instance_group [ { count: 2 kind: KIND_GPU } ]"), PATH, auto_gpu=True, gpu_fraction=0.25)
    assert two == ReplicaPlan(2, "KIND_GPU", 0.125)
    tiny = replica_plan(_config("instance_group [ { count: 3 kind: KIND_GPU } ]"), PATH, auto_gpu=True,
                        gpu_fraction=0.0001)
    assert tiny.num_gpus == 0.0001  # Ray's smallest unit, never 0 (which would be no GPU at all)


def test_listed_gpus_multiply_the_count() -> None:
    result = plan("instance_group [ { count: 2 kind: KIND_GPU gpus: [ 0, 1 ] } ]")
    assert result == ReplicaPlan(4, "KIND_GPU", 0.5) and result.total_gpus == 2.0


def test_auto_and_the_default_follow_the_cluster() -> None:
    assert plan("", gpus=True) == ReplicaPlan(1, "KIND_GPU", 1.0)
    assert plan("", gpus=False) == ReplicaPlan(1, "KIND_CPU")
    assert plan("instance_group [ { count: 2 kind: KIND_AUTO } ]", gpus=False) == ReplicaPlan(2, "KIND_CPU")


def test_model_kind_reserves_no_gpu() -> None:
    assert plan("instance_group [ { count: 2 kind: KIND_MODEL } ]") == ReplicaPlan(2, "KIND_CPU")


def test_gpu_fallback_runs_gpu_groups_on_cpu() -> None:
    assert plan("instance_group [ { count: 2 kind: KIND_GPU } ]", fallback=True) == ReplicaPlan(2, "KIND_CPU")


def test_kind_gpu_without_cluster_gpus_still_asks_for_them() -> None:
    # Reported while it waits (an autoscaler may add a GPU node), not silently moved to the CPU.
    assert plan("instance_group [ { kind: KIND_GPU } ]", gpus=False) == ReplicaPlan(1, "KIND_GPU", 1.0)


def test_mixed_kinds_are_refused_naming_the_groups() -> None:
    with pytest.raises(ModelConfigError, match=r"config.pbtxt: instance groups that resolve to both CPU and GPU "
                                                r"replicas \('m' KIND_CPU, 'm_1' KIND_GPU\)"):
        plan("instance_group [ { kind: KIND_CPU }, { kind: KIND_GPU } ]")


def test_gpu_groups_with_different_counts_are_refused() -> None:
    with pytest.raises(ModelConfigError, match=r"different counts \(\[1, 2\]\)"):
        plan("instance_group [ { count: 1 kind: KIND_GPU }, { count: 2 kind: KIND_GPU } ]")


def test_resolve_instance_kinds() -> None:
    config = _config("instance_group [ { kind: KIND_AUTO }, { kind: KIND_GPU }, { kind: KIND_MODEL } ]")
    resolve_instance_kinds(config, on_gpu=False)
    assert [mc.ModelInstanceGroup.Kind.Name(g.kind) for g in config.instance_group] == ["KIND_CPU", "KIND_CPU", "KIND_MODEL"]
    assert not runs_on_gpu(config)
    config = _config("")
    resolve_instance_kinds(config, on_gpu=True)
    assert runs_on_gpu(config)
