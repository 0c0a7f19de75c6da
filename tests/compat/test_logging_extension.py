"""Triton's logging extension through unmodified tritonclient, over HTTP and gRPC: the settings
as Triton reports them, partial updates, Triton's errors, and new settings reaching a model
replica (``py_log_probe`` answers whether its model logger would write a verbose and an INFO
line)."""

from __future__ import annotations

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


def _probe(module: Any, client: Any) -> tuple[int, int]:
    inp = module.InferInput("IN", [1], "INT32")
    inp.set_data_from_numpy(np.zeros(1, np.int32))
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
