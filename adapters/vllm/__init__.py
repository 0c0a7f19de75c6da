"""Triton's vLLM backend (``backend: "vllm"``): a model folder with ``<version>/model.json``."""
