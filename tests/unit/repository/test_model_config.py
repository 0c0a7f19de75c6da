"""config.pbtxt parsing, backend resolution, defaults, the frozen spec and the JSON form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from google.protobuf import text_format

from rayinfer.protocol.errors import ModelConfigError
from rayinfer.repository.model_config import (
    BatchingSpec,
    ModelConfig,
    QueuePolicy,
    TensorSpec,
    config_to_json,
    fill_defaults,
    mc,
    read_config,
    resolve_backend,
    spec_from_config,
)

IO = """
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
"""


def _model_dir(root: Path, name: str = "mymodel", config: str | None = None, files: tuple[str, ...] = ()) -> Path:
    model_dir = root / name
    model_dir.mkdir()
    if config is not None:
        (model_dir / "config.pbtxt").write_text(config)
    for rel in files:
        (model_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (model_dir / rel).write_bytes(b"")
    return model_dir


def _config(text: str) -> ModelConfig:
    return text_format.Parse(text, ModelConfig())


def test_read_config_defaults_name_to_folder(tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path, config='platform: "onnxruntime_onnx"' + IO)
    config = read_config(model_dir)
    assert config.name == "mymodel"
    assert config.input[0].name == "INPUT0"


def test_read_config_without_file(tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path)
    assert read_config(model_dir).name == "mymodel"
    with pytest.raises(ModelConfigError, match="config.pbtxt: model configuration file not found"):
        read_config(model_dir, required=True)


def test_read_config_name_mismatch_names_the_file(tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path, config='name: "other"')
    with pytest.raises(ModelConfigError) as info:
        read_config(model_dir)
    assert str(model_dir / "config.pbtxt") in info.value.message
    assert "'other' does not match its directory name 'mymodel'" in info.value.message


@pytest.mark.parametrize("text", ['name: "mymodel" max_batch_size: "eight"', "no_such_field: 1", "input [ {"])
def test_read_config_parse_error_names_the_file(tmp_path: Path, text: str) -> None:
    model_dir = _model_dir(tmp_path, config=text)
    with pytest.raises(ModelConfigError) as info:
        read_config(model_dir)
    assert info.value.message.startswith(f"{model_dir / 'config.pbtxt'}: failed to parse model configuration")


@pytest.mark.parametrize(
    "text, platform, backend, filename",
    [
        ('platform: "onnxruntime_onnx"', "onnxruntime_onnx", "onnxruntime", "model.onnx"),
        ('backend: "onnxruntime"', "onnxruntime_onnx", "onnxruntime", "model.onnx"),
        ('backend: "pytorch"', "pytorch_libtorch", "pytorch", "model.pt"),
        ('platform: "tensorrt_plan"', "tensorrt_plan", "tensorrt", "model.plan"),
        ('backend: "python"', "", "python", "model.py"),
        ('platform: "onnxruntime_onnx" default_model_filename: "x.onnx"', "onnxruntime_onnx", "onnxruntime", "x.onnx"),
        ('platform: "tensorflow_savedmodel"', "tensorflow_savedmodel", "tensorflow", "model.savedmodel"),
        ('platform: "tensorflow_graphdef"', "tensorflow_graphdef", "tensorflow", "model.graphdef"),
        ('backend: "openvino"', "", "openvino", "model.xml"),
        ('backend: "fil"', "", "fil", "xgboost.model"),
        ('backend: "fil" parameters { key: "model_type" value: { string_value: "lightgbm" } }', "", "fil", "model.txt"),
        ('backend: "fil" parameters { key: "model_type" value: { string_value: "xgboost_ubj" } }', "", "fil", "xgboost.ubj"),
    ],
)
def test_resolve_backend_from_each_other(tmp_path: Path, text: str, platform: str, backend: str, filename: str) -> None:
    config = _config(text)
    resolve_backend(config, tmp_path)
    assert (config.platform, config.backend, config.default_model_filename) == (platform, backend, filename)


def test_resolve_backend_inferred_from_model_file(tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path, files=("3/model.onnx",))
    config = read_config(model_dir)
    resolve_backend(config, model_dir)
    assert (config.platform, config.backend) == ("onnxruntime_onnx", "onnxruntime")
    assert config.default_model_filename == "model.onnx"


def test_resolve_backend_tells_tensorflow_platforms_from_the_files(tmp_path: Path) -> None:
    for files, platform in ((("1/model.savedmodel/saved_model.pb",), "tensorflow_savedmodel"),
                            (("1/model.graphdef",), "tensorflow_graphdef")):
        model_dir = _model_dir(tmp_path, name=platform, files=files)
        for text in ("", 'backend: "tensorflow"'):
            config = _config(text)
            resolve_backend(config, model_dir)
            assert (config.platform, config.backend) == (platform, "tensorflow")


def test_resolve_backend_without_any_hint(tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path, files=("1/weights.bin",))
    with pytest.raises(ModelConfigError, match="no 'platform' or 'backend' given"):
        resolve_backend(read_config(model_dir), model_dir)


def test_resolve_backend_mismatch_names_the_file(tmp_path: Path) -> None:
    config = _config('platform: "onnxruntime_onnx" backend: "pytorch"')
    with pytest.raises(ModelConfigError) as info:
        resolve_backend(config, tmp_path)
    assert info.value.message == (
        f"{tmp_path / 'config.pbtxt'}: platform 'onnxruntime_onnx' does not match backend 'pytorch'"
    )


def test_resolve_backend_unknown_platform(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="unknown platform 'caffe2_netdef'"):
        resolve_backend(_config('platform: "caffe2_netdef"'), tmp_path)


def test_fill_defaults() -> None:
    config = _config('name: "m"')
    fill_defaults(config)
    assert config.version_policy.WhichOneof("policy_choice") == "latest"
    assert config.version_policy.latest.num_versions == 1
    (group,) = config.instance_group
    assert (group.name, group.count) == ("m", 1)
    # Triton's default: a GPU instance when there is a GPU (resolved where the replica runs).
    assert mc.ModelInstanceGroup.Kind.Name(group.kind) == "KIND_AUTO"


def test_fill_defaults_keeps_given_values() -> None:
    config = _config('name: "m" version_policy { all {} } '
                     'instance_group [ { count: 2 kind: KIND_CPU }, { count: 0 kind: KIND_AUTO } ]')
    fill_defaults(config)
    assert config.version_policy.WhichOneof("policy_choice") == "all"
    assert [(g.name, g.count) for g in config.instance_group] == [("m", 2), ("m_1", 1)]
    assert mc.ModelInstanceGroup.Kind.Name(config.instance_group[1].kind) == "KIND_AUTO"


def _spec(text: str, path: Path = Path("/repo/m/config.pbtxt")):
    config = _config('name: "m" backend: "onnxruntime" ' + text)
    fill_defaults(config)
    return spec_from_config(config, path)


def test_spec_with_dynamic_batching_and_preferred_sizes() -> None:
    spec = _spec("max_batch_size: 8 dynamic_batching { preferred_batch_size: [ 8, 4 ] "
                 "max_queue_delay_microseconds: 100 }" + IO)
    assert spec.max_batch_size == 8
    assert spec.dynamic_batching == BatchingSpec(max_queue_delay_us=100, preferred_batch_sizes=(4, 8))
    assert spec.inputs == (TensorSpec("INPUT0", "FP32", (16,)),)
    assert spec.outputs == (TensorSpec("OUTPUT0", "BYTES", (-1,)),)
    assert spec.instance_count == 1 and spec.instance_kind == "KIND_CPU"
    assert set(spec.input_map) == {"INPUT0"} and set(spec.output_map) == {"OUTPUT0"}


def test_spec_without_dynamic_batching() -> None:
    assert _spec("max_batch_size: 8" + IO).dynamic_batching is None


@pytest.mark.parametrize("size", [0, 9])
def test_spec_invalid_preferred_size(size: int) -> None:
    with pytest.raises(ModelConfigError, match=f"preferred_batch_size {size} must be in 1..max_batch_size"):
        _spec(f"max_batch_size: 8 dynamic_batching {{ preferred_batch_size: [ {size} ] }}" + IO)


def test_spec_with_priority_levels_and_queue_policies() -> None:
    spec = _spec("max_batch_size: 8 dynamic_batching { priority_levels: 3 default_priority_level: 2 "
                 "default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 500 "
                 "allow_timeout_override: true max_queue_size: 4 } "
                 "priority_queue_policy { key: 1 value: { max_queue_size: 2 } } }" + IO)
    batching = spec.dynamic_batching
    assert (batching.priority_levels, batching.default_priority_level) == (3, 2)
    assert batching.default_queue_policy == QueuePolicy(delay_on_timeout=True, default_timeout_us=500,
                                                        allow_timeout_override=True, max_queue_size=4)
    assert batching.priority_queue_policy == ((1, QueuePolicy(max_queue_size=2)),)


@pytest.mark.parametrize("batching, message", [
    ("priority_levels: 2 default_priority_level: 0", r"default priority level must be in range \[1, 2\] for m"),
    ("priority_levels: 2 default_priority_level: 3", r"default priority level must be in range \[1, 2\] for m"),
    ("priority_levels: 2 default_priority_level: 1 priority_queue_policy { key: 3 value: { } }",
     r"priority queue policy must have priority level in range \[1, 2\] for m"),
    ("preserve_ordering: true priority_levels: 2 default_priority_level: 1",
     "Only one priority level is allowed when 'preserve_ordering' is true for m"),
    ("preserve_ordering: true default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 5 }",
     "Queue policy can not have DELAY as timeout action when 'preserve_ordering' is true for m"),
])
def test_spec_refuses_priority_settings_as_triton_does(batching: str, message: str) -> None:
    with pytest.raises(ModelConfigError, match="^/repo/m/config.pbtxt: " + message):
        _spec(f"max_batch_size: 8 dynamic_batching {{ {batching} }}" + IO)


SEQUENCE_CONTROLS = """control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] } ]
control_input [ { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] } ]
state [ { input_name: "SI" output_name: "SO" data_type: TYPE_INT32 dims: [ 2 ] initial_state { name: "z" data_type: TYPE_INT32 dims: [ 2 ] zero_data: true } } ]
"""


def test_spec_reads_sequence_batching_with_tritons_defaults() -> None:
    direct = _spec("max_batch_size: 8 sequence_batching { " + SEQUENCE_CONTROLS + " }" + IO).sequence_batching
    assert direct is not None and direct.direct and direct.max_candidate_sequences == 8
    assert direct.max_sequence_idle_us == 1_000_000
    start, corrid = direct.controls
    assert (start.kind, start.datatype, start.value(True), start.value(False)) == ("START", "FP32", 1.0, 0.0)
    assert (corrid.kind, corrid.datatype) == ("CORRID", "BYTES")
    (state,) = direct.states
    assert state.initial_value().tolist() == [0, 0]
    assert direct.hidden_inputs == {"S", "C", "SI"} and direct.hidden_outputs == {"SO"}
    oldest = _spec("max_batch_size: 4 sequence_batching { oldest { preferred_batch_size: 2 } "
                   "max_sequence_idle_microseconds: 5 }" + IO).sequence_batching
    assert oldest is not None and not oldest.direct
    assert (oldest.max_candidate_sequences, oldest.preferred_batch_sizes, oldest.max_sequence_idle_us) == (4, (2,), 5)


@pytest.mark.parametrize("sequence, message", [
    ('control_input [ { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_FP32 } ] } ]',
     "unexpected data type for control CONTROL_SEQUENCE_CORRID for m. Allowed data types are TYPE_UINT64, "
     "TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING"),
    ('control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 1 ] } ] } ]',
     "sequence batching control tensor 'S' for m must have exactly 2 entries in int32_false_true"),
    ("direct { minimum_slot_utilization: 1.5 }",
     "sequence batching minimum slot utilization must be in range \\(0.0, 1.0\\] for m"),
    ("oldest { preferred_batch_size: 16 }", "sequence batching preferred batch size must be <= max batch size for m"),
    ('control_input [ { name: "INPUT0" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] } ]',
     "'INPUT0' of sequence_batching for m is also declared as a model input or output"),
])
def test_spec_refuses_sequence_settings_as_triton_does(sequence: str, message: str) -> None:
    with pytest.raises(ModelConfigError, match="^/repo/m/config.pbtxt: " + message):
        _spec(f"max_batch_size: 8 sequence_batching {{ {sequence} }}" + IO)


def test_spec_rejects_decoupled_and_negative_batch_size() -> None:
    with pytest.raises(ModelConfigError, match="decoupled"):
        _spec("model_transaction_policy { decoupled: true }" + IO)
    with pytest.raises(ModelConfigError, match="max_batch_size must be >= 0"):
        _spec("max_batch_size: -1" + IO)


def test_spec_reshape_and_parameters() -> None:
    spec = _spec('input [ { name: "I" data_type: TYPE_INT32 dims: [ 16 ] reshape { shape: [ 4, 4 ] } } ]'
                 ' output [ { name: "O" data_type: TYPE_INT32 dims: [ 1 ] reshape { shape: [ ] } } ]'
                 ' parameters { key: "intra_op_thread_count" value: { string_value: "1" } }')
    assert spec.inputs[0].reshape == (4, 4) and spec.inputs[0].dims == (16,)
    assert spec.outputs[0].reshape == ()
    assert spec.parameters == {"intra_op_thread_count": "1"}


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "at least one output"),
        ('input [ { name: "I" data_type: TYPE_FP32 dims: [ 1 ] } ]', "at least one output"),
        ('input [ { name: "I" data_type: TYPE_FP32 dims: [ 0 ] } ] output [ { name: "O" data_type: TYPE_FP32 dims: [ 1 ] } ]',
         "input 'I' has invalid dims [0]"),
        ('input [ { name: "I" dims: [ 1 ] } ] output [ { name: "O" data_type: TYPE_FP32 dims: [ 1 ] } ]',
         "input 'I' has no data_type"),
    ],
)
def test_spec_tensor_errors(text: str, message: str) -> None:
    with pytest.raises(ModelConfigError) as info:
        _spec(text)
    assert info.value.message.startswith("/repo/m/config.pbtxt: ")
    assert message in info.value.message


def test_config_to_json_numbers_and_enum_names() -> None:
    config = _config('name: "m" max_batch_size: 8 dynamic_batching { max_queue_delay_microseconds: 500 }'
                     + IO.replace("dims: [ -1 ]", "dims: [ 16 ]"))
    fill_defaults(config)
    doc = json.loads(json.dumps(config_to_json(config)))
    assert doc["name"] == "m" and doc["max_batch_size"] == 8
    assert doc["input"][0]["dims"] == [16]
    assert doc["input"][0]["data_type"] == "TYPE_FP32"
    assert doc["output"][0]["data_type"] == "TYPE_STRING"
    assert doc["dynamic_batching"]["max_queue_delay_microseconds"] == 500
    assert isinstance(doc["dynamic_batching"]["max_queue_delay_microseconds"], int)
    assert doc["instance_group"][0]["kind"] == "KIND_AUTO"
    assert doc["version_policy"] == {"latest": {"num_versions": 1}}
    assert "sequence_batching" not in doc  # unset messages are left out


def test_config_to_json_maps() -> None:
    config = _config('name: "m" parameters { key: "k" value: { string_value: "v" } }')
    assert config_to_json(config)["parameters"] == {"k": {"string_value": "v"}}


def test_output_labels_come_from_the_model_folder(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "labels.txt").write_text("cat\ndog\n")
    path = tmp_path / "m" / "config.pbtxt"
    labelled = 'max_batch_size: 8 input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ] output [ { name: "Y" ' \
               'data_type: TYPE_FP32 dims: [ 2 ] label_filename: "%s" } ]'
    assert _spec(labelled % "labels.txt", path).outputs[0].labels == ("cat", "dog", "")
    with pytest.raises(ModelConfigError, match="unable to read label file .*missing.txt for output 'Y'"):
        _spec(labelled % "missing.txt", path)
    with pytest.raises(ModelConfigError, match="label file path '../labels.txt' for output 'Y' in model 'm' is "
                                               "outside model directory"):
        _spec(labelled % "../labels.txt", path)
