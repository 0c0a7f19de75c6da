"""The ``vllm`` backend: runs :mod:`vllm_model` (a ``TritonPythonModel`` over vLLM's engine) as a
Python model, as Triton's vLLM backend is a Python-based backend; the model's folder holds its
``config.pbtxt`` and ``<version>/model.json`` (vLLM's engine arguments), no ``model.py``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from rayinfer.adapters.python_backend.backend import PythonBackendAdapter
from rayinfer.protocol.errors import ModelConfigError

ENGINE_ARGUMENTS = "model.json"
MODEL_CODE = Path(__file__).with_name("vllm_model.py")


class VllmAdapter(PythonBackendAdapter):
    def model_path(self, model_dir: Path, version: int, config: Any) -> Path:
        arguments = model_dir / str(version) / ENGINE_ARGUMENTS
        if not arguments.is_file():
            raise ModelConfigError(f"'{ENGINE_ARGUMENTS}' containing vllm engine args must be provided in "
                                   f"'{arguments.parent}'")
        if importlib.util.find_spec("vllm") is None:
            raise ModelConfigError(f"model '{config.name}': backend 'vllm' needs vLLM installed here (the vllm "
                                   "extra, on a machine with an NVIDIA GPU)")
        return MODEL_CODE
