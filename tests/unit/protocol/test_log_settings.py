"""The logging extension's settings: Triton's checks over HTTP and gRPC, and the switches applied
to this process's loggers."""

from __future__ import annotations

import io
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tritonclient.grpc import service_pb2 as pb

from rayinfer.protocol import log_settings
from rayinfer.protocol.errors import Code, ServingError


@pytest.fixture
def restored() -> Iterator[None]:
    yield
    log_settings.apply(log_settings.default_settings())


def test_http_updates_keep_what_they_do_not_name() -> None:
    current = log_settings.default_settings()
    updated = log_settings.update_from_http(current, {"log_info": False, "log_verbose_level": 2, "other": 1,
                                                      "log_error": None})
    assert updated == {**current, "log_info": False, "log_verbose_level": 2}
    assert list(updated) == ["log_file", "log_info", "log_warning", "log_error", "log_verbose_level", "log_format"]


@pytest.mark.parametrize("doc, code, message", [
    ({"log_file": "x.log"}, Code.UNSUPPORTED, "log file location can not be updated through network protocol"),
    ({"log_warning": 1}, Code.INTERNAL, "attempt to access JSON non-boolean as boolean"),
    ({"log_verbose_level": -1}, Code.INTERNAL, "attempt to access JSON non-unsigned-integer as unsigned-integer"),
    ({"log_format": "json"}, Code.INVALID_ARG, "invalid argument for --log_format, got: json"),
])
def test_http_errors_are_tritons(doc: dict, code: Code, message: str) -> None:
    with pytest.raises(ServingError) as info:
        log_settings.update_from_http(log_settings.default_settings(), doc)
    assert (info.value.code, info.value.message) == (code, message)


def test_grpc_needs_each_settings_type() -> None:
    request = pb.LogSettingsRequest()
    request.settings["log_verbose_level"].uint32_param = 1
    request.settings["log_format"].string_param = "ISO8601"
    updated = log_settings.update_from_grpc(log_settings.default_settings(), request.settings)
    assert (updated["log_verbose_level"], updated["log_format"]) == (1, "ISO8601")
    request.settings["log_info"].string_param = "no"
    with pytest.raises(ServingError, match="expect boolean for 'log_info'"):
        log_settings.update_from_grpc(log_settings.default_settings(), request.settings)


def test_switches_pass_or_drop_each_level(restored: None) -> None:
    logger = logging.getLogger("rayinfer.some.module")

    def passes(level: int) -> bool:
        return logger.isEnabledFor(level) and bool(logger.filter(logging.LogRecord(logger.name, level, "", 0, "", None, None)))

    log_settings.apply({**log_settings.default_settings(), "log_warning": False})
    assert [passes(level) for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR)] == \
        [False, True, False, True]
    log_settings.apply({**log_settings.default_settings(), "log_verbose_level": 1, "log_error": False})
    assert [passes(level) for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR)] == \
        [True, True, True, False]


@pytest.fixture
def own_lines() -> Iterator[io.StringIO]:
    """This process's governed loggers writing Triton's lines to a buffer, as in a replica; put
    back as they were afterwards (other tests read them through the root logger)."""
    saved = {root: (logging.getLogger(root).handlers[:], logging.getLogger(root).propagate)
             for root in log_settings.GOVERNED}
    stream = io.StringIO()
    log_settings.write_lines_here(stream)
    yield stream
    log_settings.apply(log_settings.default_settings())
    for root, (handlers, propagate) in saved.items():
        for handler in logging.getLogger(root).handlers[:]:
            if handler not in handlers:
                logging.getLogger(root).removeHandler(handler)
                if handler in log_settings._HANDLERS:
                    log_settings._HANDLERS.remove(handler)
        logging.getLogger(root).propagate = propagate


DEFAULT_LINE = re.compile(r"^([EWI])(\d{4}) (\d\d:\d\d:\d\d\.\d{6}) (\d+) ([\w.]+):(\d+)\] (.*)$")
ISO_LINE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ) ([EWI]) (\d+) ([\w.]+):(\d+)\] (.*)$")


def test_lines_take_tritons_format_and_follow_log_format(own_lines: io.StringIO) -> None:
    logger = logging.getLogger("rayinfer.some.module")
    log_settings.apply({**log_settings.default_settings(), "log_verbose_level": 1})
    logger.info("first %d", 1)
    logger.debug("verbose")
    logger.warning("careful")
    log_settings.apply({**log_settings.default_settings(), "log_format": "ISO8601"})
    logger.error("broken")
    lines = own_lines.getvalue().splitlines()
    parsed = [DEFAULT_LINE.match(line) for line in lines[:3]]
    assert all(parsed), lines
    assert [(m[1], m[7]) for m in parsed if m] == [("I", "first 1"), ("I", "verbose"), ("W", "careful")]
    assert {m[4] for m in parsed if m} == {str(os.getpid())}
    assert {m[5] for m in parsed if m} == {"test_log_settings.py"}
    assert parsed[0] and parsed[0][2] == time.strftime("%m%d", time.gmtime())
    iso = ISO_LINE.match(lines[3])
    assert iso and (iso[2], iso[4], iso[6]) == ("E", "test_log_settings.py", "broken"), lines[3]
    assert len(lines) == 4


def test_a_model_logger_line_names_the_models_file(own_lines: io.StringIO) -> None:
    from rayinfer.adapters.python_backend import triton_python_backend_utils as pb_utils

    pb_utils.Logger.log_warn("from the model")
    pb_utils.Logger.log("at a level", pb_utils.Logger.LogLevel.ERROR)
    lines = own_lines.getvalue().splitlines()
    assert [(m[1], m[5], m[7]) for m in map(DEFAULT_LINE.match, lines) if m] == [
        ("W", "test_log_settings.py", "from the model"), ("E", "test_log_settings.py", "at a level")]


def test_a_traceback_follows_its_line(own_lines: io.StringIO) -> None:
    try:
        raise ValueError("bad value")
    except ValueError:
        logging.getLogger("rayinfer.x").exception("it failed")
    first, *rest = own_lines.getvalue().splitlines()
    assert DEFAULT_LINE.match(first) and first.endswith("] it failed")
    assert rest[0] == "Traceback (most recent call last):" and rest[-1] == "ValueError: bad value"


def test_the_log_file_takes_the_lines(own_lines: io.StringIO, tmp_path: Path) -> None:
    path = tmp_path / "server.log"
    try:
        log_settings.apply({**log_settings.default_settings(), "log_file": str(path)})
        logging.getLogger("rayinfer.y").info("to the file")
    finally:
        assert log_settings._file is not None
        for handler in log_settings._HANDLERS:
            handler.setStream(own_lines)
        log_settings._file[1].close()
        log_settings._file = None
    assert own_lines.getvalue() == ""
    line = path.read_text().splitlines()
    assert len(line) == 1 and line[0].endswith("] to the file")
