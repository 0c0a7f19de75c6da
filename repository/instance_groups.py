"""Triton's ``instance_group`` as Ray Serve replicas and the Ray resources each one reserves.

Triton places ``count`` instances of a KIND_GPU group on *each* GPU listed in ``gpus`` (every
GPU of the machine when none is listed). A Ray replica cannot choose a device: it asks for a
share of a GPU and Ray picks one, then sets ``CUDA_VISIBLE_DEVICES`` so that the process sees
only that GPU. So here:

- ``KIND_GPU`` with ``count: N``: N replicas, each reserving ``1/N`` of a GPU, so the N share one
  GPU (Triton, without ``gpus``, puts N on every GPU of the machine); with ``gpus: [a, b, ...]``,
  N replicas per listed GPU, so ``N * len(gpus)`` in all. Which physical GPU each lands on is Ray's choice; the
  ids only count GPUs.
- ``KIND_CPU``: ``count`` replicas, no GPU. ``KIND_MODEL``: the same (the model places itself).
- ``KIND_AUTO`` (and a config with no ``instance_group``, Triton's default): GPU replicas when
  the cluster has GPUs and the model's backend, as installed, can use one (``auto_gpu``), else CPU.
- ``gpu_fallback``: GPU groups run as CPU replicas (development on a machine without a GPU).
- ``gpu_fraction``: the share of a GPU one model version's instances on it reserve together
  (1 by default; ``--gpu-fraction-per-model 0.25`` lets four single-instance models share a GPU,
  as any number do in Triton, whose instances reserve nothing): each replica reserves
  ``gpu_fraction / N``.

A model with ``sequence_batching`` runs as many replicas as any other, each with the slots of
one instance: every request of a sequence goes to the replica that owns the sequence's routing
slot (:mod:`rayinfer.serving.sequence_routing`); a *decoupled* model's responses stream back
through the replica that received the request.

One model's groups must resolve to one kind, and its GPU groups to one ``count``: a Serve
deployment has one set of resources for all its replicas.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rayinfer.protocol.errors import ModelConfigError
from rayinfer.repository.model_config import ModelConfig, mc

_KIND = mc.ModelInstanceGroup
# Ray takes resource amounts in steps of 1/10,000.
_RESOURCE_STEP = 10_000


@dataclass(frozen=True)
class ReplicaPlan:
    """How many replicas serve a model version and what each reserves."""

    replicas: int
    kind: str  # KIND_CPU or KIND_GPU: how the replicas run
    num_gpus: float = 0.0  # per replica

    @property
    def total_gpus(self) -> float:
        return self.replicas * self.num_gpus


def _kind_name(kind: int) -> str:
    return _KIND.Kind.Name(kind)


def replica_plan(config: ModelConfig, path: Path, *, auto_gpu: bool,
                 gpu_fallback: bool = False, gpu_fraction: float = 1.0) -> ReplicaPlan:
    """The replicas of a (defaults-filled) config; raises :class:`ModelConfigError` naming
    ``path`` for groups this mapping cannot express. ``auto_gpu``: KIND_AUTO groups are GPU
    groups (the cluster has GPUs and the model's backend can use them)."""
    groups = list(config.instance_group)
    if not groups:  # fill_defaults gives every config one
        return ReplicaPlan(1, "KIND_CPU")
    resolved = []
    for group in groups:
        kind = group.kind
        if kind == _KIND.KIND_AUTO:
            kind = _KIND.KIND_GPU if auto_gpu else _KIND.KIND_CPU
        if kind == _KIND.KIND_MODEL or (kind == _KIND.KIND_GPU and gpu_fallback):
            kind = _KIND.KIND_CPU
        resolved.append((group, kind))
    kinds = {kind for _, kind in resolved}
    if len(kinds) > 1:
        listed = ", ".join(f"'{g.name}' {_kind_name(g.kind)}" for g in groups)
        raise ModelConfigError(
            f"{path}: instance groups that resolve to both CPU and GPU replicas ({listed}) are not "
            "supported: one model's replicas share one set of resources; use one kind"
        )
    if kinds == {_KIND.KIND_CPU}:
        return ReplicaPlan(sum(max(g.count, 1) for g in groups), "KIND_CPU")
    counts = {max(g.count, 1) for g, _ in resolved}
    if len(counts) > 1:
        raise ModelConfigError(
            f"{path}: GPU instance groups with different counts ({sorted(counts)}) are not supported: "
            "each replica reserves 1/count of a GPU, and one model's replicas reserve the same"
        )
    count = counts.pop()
    replicas = sum(count * max(1, len(g.gpus)) for g, _ in resolved)
    # 1/3 -> 0.3333: never more than a GPU's share; at least Ray's smallest unit
    share = max(int(_RESOURCE_STEP * gpu_fraction / count), 1) / _RESOURCE_STEP
    return ReplicaPlan(replicas, "KIND_GPU", share)


def resolve_instance_kinds(config: ModelConfig, on_gpu: bool) -> None:
    """Rewrite the config's KIND_AUTO and KIND_GPU groups to the kind the replica runs as (it
    has a GPU or not), so that the backend and the config the server reports agree."""
    for group in config.instance_group:
        if group.kind in (_KIND.KIND_AUTO, _KIND.KIND_GPU):
            group.kind = _KIND.KIND_GPU if on_gpu else _KIND.KIND_CPU


def runs_on_gpu(config: ModelConfig) -> bool:
    """Whether a resolved config's instances are GPU instances."""
    return any(group.kind == _KIND.KIND_GPU for group in config.instance_group)
