"""``config.pbtxt`` -> Triton's ``ModelConfig`` protobuf -> a frozen :class:`ModelSpec`.

Triton's own message definitions (shipped with ``tritonclient``) are the source of truth, so
every config Triton accepts parses here; what rayinfer does not support yet is rejected with
an error naming the file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor

from rayinfer.protocol.dtypes import config_to_wire, wire_to_config
from rayinfer.protocol.errors import ModelConfigError
from rayinfer.protocol.statistics import FIRST_RESPONSE_BUCKETS_MS, FIRST_RESPONSE_HISTOGRAM
from rayinfer.repository.sequence_config import SequenceSpec, hidden_tensor_names, sequence_spec
from tritonclient.grpc import model_config_pb2 as mc

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    # The generated protobuf classes ship without type stubs.
    ModelConfig = Any
else:
    ModelConfig = mc.ModelConfig

CONFIG_FILENAME = "config.pbtxt"

# platform <-> backend pairs Triton accepts, and the default file name of each backend.
_PLATFORM_TO_BACKEND = {
    "onnxruntime_onnx": "onnxruntime",
    "pytorch_libtorch": "pytorch",
    "tensorrt_plan": "tensorrt",
    "tensorflow_savedmodel": "tensorflow",
    "tensorflow_graphdef": "tensorflow",
    "ensemble": "",
}
# A backend's one platform (tensorflow has two: told apart by the model file).
_BACKEND_TO_PLATFORM = {b: p for p, b in _PLATFORM_TO_BACKEND.items() if b and b != "tensorflow"}
DEFAULT_MODEL_FILENAMES = {
    "onnxruntime": "model.onnx",
    "pytorch": "model.pt",
    "tensorrt": "model.plan",
    "python": "model.py",
    "openvino": "model.xml",
}
# Where a platform's default file differs from its backend's.
_PLATFORM_MODEL_FILENAMES = {
    "tensorflow_savedmodel": "model.savedmodel",
    "tensorflow_graphdef": "model.graphdef",
}
# FIL's default file depends on its model_type parameter (Triton's names).
FIL_MODEL_FILES = {
    "xgboost": "xgboost.model",
    "xgboost_json": "xgboost.json",
    "xgboost_ubj": "xgboost.ubj",
    "lightgbm": "model.txt",
    "treelite_checkpoint": "checkpoint.tl",
}


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a model as declared in its config (dims exclude the batch dim)."""

    name: str
    datatype: str
    dims: tuple[int, ...]
    reshape: tuple[int, ...] | None = None
    optional: bool = False
    # An output's class labels, line i of its label_filename for class i (classification).
    labels: tuple[str, ...] | None = None


@dataclass(frozen=True)
class QueuePolicy:
    """Triton's ``ModelQueuePolicy`` for one priority level's queue (0: no limit, no timeout)."""

    delay_on_timeout: bool = False  # timeout_action DELAY (else REJECT)
    default_timeout_us: int = 0
    allow_timeout_override: bool = False
    max_queue_size: int = 0

    def timeout_us(self, requested_us: int) -> int:
        """A request's queue timeout: the default, or the request's own if the policy allows it
        and it is shorter (Triton's rule: a request may only shorten the default, so with no
        default timeout a request's own is ignored)."""
        timeout = self.default_timeout_us
        if self.allow_timeout_override and 0 < requested_us < timeout:
            timeout = requested_us
        return timeout


@dataclass(frozen=True)
class BatchingSpec:
    """Triton's ``dynamic_batching`` settings used by the batcher.

    Priority levels run from 1 (the highest) to ``priority_levels``; 0 levels means one queue.
    """

    max_queue_delay_us: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    preserve_ordering: bool = False
    priority_levels: int = 0
    default_priority_level: int = 0
    default_queue_policy: QueuePolicy = QueuePolicy()
    # (level, policy) pairs for the levels with a policy of their own.
    priority_queue_policy: tuple[tuple[int, QueuePolicy], ...] = ()


@dataclass(frozen=True)
class ModelSpec:
    """What rayinfer uses of one model's config; ``config`` keeps the full message."""

    name: str
    backend: str
    platform: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    dynamic_batching: BatchingSpec | None
    instance_count: int
    instance_kind: str
    default_model_filename: str
    parameters: dict[str, str] = field(default_factory=dict)
    config: Any = field(default=None, compare=False, repr=False)
    sequence_batching: SequenceSpec | None = None
    # The time to first response's bucket bounds, in ms (the config's model_metrics, else Triton's).
    first_response_buckets: tuple[float, ...] = FIRST_RESPONSE_BUCKETS_MS

    @property
    def input_map(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.inputs}

    @property
    def output_map(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.outputs}


def read_config(model_dir: Path, *, required: bool = False, override: str | None = None) -> ModelConfig:
    """Parse ``<model_dir>/config.pbtxt``; a missing file gives an empty config unless required.

    ``override``: a config in Triton's JSON form (a load request's ``parameters.config``) used
    instead of the file.
    """
    path = model_dir / CONFIG_FILENAME
    config = ModelConfig()
    if override is not None:
        try:
            json_format.Parse(override, config)
        except json_format.ParseError as exc:
            raise ModelConfigError(
                f"failed to parse the configuration override of model '{model_dir.name}': {exc}"
            ) from None
    elif not path.exists():
        if required:
            raise ModelConfigError(f"{path}: model configuration file not found")
    else:
        try:
            text_format.Parse(path.read_text(), config)
        except (text_format.ParseError, UnicodeDecodeError) as exc:
            raise ModelConfigError(f"{path}: failed to parse model configuration: {exc}") from None
    if not config.name:
        config.name = model_dir.name
    elif config.name != model_dir.name:
        raise ModelConfigError(
            f"{path}: model name '{config.name}' does not match its directory name "
            f"'{model_dir.name}'"
        )
    return config


def resolve_backend(config: ModelConfig, model_dir: Path) -> None:
    """Fill in ``backend``/``platform`` as Triton does, from each other or the model files."""
    path = model_dir / CONFIG_FILENAME
    if config.platform and config.platform not in _PLATFORM_TO_BACKEND:
        raise ModelConfigError(f"{path}: unknown platform '{config.platform}'")
    if config.platform and not config.backend:
        config.backend = _PLATFORM_TO_BACKEND[config.platform]
    if config.backend and not config.platform and config.backend in _BACKEND_TO_PLATFORM:
        config.platform = _BACKEND_TO_PLATFORM[config.backend]
    if config.platform and config.backend and config.platform != "ensemble":
        if _PLATFORM_TO_BACKEND[config.platform] != config.backend:
            raise ModelConfigError(
                f"{path}: platform '{config.platform}' does not match backend '{config.backend}'"
            )
    if config.backend == "tensorflow" and not config.platform:
        graphdef = _has_version_file(model_dir, _PLATFORM_MODEL_FILENAMES["tensorflow_graphdef"])
        config.platform = "tensorflow_graphdef" if graphdef else "tensorflow_savedmodel"
    if not config.backend and config.platform != "ensemble":
        # Triton's platform detection from the model files (OpenVINO and FIL need a backend).
        candidates = [(b, _BACKEND_TO_PLATFORM.get(b, ""), f) for b, f in DEFAULT_MODEL_FILENAMES.items()
                      if b != "openvino"] + [("tensorflow", p, f) for p, f in _PLATFORM_MODEL_FILENAMES.items()]
        for backend, platform, filename in candidates:
            if _has_version_file(model_dir, filename):
                config.backend = backend
                config.platform = platform
                break
        else:
            raise ModelConfigError(
                f"{path}: no 'platform' or 'backend' given and no model file found to infer it"
            )
    if not config.default_model_filename:
        config.default_model_filename = default_model_filename(config)


def default_model_filename(config: ModelConfig) -> str:
    """Triton's default model file name for the config's platform or backend ('' if none)."""
    if config.platform in _PLATFORM_MODEL_FILENAMES:
        return _PLATFORM_MODEL_FILENAMES[config.platform]
    if config.backend == "fil":
        model_type = config.parameters["model_type"].string_value.strip() if "model_type" in config.parameters else ""
        return FIL_MODEL_FILES.get(model_type or "xgboost", "")
    return DEFAULT_MODEL_FILENAMES.get(config.backend, "")


def _has_version_file(model_dir: Path, filename: str) -> bool:
    return any((v / filename).exists() for v in model_dir.iterdir() if v.is_dir())


def fill_defaults(config: ModelConfig) -> None:
    """Triton's defaults for fields a config may leave out (version policy, instance group)."""
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    if config.platform == "ensemble":  # an ensemble runs no model of its own: no instances
        return
    if not config.instance_group:  # Triton's default: one instance, on a GPU when there is one
        config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_AUTO)
    for index, group in enumerate(config.instance_group):
        if not group.name:
            group.name = f"{config.name}_{index}" if index else config.name
        if group.count < 1:
            group.count = 1


def check_supported(config: ModelConfig, path: Path) -> None:
    """Reject config features rayinfer does not implement yet, naming the file."""
    unsupported = []
    if config.HasField("ensemble_scheduling") and config.platform != "ensemble":
        raise ModelConfigError(f"{path}: ensemble_scheduling is only for platform 'ensemble'")
    if config.model_transaction_policy.decoupled and config.backend not in ("python", "vllm") \
            and config.platform != "ensemble":
        unsupported.append("decoupled model_transaction_policy (only Python and vLLM models may be decoupled)")
    if unsupported:
        raise ModelConfigError(f"{path}: not supported yet: {', '.join(unsupported)}")
    if config.max_batch_size < 0:
        raise ModelConfigError(f"{path}: max_batch_size must be >= 0, got {config.max_batch_size}")


def spec_from_config(config: ModelConfig, path: Path) -> ModelSpec:
    """Build the frozen spec from a complete (possibly auto-completed) config."""
    check_supported(config, path)
    inputs = tuple(_tensor(t, path, "input") for t in config.input)
    outputs = tuple(_with_labels(_tensor(t, path, "output"), t.label_filename, config.name, path)
                    for t in config.output)
    if not outputs:  # a model may take no inputs (Triton loads it; its requests carry none)
        raise ModelConfigError(f"{path}: model must declare at least one output")
    batching = None
    if config.HasField("dynamic_batching"):
        db = config.dynamic_batching
        for size in db.preferred_batch_size:
            if size <= 0 or size > max(config.max_batch_size, 1):
                raise ModelConfigError(
                    f"{path}: preferred_batch_size {size} must be in 1..max_batch_size "
                    f"({config.max_batch_size})"
                )
        batching = _batching_spec(db, config.name, path)
    count = sum(max(g.count, 1) for g in config.instance_group) or 1
    kinds = {mc.ModelInstanceGroup.Kind.Name(g.kind) for g in config.instance_group}
    kind = "KIND_GPU" if "KIND_GPU" in kinds else "KIND_CPU"
    return ModelSpec(
        name=config.name,
        backend=config.backend,
        platform=config.platform,
        max_batch_size=int(config.max_batch_size),
        inputs=inputs,
        outputs=outputs,
        dynamic_batching=batching,
        instance_count=count,
        instance_kind=kind,
        default_model_filename=config.default_model_filename,
        parameters={k: v.string_value for k, v in config.parameters.items()},
        config=config,
        sequence_batching=sequence_spec(config, path) if config.HasField("sequence_batching") else None,
        first_response_buckets=first_response_buckets(config, path),
    )


def first_response_buckets(config: ModelConfig, path: Path) -> tuple[float, ...]:
    """The bucket bounds of the model's time to first response: its ``model_metrics``' for
    Triton's family, else Triton's. A metric control that lacks a part is refused with Triton's
    message; one for another family is only logged (Triton customizes no other)."""
    buckets = FIRST_RESPONSE_BUCKETS_MS
    for control in config.model_metrics.metric_control:
        if not control.HasField("metric_identifier"):
            raise ModelConfigError(f"{path}: metric control must specify 'metric_identifier'")
        family = control.metric_identifier.family
        if not family:
            raise ModelConfigError(f"{path}: metric identifier must specify non-empty 'family'")
        if not control.HasField("histogram_options"):
            raise ModelConfigError(f"{path}: metric control must specify 'histogram_options'")
        bounds = tuple(control.histogram_options.buckets)
        if not bounds:
            raise ModelConfigError(f"{path}: histogram options must specify non-empty 'buckets'")
        if family != FIRST_RESPONSE_HISTOGRAM:
            logger.warning("%s: Metric family '%s' in 'metric_identifier' is not a customizable metric in "
                           "Triton core.", path, family)
            continue
        if any(b <= a for a, b in zip(bounds, bounds[1:])):
            raise ModelConfigError(f"{path}: the buckets of '{family}' must be strictly ascending, got {list(bounds)}")
        buckets = bounds
    return buckets


def _queue_policy(policy: Any) -> QueuePolicy:
    return QueuePolicy(
        delay_on_timeout=policy.timeout_action == mc.ModelQueuePolicy.DELAY,
        default_timeout_us=int(policy.default_timeout_microseconds),
        allow_timeout_override=bool(policy.allow_timeout_override),
        max_queue_size=int(policy.max_queue_size),
    )


def _batching_spec(db: Any, name: str, path: Path) -> BatchingSpec:
    """The batcher's settings from ``dynamic_batching``, with Triton's checks of the priority
    levels and queue policies (its messages, after the file's path)."""
    levels = int(db.priority_levels)
    default_level = int(db.default_priority_level)
    policies = {int(k): _queue_policy(v) for k, v in db.priority_queue_policy.items()}
    default_policy = _queue_policy(db.default_queue_policy)
    if levels:
        if not 1 <= default_level <= levels:
            raise ModelConfigError(f"{path}: default priority level must be in range [1, {levels}] for {name}")
        if any(not 1 <= level <= levels for level in policies):
            raise ModelConfigError(
                f"{path}: priority queue policy must have priority level in range [1, {levels}] for {name}")
    if db.preserve_ordering:
        if levels > 1:
            raise ModelConfigError(
                f"{path}: Only one priority level is allowed when 'preserve_ordering' is true for {name}")
        for policy in (default_policy, *policies.values()):
            if policy.default_timeout_us and policy.delay_on_timeout:
                raise ModelConfigError(f"{path}: Queue policy can not have DELAY as timeout action when "
                                       f"'preserve_ordering' is true for {name}")
    return BatchingSpec(
        max_queue_delay_us=int(db.max_queue_delay_microseconds),
        preferred_batch_sizes=tuple(sorted(int(s) for s in db.preferred_batch_size)),
        preserve_ordering=bool(db.preserve_ordering),
        priority_levels=levels,
        default_priority_level=default_level if levels else 0,
        default_queue_policy=default_policy,
        priority_queue_policy=tuple(sorted(policies.items())),
    )


def _with_labels(tensor: TensorSpec, label_filename: str, model: str, path: Path) -> TensorSpec:
    """The output with the labels of its ``label_filename`` (in the model's folder), if any."""
    if not label_filename:
        return tensor
    model_dir = path.parent.resolve()
    file = (model_dir / label_filename).resolve()
    if not file.is_relative_to(model_dir):
        raise ModelConfigError(f"{path}: label file path '{label_filename}' for output '{tensor.name}' in model "
                               f"'{model}' is outside model directory")
    try:
        text = file.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ModelConfigError(f"{path}: unable to read label file {file} for output '{tensor.name}': "
                               f"{exc.strerror}") from None
    return replace(tensor, labels=tuple(text.split("\n")))


def _tensor(t: Any, path: Path, what: str) -> TensorSpec:
    if not t.name:
        raise ModelConfigError(f"{path}: an {what} has no name")
    if t.data_type == mc.TYPE_INVALID:
        raise ModelConfigError(f"{path}: {what} '{t.name}' has no data_type")
    dims = tuple(int(d) for d in t.dims)
    if any(d < -1 or d == 0 for d in dims):
        raise ModelConfigError(f"{path}: {what} '{t.name}' has invalid dims {list(dims)}")
    reshape = tuple(int(d) for d in t.reshape.shape) if t.HasField("reshape") else None
    return TensorSpec(
        name=t.name,
        datatype=config_to_wire(mc.DataType.Name(t.data_type)),
        dims=dims,
        reshape=reshape,
        optional=bool(getattr(t, "optional", False)),
    )


# A model file's tensor for auto-complete: (name, wire datatype, shape with -1 where dynamic,
# the batch dimension included).
ModelTensor = tuple[str, str, list[int]]


def auto_complete_io(config: ModelConfig, inputs: list[ModelTensor], outputs: list[ModelTensor],
                     batch_size: int) -> None:
    """Triton's auto-complete from what a model file declares: a config with no inputs, outputs
    or max_batch_size gets ``batch_size`` (0: the model does not batch) and dynamic batching;
    then every tensor the config lacks is added, without the batch dimension when it batches."""
    if not config.input and not config.output and config.max_batch_size == 0 and batch_size > 0:
        config.max_batch_size = batch_size
        if not config.HasField("dynamic_batching") and not config.HasField("sequence_batching"):
            config.dynamic_batching.SetInParent()
    skip = 1 if config.max_batch_size > 0 else 0
    hidden = hidden_tensor_names(config)  # a sequence model's control and state tensors
    for repeated, tensors in ((config.input, inputs), (config.output, outputs)):
        declared = {t.name for t in repeated} | hidden
        for name, wire, shape in tensors:
            if name in declared:
                continue
            added = repeated.add(name=name)
            added.data_type = mc.DataType.Value(wire_to_config(wire))
            added.dims.extend(shape[skip:])


def config_to_json(config: ModelConfig) -> dict[str, Any]:
    """Triton's JSON form of a config: every field with its default, 64-bit ints as numbers."""
    return _message_to_dict(config)


def _message_to_dict(msg: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fd in msg.DESCRIPTOR.fields:
        value = getattr(msg, fd.name)
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            value_fd = fd.message_type.fields_by_name["value"]
            out[fd.name] = {k: _scalar_or_message(value_fd, v) for k, v in value.items()}
        elif fd.is_repeated:
            out[fd.name] = [_scalar_or_message(fd, v) for v in value]
        elif fd.containing_oneof is not None and msg.WhichOneof(fd.containing_oneof.name) != fd.name:
            continue
        elif fd.message_type is not None and not msg.HasField(fd.name):
            continue
        else:
            out[fd.name] = _scalar_or_message(fd, value)
    return out


def _scalar_or_message(fd: FieldDescriptor, value: Any) -> Any:
    if fd.message_type is not None:
        return _message_to_dict(value)
    if fd.enum_type is not None:
        return fd.enum_type.values_by_number[value].name
    return value
