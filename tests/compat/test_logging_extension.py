"""Triton's logging extension through unmodified tritonclient, over HTTP and gRPC: the settings
as Triton reports them, partial updates, Triton's errors, and new settings reaching a model
replica (``py_log_probe`` answers whether its model logger would write a verbose and an INFO
line), and the model's lines reaching ``rayinfer serve``'s output in the format ``log_format``
names."""

from __future__ import annotations

import itertools
import re
from typing import Any

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from waiting import wait_until

DEFAULTS = {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
            "log_verbose_level": 0, "log_format": "default"}


def _settings(module: Any, client: Any) -> dict[str, Any]:
    settings = client.get_log_settings(**({} if module.__name__.endswith("http") else {"as_json": True}))
    if "settings" in settings:  # gRPC's JSON form: {"settings": {key: {"<kind>_param": value}}}
        settings = {k: next(iter(v.values())) for k, v in settings["settings"].items()}
        settings["log_verbose_level"] = int(settings["log_verbose_level"])
    return settings


def _probe(module: Any, client: Any, marker: int = 0) -> tuple[int, int]:
    """Whether the probe's replica would log a verbose and an INFO line; it logs "log probe <marker>"."""
    inp = module.InferInput("IN", [1], "INT32")
    inp.set_data_from_numpy(np.array([marker], np.int32))
    result = client.infer("py_log_probe", [inp])
    return int(result.as_numpy("VERBOSE")[0]), int(result.as_numpy("INFO")[0])


def test_settings_change_and_reach_the_model_replicas(proto: tuple[Any, Any]) -> None:
    module, client = proto
    assert _settings(module, client) == DEFAULTS
    assert _probe(module, client) == (0, 1)
    try:
        client.update_log_settings({"log_verbose_level": 1, "log_info": False})
        assert _settings(module, client) == {**DEFAULTS, "log_verbose_level": 1, "log_info": False}
        wait_until(lambda: _probe(module, client) == (1, 0), "the model replica to take the new settings",
                   timeout_s=30, interval_s=0.2)
    finally:
        client.update_log_settings({"log_verbose_level": 0, "log_info": True})
    assert _settings(module, client) == DEFAULTS
    wait_until(lambda: _probe(module, client) == (0, 1), "the model replica to take the defaults again",
               timeout_s=30, interval_s=0.2)


def test_wrong_settings_get_tritons_errors(proto: tuple[Any, Any]) -> None:
    module, client = proto
    http = module.__name__.endswith("http")
    with pytest.raises(InferenceServerException) as log_file:
        client.update_log_settings({"log_file": "/tmp/rayinfer.log"})
    assert "log file location can not be updated through network protocol" in str(log_file.value)
    with pytest.raises(InferenceServerException) as log_format:
        client.update_log_settings({"log_format": "json"})
    assert f"invalid argument for {'--' if http else ''}log_format, got: json" in str(log_format.value)
    with pytest.raises(InferenceServerException) as wrong_type:
        # (tritonclient's gRPC client types each value itself: a None is a value of no type)
        client.update_log_settings({"log_info": "yes" if http else None})
    expected = "attempt to access JSON non-boolean as boolean" if http else "expect boolean for 'log_info'"
    assert expected in str(wrong_type.value)
    assert _settings(module, client) == DEFAULTS


def test_server_lists_the_logging_extension(proto: tuple[Any, Any]) -> None:
    module, client = proto
    metadata = client.get_server_metadata()
    extensions = metadata["extensions"] if isinstance(metadata, dict) else list(metadata.extensions)
    assert "logging" in extensions


# Triton's two formats of a model's INFO line (pb_utils.Logger.log_info in the probe's model.py),
# as `rayinfer serve` prints it (after Ray's "(ServeReplica:... pid=N)" prefix and its colour codes).
LINE_FORMATS = {
    "default": r"(?:^|\s)I\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ model\.py:\d+\] log probe (\d+)$",
    "ISO8601": r"(?:^|\s)\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ I \d+ model\.py:\d+\] log probe (\d+)$",
}
_MARKERS = itertools.count(1000)


def _logged(server: dict[str, Any], log_format: str) -> set[int]:
    """The markers of the probe's lines in the server's output written in ``log_format``."""
    text = server["log"].read_text(errors="replace")
    return {int(m[1]) for m in re.finditer(LINE_FORMATS[log_format], text, re.MULTILINE)}


def test_model_lines_are_written_in_the_format_log_format_names(proto: tuple[Any, Any],
                                                                  server: dict[str, Any]) -> None:
    """A model's log line reaches the server's output (Ray streams the replica's stderr to
    ``rayinfer serve``) in Triton's default format; after ``log_format: ISO8601`` the replica's
    next lines are written in ISO 8601."""
    module, client = proto
    sent: dict[str, list[int]] = {"default": [], "ISO8601": []}

    def probe_and_find(log_format: str) -> bool:
        marker = next(_MARKERS)
        sent[log_format].append(marker)
        _probe(module, client, marker)
        return bool(_logged(server, log_format) & set(sent[log_format]))

    wait_until(lambda: probe_and_find("default"), "a default-format line of the model", timeout_s=30, interval_s=0.5)
    try:
        client.update_log_settings({"log_format": "ISO8601"})
        wait_until(lambda: probe_and_find("ISO8601"), "an ISO 8601 line of the model", timeout_s=30, interval_s=0.5)
    finally:
        client.update_log_settings({"log_format": "default"})
    # No line of this test's was written in both formats (other tests' probes log marker 0).
    assert not _logged(server, "default") & _logged(server, "ISO8601") & {*sent["default"], *sent["ISO8601"]}
