"""The logging extension's settings: Triton's checks over HTTP and gRPC, and the switches applied
to this process's loggers."""

from __future__ import annotations

import logging
from collections.abc import Iterator

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
