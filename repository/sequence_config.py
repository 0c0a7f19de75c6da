"""Triton's ``sequence_batching`` settings: strategy, control inputs and implicit state.

A sequence model's requests carry a correlation id and START / END flags; the sequence batcher
(:mod:`rayinfer.serving.sequencer`) gives the model the control inputs declared here beside
the request's own, and the implicit state (``state``) of the request's sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rayinfer.protocol.dtypes import config_to_wire, numpy_dtype
from rayinfer.protocol.errors import ModelConfigError
from tritonclient.grpc import model_config_pb2 as mc

# Triton's default for max_sequence_idle_microseconds.
DEFAULT_IDLE_US = 1_000_000
CONTROL_KINDS = ("START", "READY", "END", "CORRID")
_CORRID_TYPES = ("UINT64", "INT64", "UINT32", "INT32", "BYTES")
CorrelationId = int | str


@dataclass(frozen=True)
class ControlSpec:
    """One control input: which control (START, READY, END or CORRID) and the values it takes."""

    name: str
    kind: str
    datatype: str  # wire datatype of the tensor
    false_value: Any = 0
    true_value: Any = 1

    def value(self, flag: bool) -> Any:
        return self.true_value if flag else self.false_value


@dataclass(frozen=True)
class StateSpec:
    """One implicit state: fed to the model as ``input_name``, taken back from ``output_name``."""

    input_name: str
    output_name: str
    datatype: str
    dims: tuple[int, ...]
    # The state at a sequence's start. None: zeros (Triton leaves it uninitialized).
    initial: np.ndarray | None = None

    def initial_value(self) -> np.ndarray:
        if self.initial is not None:
            return self.initial.copy()  # a model may change its state input in place
        dims = tuple(d if d > 0 else 1 for d in self.dims)
        return np.zeros(dims, dtype=numpy_dtype(self.datatype))


@dataclass(frozen=True)
class SequenceSpec:
    """What the sequence batcher uses of ``sequence_batching``."""

    direct: bool = True  # strategy direct (the default) or oldest
    max_sequence_idle_us: int = DEFAULT_IDLE_US
    max_queue_delay_us: int = 0
    minimum_slot_utilization: float = 0.0  # direct
    max_candidate_sequences: int = 0  # oldest (direct: one slot per batch row)
    preferred_batch_sizes: tuple[int, ...] = ()  # oldest
    controls: tuple[ControlSpec, ...] = ()
    states: tuple[StateSpec, ...] = ()
    # iterative_sequence: a request is a sequence of its own (an id is given to one that has
    # none) which its model may reschedule (set_release_flags) until it completes.
    iterative: bool = False

    def control(self, kind: str) -> ControlSpec | None:
        return next((c for c in self.controls if c.kind == kind), None)

    @property
    def hidden_inputs(self) -> frozenset[str]:
        """Model inputs the server fills: the control inputs and the state inputs."""
        return frozenset([c.name for c in self.controls] + [s.input_name for s in self.states])

    @property
    def hidden_outputs(self) -> frozenset[str]:
        return frozenset(s.output_name for s in self.states)


def sequence_flags(parameters: dict[str, Any]) -> tuple[CorrelationId, bool, bool]:
    """(correlation id, START, END) of a request's parameters (the codecs checked their types)."""
    return (parameters.get("sequence_id", 0), bool(parameters.get("sequence_start", False)),
            bool(parameters.get("sequence_end", False)))


def hidden_tensor_names(config: Any) -> frozenset[str]:
    """Names of a config's control and state tensors (auto-complete leaves them out)."""
    if not config.HasField("sequence_batching"):
        return frozenset()
    sb = config.sequence_batching
    return frozenset([c.name for c in sb.control_input] + [s.input_name for s in sb.state]
                     + [s.output_name for s in sb.state])


def sequence_spec(config: Any, path: Path) -> SequenceSpec:
    """The sequence batcher's settings, checked as Triton checks them (errors name the file)."""
    sb = config.sequence_batching
    name = config.name
    controls = tuple(_control(c, name, path) for c in sb.control_input)
    seen: set[str] = set()
    for control in controls:
        if control.kind in seen:
            raise ModelConfigError(f"{path}: sequence batching specifies multiple "
                                   f"CONTROL_SEQUENCE_{control.kind} tensors for {name}")
        seen.add(control.kind)
    states = tuple(_state(s, name, path) for s in sb.state)
    declared = {t.name for t in config.input} | {t.name for t in config.output}
    for hidden in [c.name for c in controls] + [s.input_name for s in states] + [s.output_name for s in states]:
        if hidden in declared:
            raise ModelConfigError(f"{path}: '{hidden}' of sequence_batching for {name} is also declared as a "
                                   "model input or output; the server provides it")
    idle = int(sb.max_sequence_idle_microseconds) or DEFAULT_IDLE_US
    slots = max(int(config.max_batch_size), 1)  # per instance, Triton's default for both strategies
    if sb.WhichOneof("strategy_choice") == "oldest":
        oldest = sb.oldest
        for size in oldest.preferred_batch_size:
            if size <= 0:
                raise ModelConfigError(f"{path}: sequence batching preferred batch size must be positive for {name}")
            if size > max(config.max_batch_size, 1):
                raise ModelConfigError(f"{path}: sequence batching preferred batch size must be <= max batch size "
                                       f"for {name}")
        return SequenceSpec(direct=False, max_sequence_idle_us=idle,
                            max_queue_delay_us=int(oldest.max_queue_delay_microseconds),
                            max_candidate_sequences=int(oldest.max_candidate_sequences) or slots,
                            preferred_batch_sizes=tuple(sorted(int(s) for s in oldest.preferred_batch_size)),
                            controls=controls, states=states, iterative=sb.iterative_sequence)
    direct = sb.direct
    utilization = float(direct.minimum_slot_utilization)
    if not 0.0 <= utilization <= 1.0:
        raise ModelConfigError(f"{path}: sequence batching minimum slot utilization must be in range (0.0, 1.0] "
                               f"for {name}")
    return SequenceSpec(direct=True, max_sequence_idle_us=idle,
                        max_queue_delay_us=int(direct.max_queue_delay_microseconds),
                        minimum_slot_utilization=utilization, max_candidate_sequences=slots,
                        controls=controls, states=states, iterative=sb.iterative_sequence)


def _control(control_input: Any, model: str, path: Path) -> ControlSpec:
    name = control_input.name
    if not name:
        raise ModelConfigError(f"{path}: sequence batching control tensor must have a name for {model}")
    if len(control_input.control) != 1:
        raise ModelConfigError(f"{path}: sequence batching control tensor '{name}' must have exactly one "
                               f"control for {model}")
    control = control_input.control[0]
    kind = mc.ModelSequenceBatching.Control.Kind.Name(control.kind).removeprefix("CONTROL_SEQUENCE_")
    forms = [f for f in ("int32_false_true", "fp32_false_true", "bool_false_true") if getattr(control, f)]
    if kind == "CORRID":
        if forms:
            raise ModelConfigError(f"{path}: sequence batching control tensor '{name}' for {model} must not "
                                   "specify *_false_true values for CONTROL_SEQUENCE_CORRID")
        datatype = config_to_wire(mc.DataType.Name(control.data_type))
        if control.data_type == mc.TYPE_INVALID or datatype not in _CORRID_TYPES:
            raise ModelConfigError(f"{path}: unexpected data type for control CONTROL_SEQUENCE_CORRID for {model}. "
                                   "Allowed data types are TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 and "
                                   "TYPE_STRING")
        return ControlSpec(name, kind, datatype)
    if len(forms) != 1:
        raise ModelConfigError(f"{path}: sequence batching control tensor '{name}' for {model} must specify "
                               "exactly one of int32_false_true, fp32_false_true or bool_false_true")
    values = list(getattr(control, forms[0]))
    if len(values) != 2:
        raise ModelConfigError(f"{path}: sequence batching control tensor '{name}' for {model} must have "
                               f"exactly 2 entries in {forms[0]}")
    datatype = {"int32_false_true": "INT32", "fp32_false_true": "FP32", "bool_false_true": "BOOL"}[forms[0]]
    return ControlSpec(name, kind, datatype, values[0], values[1])


def _state(state: Any, model: str, path: Path) -> StateSpec:
    if not state.input_name or not state.output_name:
        raise ModelConfigError(f"{path}: a sequence batching state for {model} must have an input_name "
                               "and an output_name")
    if state.data_type == mc.TYPE_INVALID:
        raise ModelConfigError(f"{path}: sequence batching state '{state.input_name}' for {model} has no data_type")
    datatype = config_to_wire(mc.DataType.Name(state.data_type))
    dims = tuple(int(d) for d in state.dims)
    if not dims or any(d < -1 or d == 0 for d in dims):
        raise ModelConfigError(f"{path}: sequence batching state '{state.input_name}' for {model} has invalid "
                               f"dims {list(dims)}")
    if len(state.initial_state) > 1:
        raise ModelConfigError(f"{path}: sequence batching state '{state.input_name}' for {model} may have at "
                               "most one initial_state")
    initial = None
    for init in state.initial_state:
        shape = tuple(int(d) for d in init.dims)
        if any(d <= 0 for d in shape):
            raise ModelConfigError(f"{path}: initial state '{init.name}' of '{state.input_name}' for {model} "
                                   f"has invalid dims {list(shape)}")
        dtype = numpy_dtype(config_to_wire(mc.DataType.Name(init.data_type or state.data_type)))
        if init.WhichOneof("state_data") == "data_file":
            file = path.parent / "initial_state" / init.data_file
            try:
                raw = file.read_bytes()
            except OSError as exc:
                raise ModelConfigError(f"{path}: initial state file {file} for {model}: {exc.strerror}") from None
            expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
            if len(raw) != expected:
                raise ModelConfigError(f"{path}: initial state file {file} for {model} holds {len(raw)} bytes, "
                                       f"expected {expected} for dims {list(shape)}")
            initial = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
        else:
            initial = np.zeros(shape, dtype=dtype)
    return StateSpec(state.input_name, state.output_name, datatype, dims, initial)
