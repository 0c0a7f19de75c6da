"""Reading the trace extension's settings and trace files in tests (Triton's trace mode)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tritonclient.grpc as grpcclient

# Triton's timestamps of a model's request, in order.
ORDER = ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END",
         "REQUEST_END"]


def trace_settings(module: Any, client: Any, model: str | None = None) -> dict[str, Any]:
    """The settings as tritonclient.http returns them, from either protocol's client."""
    if module is grpcclient:
        doc = client.get_trace_settings(model_name=model, as_json=True)["settings"]
        return {k: v.get("value", []) if k == "trace_level" else (v.get("value") or [""])[0] for k, v in doc.items()}
    return client.get_trace_settings(model_name=model)


def trace_files(trace_file: Path) -> set[Path]:
    """The files written with a log frequency (``<file>.<n>``)."""
    return set(trace_file.parent.glob(trace_file.name + ".*"))


def traces_by_id(paths: set[Path]) -> dict[int, list[dict[str, Any]]]:
    """The entries of the trace files, by trace id."""
    by_id: dict[int, list[dict[str, Any]]] = {}
    for path in paths:
        for entry in json.loads(path.read_text()):
            by_id.setdefault(entry["id"], []).append(entry)
    return by_id
