"""Triton's logging extension: the server's log settings, changed over HTTP (``/v2/logging``) and
gRPC (``LogSettings``) with Triton's checks, and applied in every replica's process.

The settings govern rayinfer's own log lines and the models' (``pb_utils.Logger``): INFO lines
pass while ``log_info`` is on, WARNING lines with ``log_warning``, ERROR lines with
``log_error``, and DEBUG (verbose) lines with ``log_verbose_level`` 1 or more. In a replica
(:func:`write_lines_here`) and in the CLI those lines are written in Triton's format, which
``log_format`` picks: ``default`` (``I1124 23:26:02.123456 1234 model.py:42] text``, UTC) or
``ISO8601`` (``2026-11-24T23:26:02Z I 1234 model.py:42] text``). Ray's and Serve's own lines
keep Ray's settings and format. The log file cannot be changed over the network, as in Triton.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

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


class TritonFormatter(logging.Formatter):
    """Triton's log line: level letter (E, W, I; verbose lines are I), UTC time, process id,
    file and line of the call, then the message (and a traceback's lines after it)."""

    def __init__(self, log_format: str = "default") -> None:
        super().__init__()
        self.log_format = log_format

    def format(self, record: logging.LogRecord) -> str:
        letter = "E" if record.levelno >= logging.ERROR else "W" if record.levelno >= logging.WARNING else "I"
        when = time.gmtime(record.created)
        where = f"{record.process} {record.filename}:{record.lineno}]"
        if self.log_format == "ISO8601":
            head = f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', when)} {letter} {where}"
        else:
            micros = int((record.created % 1) * 1e6)
            head = f"{letter}{time.strftime('%m%d %H:%M:%S', when)}.{micros:06d} {where}"
        text = f"{head} {record.getMessage()}"
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        return f"{text}\n{record.exc_text}" if record.exc_text else text


_FORMATTER = TritonFormatter()
# This process's handlers writing the governed loggers' lines (:func:`write_lines_here`), and the
# log file (its path and stream) once the settings name one.
_HANDLERS: list[logging.StreamHandler] = []
_file: tuple[str, TextIO] | None = None


def write_lines_here(stream: TextIO | None = None) -> None:
    """Write the governed loggers' lines in Triton's format, not through the root logger's
    handlers: to ``stream``, by default the process's own stderr (a Ray worker's log file, which
    Ray streams to the driver: ``rayinfer serve`` prints them), or to the settings' log file.
    Once per process (a replica's); :func:`apply` then follows the settings."""
    for root in GOVERNED:
        log = logging.getLogger(root)
        if not any(h in _HANDLERS for h in log.handlers):
            handler = logging.StreamHandler(_file[1] if _file else stream or sys.__stderr__)
            handler.setFormatter(_FORMATTER)
            _HANDLERS.append(handler)
            log.addHandler(handler)
        log.propagate = False


def cli_handler(settings: dict[str, Any]) -> logging.Handler:
    """The CLI's own handler (for the root logger): Triton's format, to stderr or the log file
    (opened here: OSError when it cannot be)."""
    apply(settings)
    handler = logging.StreamHandler(_file[1] if _file else sys.stderr)
    handler.setFormatter(_FORMATTER)
    return handler


def apply(settings: dict[str, Any]) -> None:
    """Make this process's governed loggers follow ``settings``."""
    global _file
    _FILTER.settings = dict(settings)
    _FORMATTER.log_format = settings.get("log_format", "default")
    path = settings.get("log_file") or ""
    if path and _file is None:  # --log-file: set at start, never changed (Triton's rule)
        # Appended to by every process of the node that logs; a line is one write.
        _file = (path, open(path, "a", buffering=1, encoding="utf-8"))  # noqa: SIM115 - the process's life
        for handler in _HANDLERS:
            handler.setStream(_file[1])
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
