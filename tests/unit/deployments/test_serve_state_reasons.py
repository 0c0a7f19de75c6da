"""Why a model failed, in one line, from Serve's failure messages."""

from __future__ import annotations

from rayinfer.deployments.serve_state import short_reason


def test_the_exception_line_of_a_traceback() -> None:
    message = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
               "rayinfer.protocol.errors.ModelConfigError: model.onnx: not an ONNX model\n")
    assert short_reason(message) == "model.onnx: not an ONNX model"


def test_pips_own_error_when_a_runtime_environment_failed() -> None:
    message = ("ray.exceptions.RuntimeEnvSetupError: Failed to set up runtime environment.\n"
               "Run cmd[13] failed with the following details.\n"
               "ERROR: Could not find a version that satisfies the requirement nope==1 (from versions: none)\n"
               "ERROR: No matching distribution found for nope==1\n")
    assert short_reason(message) == "pip could not install the model's requirements: No matching distribution found for nope==1"
