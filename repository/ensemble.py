"""Triton's ``ensemble_scheduling`` as a validated step graph.

An ensemble's steps name member models and map tensors in and out: ``input_map`` from a
member's input to an ensemble tensor, ``output_map`` from a member's output to one. A tensor is
an ensemble input or the output of exactly one step; a step runs once every tensor it maps in
exists. Two checks, both raising :class:`ModelConfigError` naming the file and the step:

- :func:`parse_ensemble`, from the config alone: steps, tensors produced twice, tensors no step
  produces, unused inputs and outputs, cycles;
- :func:`check_members`, against the members' own (completed) configs: unknown inputs and
  outputs, unmapped required inputs, datatype and shape mismatches, batch sizes.

Beyond Triton, a step may be *conditional* (its model runs only when a condition holds,
otherwise its outputs are absent), declared in the ensemble's ``parameters`` so that plain
Triton configs keep Triton's meaning: ``step_<i>_run_if_present`` names an ensemble tensor the
step runs only when it exists; ``step_<i>_run_if`` names a BOOL tensor of one element the step
runs only when it is true. A tensor only a conditional step produces is optional for the steps
that read it: they must be conditional on it too, or be optional inputs of their model.

Also beyond Triton (whose ``dynamic_batching`` and ``ensemble_scheduling`` exclude each other):
the ``max_queue_delay_microseconds`` parameter batches the ensemble's own requests, so that each
step sends its member the rows of several requests at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayinfer.protocol.errors import ModelConfigError
from rayinfer.repository.model_config import CONFIG_FILENAME, ModelConfig, ModelSpec

ENSEMBLE_PLATFORM = "ensemble"
_RUN_IF_PRESENT = "run_if_present"
_RUN_IF = "run_if"
BATCH_DELAY_PARAMETER = "max_queue_delay_microseconds"
# Run the steps of members that can run in the ensemble's own process there (see
# deployments/steps_in_place.py); "false" (the default): every step is a call to the member's
# replicas, as in Triton.
STEPS_IN_PLACE_PARAMETER = "steps_in_place"


@dataclass(frozen=True)
class EnsembleStep:
    """One step: a member model version and how its tensors map to the ensemble's."""

    index: int
    model_name: str
    model_version: str  # "" for -1: the version the member's policy makes its default
    input_map: tuple[tuple[str, str], ...]  # (member input, ensemble tensor)
    output_map: tuple[tuple[str, str], ...]  # (member output, ensemble tensor)
    run_if_present: str | None = None
    run_if: str | None = None

    @property
    def label(self) -> str:
        return f"step {self.index} (model '{self.model_name}')"

    @property
    def consumes(self) -> tuple[str, ...]:
        """Ensemble tensors the step needs before it can run (its condition's included)."""
        needed = [tensor for _, tensor in self.input_map]
        needed += [t for t in (self.run_if,) if t is not None and t not in needed]
        return tuple(needed)

    @property
    def conditional(self) -> bool:
        return self.run_if_present is not None or self.run_if is not None


@dataclass(frozen=True)
class EnsemblePlan:
    """An ensemble's steps in an order where each step comes after those it reads from."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    steps: tuple[EnsembleStep, ...]
    # Tensors that may be absent at run time: produced only by conditional steps.
    optional_tensors: frozenset[str] = frozenset()
    # Batch the ensemble's own requests, waiting at most this long (parameter
    # max_queue_delay_microseconds); None: each request runs its steps alone, as in Triton.
    batch_delay_us: int | None = None
    # Parameter steps_in_place: members that can run in the ensemble's replica run there.
    steps_in_place: bool = False

    @property
    def members(self) -> tuple[tuple[str, str], ...]:
        """(model, version) of every step, each once, in step order."""
        return tuple(dict.fromkeys((s.model_name, s.model_version) for s in self.steps))


def is_ensemble(config: ModelConfig) -> bool:
    return config.platform == ENSEMBLE_PLATFORM


def member_names(config: ModelConfig) -> list[str]:
    """The models an ensemble's steps name (empty for any other model), each once."""
    if not is_ensemble(config):
        return []
    return list(dict.fromkeys(step.model_name for step in config.ensemble_scheduling.step))


def first_step(config: ModelConfig, model: str) -> int:
    """The index of the first step of an ensemble config that names ``model`` (-1: none)."""
    return next((i for i, step in enumerate(config.ensemble_scheduling.step) if step.model_name == model), -1)


def parse_ensemble(config: ModelConfig, model_dir: Path) -> EnsemblePlan:
    """The validated step graph of an ensemble config (see the module's docstring)."""
    path = model_dir / CONFIG_FILENAME
    name = config.name

    def fail(message: str) -> ModelConfigError:
        return ModelConfigError(f"{path}: ensemble '{name}': {message}")

    if not config.HasField("ensemble_scheduling") or not config.ensemble_scheduling.step:
        raise fail("platform 'ensemble' needs ensemble_scheduling with at least one step")
    inputs = tuple(t.name for t in config.input)
    outputs = tuple(t.name for t in config.output)
    conditions = _conditions(config, fail)
    steps: list[EnsembleStep] = []
    producer: dict[str, EnsembleStep] = {}
    for index, raw in enumerate(config.ensemble_scheduling.step):
        if not raw.model_name:
            raise fail(f"step {index} names no model")
        if raw.model_name == name:
            raise fail(f"step {index} calls the ensemble itself")
        if raw.model_version < -1:
            raise fail(f"step {index} (model '{raw.model_name}') has invalid model_version {raw.model_version}")
        if not raw.output_map:
            raise fail(f"step {index} (model '{raw.model_name}') maps no output")
        present, run_if = conditions.pop(index, (None, None))
        step = EnsembleStep(
            index=index,
            model_name=raw.model_name,
            model_version="" if raw.model_version == -1 else str(raw.model_version),
            input_map=tuple(sorted(raw.input_map.items())),
            output_map=tuple(sorted(raw.output_map.items())),
            run_if_present=present,
            run_if=run_if,
        )
        for _, tensor in step.output_map:
            if tensor in inputs:
                raise fail(f"{step.label} writes '{tensor}', which is an input of the ensemble")
            if tensor in producer:
                raise fail(f"{step.label} writes '{tensor}', which {producer[tensor].label} writes too")
            producer[tensor] = step
        steps.append(step)
    if conditions:
        raise fail(f"a condition names step {min(conditions)}, but the ensemble has {len(steps)} steps")
    known = set(inputs) | set(producer)
    for step in steps:
        for tensor in step.consumes + tuple(t for t in (step.run_if_present,) if t is not None):
            if tensor not in known:
                raise fail(f"{step.label} reads '{tensor}', which is neither an input of the ensemble "
                           "nor an output of any step")
    for output in outputs:
        if output not in producer:
            raise fail(f"output '{output}' is not written by any step")
    read = {t for step in steps for t in step.consumes} | {s.run_if_present for s in steps if s.run_if_present}
    for tensor in inputs:
        if tensor not in read:
            raise fail(f"input '{tensor}' is not read by any step")
    for tensor, step in producer.items():
        if tensor not in read and tensor not in outputs:
            raise fail(f"{step.label} writes '{tensor}', which no step reads and is not an output of the ensemble")
    ordered = _topological(steps, producer, fail)
    optional = frozenset([t.name for t in config.input if t.optional]
                         + [t for s in steps if s.conditional for _, t in s.output_map])
    delay = config.parameters.get(BATCH_DELAY_PARAMETER)
    batch_delay_us = None
    if delay is not None:
        if not delay.string_value.strip().isdigit():
            raise fail(f"parameter '{BATCH_DELAY_PARAMETER}' must be a whole number of microseconds, "
                       f"got '{delay.string_value}'")
        if config.max_batch_size < 1:
            raise fail(f"parameter '{BATCH_DELAY_PARAMETER}' needs max_batch_size >= 1")
        batch_delay_us = int(delay.string_value)
    in_place = config.parameters.get(STEPS_IN_PLACE_PARAMETER)
    in_place_text = in_place.string_value.strip().lower() if in_place is not None else "false"
    if in_place_text not in ("true", "false"):
        raise fail(f"parameter '{STEPS_IN_PLACE_PARAMETER}' must be 'true' or 'false', got '{in_place.string_value}'")
    return EnsemblePlan(name, inputs, outputs, tuple(ordered), optional, batch_delay_us, in_place_text == "true")


def check_members(plan: EnsemblePlan, ensemble: ModelSpec, members: dict[tuple[str, str], ModelSpec],
                  model_dir: Path) -> None:
    """Check every step against its member's spec: tensor names, datatypes, shapes, batch sizes.

    ``members``: (model, version) -> that member's spec, for every member of ``plan``."""
    path = model_dir / CONFIG_FILENAME

    def fail(message: str) -> ModelConfigError:
        return ModelConfigError(f"{path}: ensemble '{plan.name}': {message}")

    # Every tensor's (datatype, full shape incl. any batch dimension, where it comes from).
    batch = (-1,) if ensemble.max_batch_size > 0 else ()
    tensors: dict[str, tuple[str, tuple[int, ...], str]] = {
        t.name: (t.datatype, batch + t.dims, "the ensemble's input") for t in ensemble.inputs
    }
    for step in plan.steps:
        spec = members[(step.model_name, step.model_version)]
        if ensemble.max_batch_size > 0 and 0 < spec.max_batch_size < ensemble.max_batch_size:
            raise fail(f"{step.label} allows batches of {spec.max_batch_size}, fewer than the ensemble's "
                       f"max_batch_size {ensemble.max_batch_size}")
        member_batch = (-1,) if spec.max_batch_size > 0 else ()
        for member_input, tensor in step.input_map:
            declared = spec.input_map.get(member_input)
            if declared is None:
                raise fail(f"{step.label} maps '{member_input}', which is not an input of model "
                           f"'{spec.name}' (its inputs: {', '.join(spec.input_map)})")
            datatype, shape, source = tensors[tensor]
            if datatype != declared.datatype:
                raise fail(f"{step.label} input '{member_input}' is {declared.datatype}, but tensor "
                           f"'{tensor}' from {source} is {datatype}")
            if not _compatible(shape, member_batch + declared.dims):
                raise fail(f"{step.label} input '{member_input}' has shape "
                           f"{_fmt(member_batch + declared.dims)}, but tensor '{tensor}' from {source} has "
                           f"shape {_fmt(shape)}")
        mapped = {member_input for member_input, _ in step.input_map}
        for declared in spec.inputs:
            if declared.name not in mapped and not declared.optional:
                raise fail(f"{step.label} does not map input '{declared.name}' of model '{spec.name}'")
        for member_output, tensor in step.output_map:
            declared = spec.output_map.get(member_output)
            if declared is None:
                raise fail(f"{step.label} maps '{member_output}', which is not an output of model "
                           f"'{spec.name}' (its outputs: {', '.join(spec.output_map)})")
            tensors[tensor] = (declared.datatype, member_batch + declared.dims, step.label)
        if step.run_if is not None and tensors[step.run_if][0] != "BOOL":
            raise fail(f"{step.label} runs if '{step.run_if}', which is {tensors[step.run_if][0]}, not BOOL")
        for member_input, tensor in step.input_map:
            if tensor in plan.optional_tensors and step.run_if_present != tensor \
                    and not spec.input_map[member_input].optional:
                raise fail(f"{step.label} reads '{tensor}', which a conditional step may not write: "
                           f"make the step run_if_present '{tensor}', or the input optional")
    _check_decoupled_on_one_path(plan, members, fail)
    for output in ensemble.outputs:
        datatype, shape, source = tensors[output.name]
        if datatype != output.datatype:
            raise fail(f"output '{output.name}' is {output.datatype}, but {source} writes {datatype}")
        if not _compatible(shape, batch + output.dims):
            raise fail(f"output '{output.name}' has shape {_fmt(batch + output.dims)}, but {source} writes "
                       f"shape {_fmt(shape)}")


def decoupled_members(members: dict[tuple[str, str], ModelSpec]) -> frozenset[tuple[str, str]]:
    """The members whose config makes them decoupled (zero to many responses per request)."""
    return frozenset(key for key, spec in members.items()
                     if spec.config is not None and spec.config.model_transaction_policy.decoupled)


def _check_decoupled_on_one_path(plan: EnsemblePlan, members: dict[tuple[str, str], ModelSpec], fail: Any) -> None:
    """Each response of a decoupled step runs the steps after it once more; two decoupled steps
    neither of which feeds the other would need every pairing of their responses: refused."""
    producer = {t: s for s in plan.steps for _, t in s.output_map}
    before: dict[int, set[int]] = {}
    for step in plan.steps:  # in order: a step's writers come first
        writers = {producer[t].index for t in step.consumes if t in producer}
        before[step.index] = writers.union(*(before[w] for w in writers))
    decoupled = [s for s in plan.steps if (s.model_name, s.model_version) in decoupled_members(members)]
    for i, a in enumerate(decoupled):
        for b in decoupled[i + 1:]:
            if a.index not in before[b.index] and b.index not in before[a.index]:
                raise fail(f"{a.label} and {b.label} are decoupled and neither feeds the other: decoupled "
                           "steps must lie on one path")


def _conditions(config: ModelConfig, fail: Any) -> dict[int, tuple[str | None, str | None]]:
    """step index -> (run_if_present tensor, run_if tensor), from ``step_<i>_<condition>``."""
    out: dict[int, tuple[str | None, str | None]] = {}
    for key, value in config.parameters.items():
        if not key.startswith("step_"):
            continue
        index_text, _, condition = key[len("step_"):].partition("_")
        if not index_text.isdigit() or condition not in (_RUN_IF_PRESENT, _RUN_IF):
            raise fail(f"parameter '{key}' is not step_<index>_run_if_present or step_<index>_run_if")
        tensor = value.string_value
        if not tensor:
            raise fail(f"parameter '{key}' names no tensor")
        present, run_if = out.get(int(index_text), (None, None))
        out[int(index_text)] = (tensor, run_if) if condition == _RUN_IF_PRESENT else (present, tensor)
    return out


def _topological(steps: list[EnsembleStep], producer: dict[str, EnsembleStep], fail: Any) -> list[EnsembleStep]:
    """Steps ordered after the steps they read from; a cycle is an error naming its steps."""
    after: dict[int, set[int]] = {
        s.index: {producer[t].index for t in s.consumes + ((s.run_if_present,) if s.run_if_present else ())
                  if t in producer}
        for s in steps
    }
    ordered: list[EnsembleStep] = []
    done: set[int] = set()
    while len(ordered) < len(steps):
        ready = [s for s in steps if s.index not in done and after[s.index] <= done]
        if not ready:
            stuck = [s.label for s in steps if s.index not in done]
            raise fail(f"its steps form a cycle: {' and '.join(stuck)} wait for each other's outputs")
        ordered.extend(ready)
        done.update(s.index for s in ready)
    return ordered


def _compatible(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b))


def _fmt(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def dependency_waves(members: dict[str, list[str]]) -> tuple[list[list[str]], list[str]]:
    """Models to deploy, in waves where each model comes after the models it depends on among
    ``members``' keys (model -> the models its steps name); and the models left in a cycle of
    ensembles, which can never load."""
    waves: list[list[str]] = []
    done: set[str] = set()
    left = dict(members)
    while left:
        wave = sorted(m for m, needs in left.items() if all(n in done or n not in members for n in needs))
        if not wave:
            break
        waves.append(wave)
        done.update(wave)
        for model in wave:
            del left[model]
    return waves, sorted(left)
