"""The rollout tests' model: a Python model with versions 1 and 2 (OUTPUT0 = INPUT0 x version),
version 2 behaving as its config's ``candidate_behaviour`` says: "good", "failing" (one request
in five fails), "slow" (three times version 1's delay, ``delay_ms``) or "same" (version 1's
answers: OUTPUT0 = INPUT0)."""

from __future__ import annotations

import json
from pathlib import Path

ROLLOUT_MODEL = "rollout_py"
ROLLOUT_NOT_LOADED_AT_START = (ROLLOUT_MODEL,)
FAILURE = "candidate failure (one request in five)"

_CONFIG = {
    "name": ROLLOUT_MODEL, "backend": "python", "max_batch_size": 8,
    "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [1]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [1]}],
    "instance_group": [{"kind": "KIND_CPU", "count": 1}],
}

_CODE = f'''import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        parameters = json.loads(args["model_config"]).get("parameters", {{}})
        self.version = int(args["model_version"])
        behaviour = parameters.get("candidate_behaviour", {{}}).get("string_value", "good")
        self.behaviour = behaviour if self.version > 1 else "good"
        self.delay_s = float(parameters.get("delay_ms", {{}}).get("string_value", "2")) / 1000
        self.calls = 0

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            self.calls += 1
            if self.behaviour == "failing" and self.calls % 5 == 0:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("{FAILURE}")))
                continue
            time.sleep(self.delay_s * (3 if self.behaviour == "slow" else 1))
            factor = 1 if self.behaviour == "same" else self.version
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", (x * factor).astype(np.float32))]))
        return responses
'''


def rollout_config(behaviour: str = "good", versions: dict | None = None, delay_ms: float = 2.0,
                   **parameters: str) -> str:
    """The model's config in Triton's JSON form (a load request's ``config``), with
    ``version_policy`` (default: both versions) and ``parameters``."""
    config = dict(_CONFIG, version_policy=versions or {"latest": {"num_versions": 2}})
    values = {"candidate_behaviour": behaviour, "delay_ms": str(delay_ms), **parameters}
    config["parameters"] = {key: {"string_value": value} for key, value in values.items()}
    return json.dumps(config)


def write_rollout_models(root: Path) -> None:
    for version in (1, 2):
        (root / ROLLOUT_MODEL / str(version)).mkdir(parents=True)
        (root / ROLLOUT_MODEL / str(version) / "model.py").write_text(_CODE)
    config = json.loads(rollout_config())
    (root / ROLLOUT_MODEL / "config.pbtxt").write_text(
        f'name: "{ROLLOUT_MODEL}"\nbackend: "python"\nmax_batch_size: 8\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'instance_group [ { kind: KIND_CPU count: 1 } ]\n'
        'version_policy: { latest: { num_versions: 2 } }\n')
    assert config["name"] == ROLLOUT_MODEL
