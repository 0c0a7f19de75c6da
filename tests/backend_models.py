"""The test repository's FIL, OpenVINO and TensorFlow models beyond the example repository's
(``fil_forest``, ``mlp_openvino``, ``tf_mlp``), built in code at test time."""

from __future__ import annotations

from pathlib import Path

from rayinfer.cluster.example_backends import (
    lightgbm_forest, tf_mlp_module, write_forest, write_tf_graphdef, xgboost_forest,
)

# A LightGBM classifier whose config names no tensors: auto-complete fills them from the forest.
FIL_LIGHTGBM_CONFIG = """backend: "fil"
instance_group [ { count: 1 kind: KIND_CPU } ]
dynamic_batching { max_queue_delay_microseconds: 20000 }
parameters { key: "model_type" value: { string_value: "lightgbm" } }
parameters { key: "output_class" value: { string_value: "true" } }
parameters { key: "cpu_nthread" value: { string_value: "1" } }
"""

# A three-class forest as a Treelite checkpoint: output__0 is the class index.
FIL_TREELITE_CONFIG = """backend: "fil"
max_batch_size: 16
input [ { name: "input__0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "output__0" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "model_type" value: { string_value: "treelite_checkpoint" } }
parameters { key: "output_class" value: { string_value: "true" } }
"""

FIL_CORRUPT_CONFIG = FIL_TREELITE_CONFIG.replace("treelite_checkpoint", "xgboost_json")

TF_GRAPHDEF_CONFIG = """platform: "tensorflow_graphdef"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 8 ] } ]
output [ { name: "Identity" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

# Loaded by the tests that need them, not at the server's start.
BACKEND_NOT_LOADED_AT_START = ("fil_treelite", "fil_corrupt", "tf_graphdef")
# The example models' queue delay, longer in the test repository so that concurrent requests meet.
TEST_QUEUE_DELAY_US = 20000


def write_backend_test_models(root: Path) -> None:
    import treelite

    for name in ("fil_forest", "mlp_openvino", "tf_mlp"):
        config = root / name / "config.pbtxt"
        config.write_text(config.read_text().replace("max_queue_delay_microseconds: 500",
                                                     f"max_queue_delay_microseconds: {TEST_QUEUE_DELAY_US}"))
    write_forest(root, "fil_lightgbm", FIL_LIGHTGBM_CONFIG, lightgbm_forest(), "model.txt")
    three_classes = xgboost_forest("multi:softprob", trees=20, classes=3)
    version_dir = root / "fil_treelite" / "1"
    version_dir.mkdir(parents=True)
    (root / "fil_treelite" / "config.pbtxt").write_text(FIL_TREELITE_CONFIG)
    treelite.frontend.from_xgboost(three_classes).serialize(str(version_dir / "checkpoint.tl"))
    three_classes.save_model(str(version_dir / "reference.json"))  # what the tests predict with
    (root / "fil_corrupt" / "1").mkdir(parents=True)
    (root / "fil_corrupt" / "config.pbtxt").write_text(FIL_CORRUPT_CONFIG)
    (root / "fil_corrupt" / "1" / "xgboost.json").write_text('{"learner": "this is not an XGBoost model"')
    write_tf_graphdef(root, "tf_graphdef", TF_GRAPHDEF_CONFIG, tf_mlp_module()[0])
