"""Triton's logging extension: the server's log settings, changed over HTTP (``/v2/logging``) and
gRPC (``LogSettings``) with Triton's checks, and applied in every replica's process.

The settings govern rayinfer's own log lines and the models' (``pb_utils.Logger``): INFO lines
pass while ``log_info`` is on, WARNING lines with ``log_warning``, ERROR lines with
``log_error``, and DEBUG (verbose) lines with ``log_verbose_level`` 1 or more. Ray's and Serve's
own lines keep Ray's settings. ``log_format`` is kept and reported (``default`` or ``ISO8601``);
the replicas' lines keep Ray's format. The log file cannot be changed over the network, as in
Triton.
"""

from __future__ import annotations

import logging
from typing import Any

from rayinfer.protocol.errors import Code, InvalidArgError, ServingError, UnsupportedError

FORMATS = ("default", "ISO8601")
# The loggers the settings govern (with every logger under them).
GOVERNED = ("rayinfer", "triton_python_backend_utils")
_FILE_MESSAGE = "log file location can not be updated through network protocol"
_BOOLEANS = ("log_info", "log_warning", "log_error")


def default_settings(verbose_level: int = 0) -> dict[str, Any]:
    """Triton's defaults (its response's keys, in its order), with ``--log-verbose``."""
    return {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
            "log_verbose_level": int(verbose_level), "log_format": "default"}


def update_from_http(current: dict[str, Any], doc: Any) -> dict[str, Any]:
    """``current`` with a POST body's settings (unknown keys and nulls are ignored, as in
    Triton); Triton's messages for wrong types."""
    updated = dict(current)
    if not isinstance(doc, dict):
        return updated
    if doc.get("log_file") is not None:
        raise UnsupportedError(_FILE_MESSAGE)
    for key in _BOOLEANS:
        if doc.get(key) is not None:
            if not isinstance(doc[key], bool):
                raise ServingError("attempt to access JSON non-boolean as boolean", Code.INTERNAL)
            updated[key] = doc[key]
    level = doc.get("log_verbose_level")
    if level is not None:
        if not isinstance(level, int) or isinstance(level, bool) or level < 0:
            raise ServingError("attempt to access JSON non-unsigned-integer as unsigned-integer", Code.INTERNAL)
        updated["log_verbose_level"] = level
    log_format = doc.get("log_format")
    if log_format is not None:
        if not isinstance(log_format, str):
            raise ServingError("attempt to access JSON non-string as string", Code.INTERNAL)
        if log_format not in FORMATS:
            raise InvalidArgError(f"invalid argument for --log_format, got: {log_format}")
        updated["log_format"] = log_format
    return updated


def update_from_grpc(current: dict[str, Any], settings: Any) -> dict[str, Any]:
    """``current`` with a ``LogSettingsRequest``'s settings map (Triton's messages)."""
    updated = dict(current)
    if "log_file" in settings:
        raise UnsupportedError(_FILE_MESSAGE)
    for key in _BOOLEANS:
        if key in settings:
            if settings[key].WhichOneof("parameter_choice") != "bool_param":
                raise InvalidArgError(f"expect boolean for '{key}'")
            updated[key] = settings[key].bool_param
    if "log_verbose_level" in settings:
        if settings["log_verbose_level"].WhichOneof("parameter_choice") != "uint32_param":
            raise InvalidArgError("expect int32 for 'log_verbose_level'")
        updated["log_verbose_level"] = settings["log_verbose_level"].uint32_param
    if "log_format" in settings:
        if settings["log_format"].WhichOneof("parameter_choice") != "string_param":
            raise InvalidArgError("expect string for 'log_format'")
        value = settings["log_format"].string_param
        if value not in FORMATS:
            raise InvalidArgError(f"invalid argument for log_format, got: {value}")
        updated["log_format"] = value
    return updated


class _SwitchFilter(logging.Filter):
    """Lets a line through when its level's switch is on."""

    def __init__(self) -> None:
        super().__init__()
        self.settings = default_settings()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return bool(self.settings["log_error"])
        if record.levelno >= logging.WARNING:
            return bool(self.settings["log_warning"])
        if record.levelno >= logging.INFO:
            return bool(self.settings["log_info"])
        return self.settings["log_verbose_level"] > 0


_FILTER = _SwitchFilter()


def apply(settings: dict[str, Any]) -> None:
    """Make this process's governed loggers follow ``settings``."""
    _FILTER.settings = dict(settings)
    level = logging.DEBUG if settings["log_verbose_level"] > 0 else logging.INFO
    # A filter only sees the lines logged by its own logger: every existing logger under the
    # governed ones gets it (modules create their loggers when imported).
    names = [name for name in logging.Logger.manager.loggerDict
             if any(name == root or name.startswith(root + ".") for root in GOVERNED)]
    for name in {*GOVERNED, *names}:
        log = logging.getLogger(name)
        if _FILTER not in log.filters:
            log.addFilter(_FILTER)
    for root in GOVERNED:
        logging.getLogger(root).setLevel(level)
