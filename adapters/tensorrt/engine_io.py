"""What a TensorRT engine says about its I/O, and Triton's rules built on it, without TensorRT:
auto-complete of inputs, outputs and max_batch_size, checking a config against the engine, and
choosing the optimization profile that fits a batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from rayinfer.protocol.dtypes import wire_to_config
from rayinfer.protocol.errors import InvalidArgError, ModelConfigError
from rayinfer.repository.model_config import ModelConfig, ModelTensor, auto_complete_io, mc

# TensorRT's DataType names -> Triton wire datatypes (BF16, FP8 and INT4 have no numpy type here).
TRT_TO_WIRE = {
    "FLOAT": "FP32",
    "HALF": "FP16",
    "INT8": "INT8",
    "INT32": "INT32",
    "INT64": "INT64",
    "BOOL": "BOOL",
    "UINT8": "UINT8",
}

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Profile:
    """One optimization profile's range for one input."""

    min: Shape
    opt: Shape
    max: Shape

    def fits(self, shape: Shape) -> bool:
        return len(shape) == len(self.min) and all(lo <= d <= hi for d, lo, hi in zip(shape, self.min, self.max))


@dataclass(frozen=True)
class EngineTensor:
    """One I/O tensor of an engine: its shape has -1 where the dimension is dynamic; an input's
    ``profiles`` has one range per optimization profile of the engine."""

    name: str
    is_input: bool
    trt_dtype: str  # TensorRT's DataType name: FLOAT, HALF, ...
    shape: Shape
    profiles: list[Profile] = field(default_factory=list)

    @property
    def wire(self) -> str | None:
        return TRT_TO_WIRE.get(self.trt_dtype)


def batch_capacity(tensors: list[EngineTensor], profiles: list[int]) -> int:
    """The largest batch the engine takes when every I/O tensor's first dimension is dynamic
    (Triton's explicit-batch rule): the smallest, over inputs, of the largest first dimension any
    allowed profile admits; 0 when the engine does not batch."""
    if not tensors or not all(t.shape and t.shape[0] == -1 for t in tensors):
        return 0
    inputs = [t for t in tensors if t.is_input]
    if not inputs:
        return 0
    return min(max(t.profiles[p].max[0] for p in profiles) for t in inputs)


def auto_complete(config: ModelConfig, tensors: list[EngineTensor], profiles: list[int]) -> None:
    """Fill missing inputs, outputs and max_batch_size from the engine, as Triton does."""
    capacity = batch_capacity(tensors, profiles)

    def described(is_input: bool) -> list[ModelTensor]:
        return [(t.name, t.wire, list(t.shape)) for t in tensors if t.is_input == is_input and t.wire is not None]

    auto_complete_io(config, described(True), described(False), capacity if capacity > 1 else 0)


def check_config(config: ModelConfig, tensors: list[EngineTensor], profiles: list[int], path: Path) -> None:
    """The config's tensors exist in the engine with its datatypes and ranks, and a batching
    config fits an engine that batches."""
    for what, declared, is_input in (("input", config.input, True), ("output", config.output, False)):
        by_name = {t.name: t for t in tensors if t.is_input == is_input}
        for tensor in declared:
            found = by_name.get(tensor.name)
            if found is None:
                raise ModelConfigError(
                    f"model '{config.name}': unexpected inference {what} '{tensor.name}', "
                    f"allowed {what}s are: {', '.join(by_name)} ({path})"
                )
            expected = mc.DataType.Name(tensor.data_type)
            if found.wire is None or wire_to_config(found.wire) != expected:
                raise ModelConfigError(
                    f"model '{config.name}': {what} '{tensor.name}' is {found.trt_dtype} in the engine "
                    f"but {expected} in the config ({path})"
                )
            rank = len(tensor.dims) + (1 if config.max_batch_size > 0 else 0)
            if not tensor.HasField("reshape") and rank != len(found.shape):
                raise ModelConfigError(
                    f"model '{config.name}': {what} '{tensor.name}' has {len(found.shape)} dimensions "
                    f"{list(found.shape)} in the engine, but the config gives {rank} ({path})"
                )
    if config.max_batch_size > 0:
        capacity = batch_capacity(tensors, profiles)
        if capacity == 0:
            raise ModelConfigError(
                f"model '{config.name}': max_batch_size is {config.max_batch_size}, but the engine's first "
                f"dimensions are not all dynamic, so it cannot batch; set max_batch_size: 0 ({path})"
            )
        if config.max_batch_size > capacity:
            raise ModelConfigError(
                f"model '{config.name}': max_batch_size {config.max_batch_size} is larger than the engine's "
                f"optimization profiles allow ({capacity}) ({path})"
            )


def allowed_profiles(config: ModelConfig, count: int, path: Path) -> list[int]:
    """The profiles the instance groups name (``profile: ["0"]``), else all ``count`` of them."""
    named = [p for group in config.instance_group for p in group.profile]
    if not named:
        return list(range(count))
    chosen = []
    for text in named:
        if not text.isdigit() or int(text) >= count:
            raise ModelConfigError(
                f"model '{config.name}': instance_group profile '{text}' is not one of the engine's "
                f"{count} optimization profiles (0..{count - 1}) ({path})"
            )
        if int(text) not in chosen:
            chosen.append(int(text))
    return chosen


def pick_profile(model: str, tensors: list[EngineTensor], shapes: dict[str, Shape], profiles: list[int],
                 current: int) -> int:
    """The profile whose ranges hold every input's shape, preferring the one in use; an error
    naming the input when none does."""
    inputs = [t for t in tensors if t.is_input]

    def fits(p: int) -> bool:
        return all(t.profiles[p].fits(shapes[t.name]) for t in inputs if t.name in shapes)

    if current in profiles and fits(current):
        return current
    for p in profiles:
        if fits(p):
            return p
    for t in inputs:
        if t.name in shapes and not any(t.profiles[p].fits(shapes[t.name]) for p in profiles):
            ranges = "; ".join(f"profile {p}: min {list(t.profiles[p].min)} max {list(t.profiles[p].max)}"
                               for p in profiles)
            raise InvalidArgError(
                f"model '{model}': input '{t.name}' shape {list(shapes[t.name])} is outside the engine's "
                f"optimization profiles ({ranges})"
            )
    raise InvalidArgError(f"model '{model}': no one optimization profile holds the shapes of all inputs {shapes}")
