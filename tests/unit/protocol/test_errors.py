"""Serving errors: pickling across processes, the code tables, and unwrapping wrapped errors."""

from __future__ import annotations

import pickle

import pytest

from rayinfer.protocol.errors import (
    Code,
    InternalError,
    InvalidArgError,
    InvalidParamError,
    ModelConfigError,
    NotFoundError,
    ServingError,
    UnavailableError,
    UnsupportedError,
    as_serving_error,
    grpc_status_name,
    http_status,
)
from rayinfer.protocol.chat_template import TemplateError
from rayinfer.protocol.limits import BodyTooLarge, MessageTooLarge, ModelLoadTooLarge, StreamIdle

ERRORS = [
    (ServingError("generic failure"), Code.INTERNAL),
    (ServingError("already there", Code.ALREADY_EXISTS), Code.ALREADY_EXISTS),
    (InvalidArgError("bad input 'INPUT0'"), Code.INVALID_ARG),
    (InvalidParamError("'n' must be a positive integer", "n"), Code.INVALID_ARG),
    (NotFoundError("model 'nope' not found"), Code.NOT_FOUND),
    (UnavailableError("model 'simple' is loading"), Code.UNAVAILABLE),
    (UnsupportedError("BF16 is not supported"), Code.UNSUPPORTED),
    (InternalError("boom"), Code.INTERNAL),
    (ModelConfigError("/repo/m/config.pbtxt: broken"), Code.INVALID_ARG),
    (BodyTooLarge("Request body size exceeds the maximum allowed value of 1 bytes."), Code.INVALID_ARG),
    (MessageTooLarge("Received message larger than max (3 vs. 2)"), Code.INVALID_ARG),
    (ModelLoadTooLarge("Load request JSON size exceeds the maximum allowed input size."), Code.INTERNAL),
    (StreamIdle("the stream had no request nor response for 1 s"), Code.UNAVAILABLE),
    (TemplateError("the chat template of model 'tiny_llm' failed: roles must alternate"), Code.INVALID_ARG),
]


@pytest.mark.parametrize("error, code", ERRORS, ids=lambda e: type(e).__name__ if isinstance(e, Exception) else None)
def test_every_error_class_round_trips_through_pickle(error: ServingError, code: Code) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert copy.code == code
    assert copy.message == error.message
    assert str(copy) == error.message
    assert getattr(copy, "param", None) == getattr(error, "param", None)


def test_serving_error_code_given_as_string_is_normalised() -> None:
    error = ServingError("gone", "NOT_FOUND")  # type: ignore[arg-type]  # codes also arrive as text
    assert error.code is Code.NOT_FOUND
    assert pickle.loads(pickle.dumps(error)).code is Code.NOT_FOUND


def test_error_class_codes_are_the_class_default() -> None:
    assert InvalidArgError("x").code is Code.INVALID_ARG
    assert ModelConfigError("x").code is Code.INVALID_ARG
    assert isinstance(ModelConfigError("x"), ServingError)


def test_status_tables_cover_every_code() -> None:
    # The values are not restated here: the codes the server answers with are walked through
    # both front-ends by tests/compat/test_both_protocols.py::test_errors_name_the_problem.
    for code in Code:
        assert isinstance(http_status(code), int)
        assert isinstance(grpc_status_name(code), str)
        assert http_status(code.value) == http_status(code)  # type: ignore[arg-type]  # codes also arrive as text
        assert grpc_status_name(code.value) == grpc_status_name(code)  # type: ignore[arg-type]  # as text too


def test_grpc_names_are_grpc_status_codes() -> None:
    grpc = pytest.importorskip("grpc")
    for code in Code:
        assert hasattr(grpc.StatusCode, grpc_status_name(code))


def test_as_serving_error_returns_serving_errors_unchanged() -> None:
    error = NotFoundError("missing")
    assert as_serving_error(error) is error


def test_as_serving_error_unwraps_cause_chain() -> None:
    inner = UnavailableError("model 'simple' is not ready")
    try:
        try:
            raise inner
        except UnavailableError as exc:
            raise RuntimeError("wrapper") from exc
    except RuntimeError as outer:
        try:
            raise KeyError("outermost") from outer
        except KeyError as top:
            assert as_serving_error(top) is inner


def test_as_serving_error_unwraps_cause_attribute() -> None:
    class TaskError(Exception):  # stands in for Ray's RayTaskError, which has ``.cause``
        def __init__(self, cause: BaseException):
            super().__init__(cause)
            self.cause = cause

    inner = InvalidArgError("input 'INPUT0' is bad")
    assert as_serving_error(TaskError(inner)) is inner


def test_as_serving_error_wraps_unknown_exceptions_as_internal() -> None:
    error = as_serving_error(ValueError("no good"))
    assert isinstance(error, InternalError)
    assert error.code is Code.INTERNAL
    assert error.message == "ValueError: no good"


def test_as_serving_error_wraps_the_innermost_non_serving_cause() -> None:
    try:
        try:
            raise ZeroDivisionError("division by zero")
        except ZeroDivisionError as exc:
            raise RuntimeError("wrapper") from exc
    except RuntimeError as outer:
        error = as_serving_error(outer)
    assert error.code is Code.INTERNAL
    assert "ZeroDivisionError" in error.message


def test_as_serving_error_stops_on_cause_cycles() -> None:
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__cause__, b.__cause__ = b, a
    assert as_serving_error(a).code is Code.INTERNAL


def test_pickle_cases_cover_every_error_class() -> None:
    def all_subclasses(cls: type) -> set[type]:
        return {cls} | {s for sub in cls.__subclasses__() for s in all_subclasses(sub)}

    assert all_subclasses(ServingError) <= {type(error) for error, _ in ERRORS}
