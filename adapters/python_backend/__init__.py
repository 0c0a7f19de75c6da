"""Triton's Python backend: existing ``model.py`` files (``TritonPythonModel``) run unmodified,
in the replica's own process."""
