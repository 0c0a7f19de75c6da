"""The vllm backend where vLLM is not installed (this machine): Triton's config rules and clear
load errors; what runs through vLLM itself is tests/integration/test_vllm_gpu.py (needs a GPU)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from rayinfer.adapters import python_backend
from rayinfer.adapters.loader import load_runner
from rayinfer.adapters.python_backend import triton_python_backend_utils as pb_utils
from rayinfer.adapters.python_backend.auto_complete import ModelConfig
from rayinfer.protocol.errors import ModelConfigError


def vllm_model(root: Path, arguments: dict | None) -> Path:
    folder = root / "opt"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text('backend: "vllm"\ninstance_group [ { count: 1 kind: KIND_MODEL } ]\n')
    if arguments is not None:
        (folder / "1" / "model.json").write_text(json.dumps(arguments))
    return folder


def test_a_model_without_its_engine_arguments_names_the_file_it_needs(tmp_path: Path) -> None:
    vllm_model(tmp_path, None)
    with pytest.raises(ModelConfigError, match=r"'model.json' containing vllm engine args must be provided in '.*opt/1'"):
        load_runner(tmp_path, "opt", 1)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_installed_the_load_error_says_what_is_missing(tmp_path: Path) -> None:
    vllm_model(tmp_path, {"model": "facebook/opt-125m"})
    with pytest.raises(ModelConfigError, match="model 'opt': backend 'vllm' needs vLLM installed here"):
        load_runner(tmp_path, "opt", 1)


def test_auto_complete_gives_the_vllm_backends_tensors_and_makes_it_decoupled() -> None:
    assert python_backend  # the package that provides triton_python_backend_utils to model code
    sys.modules.setdefault("triton_python_backend_utils", pb_utils)
    spec = importlib.util.spec_from_file_location(
        "vllm_model_under_test", Path(python_backend.__file__).parents[1] / "vllm" / "vllm_model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports vLLM only when the model initializes
    config = ModelConfig({"name": "opt", "backend": "vllm",
                          "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]}]})
    completed = module.TritonPythonModel.auto_complete_config(config).as_dict()
    inputs = {t["name"]: t for t in completed["input"]}
    assert inputs["text_input"] == {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]}
    assert all(inputs[name]["optional"] for name in inputs if name != "text_input")
    assert {"stream", "sampling_parameters", "exclude_input_in_output", "return_num_output_tokens"} <= set(inputs)
    assert [t["name"] for t in completed["output"]] == ["text_output", "finish_reason", "cumulative_logprob",
                                                        "logprobs", "num_input_tokens", "num_output_tokens"]
    assert completed["model_transaction_policy"] == {"decoupled": True} and completed["max_batch_size"] == 0
    with pytest.raises(pb_utils.TritonModelException, match="max_batch_size 8"):
        module.TritonPythonModel.auto_complete_config(ModelConfig({"name": "opt", "max_batch_size": 8}))
