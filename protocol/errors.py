"""One family of serving errors, each carrying a Triton status code.

HTTP and gRPC status codes are derived from the Triton code in one place
(:func:`http_status`, :func:`grpc_status_name`), so the two front-ends never disagree.
"""

from __future__ import annotations

import enum


class Code(str, enum.Enum):
    """Triton's error codes (TRITONSERVER_Error_Code)."""

    INVALID_ARG = "INVALID_ARG"
    NOT_FOUND = "NOT_FOUND"
    UNAVAILABLE = "UNAVAILABLE"
    UNSUPPORTED = "UNSUPPORTED"
    INTERNAL = "INTERNAL"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    CANCELLED = "CANCELLED"
    UNKNOWN = "UNKNOWN"


_HTTP_STATUS = {
    Code.INVALID_ARG: 400,
    Code.NOT_FOUND: 404,
    Code.UNAVAILABLE: 503,
    Code.UNSUPPORTED: 501,
    Code.INTERNAL: 500,
    Code.ALREADY_EXISTS: 400,
    Code.CANCELLED: 400,
    Code.UNKNOWN: 400,
}

_GRPC_STATUS = {
    Code.INVALID_ARG: "INVALID_ARGUMENT",
    Code.NOT_FOUND: "NOT_FOUND",
    Code.UNAVAILABLE: "UNAVAILABLE",
    Code.UNSUPPORTED: "UNIMPLEMENTED",
    Code.INTERNAL: "INTERNAL",
    Code.ALREADY_EXISTS: "ALREADY_EXISTS",
    Code.CANCELLED: "CANCELLED",
    Code.UNKNOWN: "UNKNOWN",
}


class ServingError(Exception):
    """An error reported to the client with a Triton code and a message.

    Every subclass passes all of its constructor arguments to ``super().__init__`` so that
    instances survive pickling across Ray process boundaries.
    """

    code: Code = Code.INTERNAL

    def __init__(self, message: str, code: Code | None = None):
        # ``args`` must be exactly what this class's constructor took: unpickling calls
        # ``type(self)(*args)``, and subclasses take only ``message``.
        if code is None:
            super().__init__(message)
        else:
            super().__init__(message, code)
        self.message = message
        if code is not None:
            self.code = Code(code)

    def __str__(self) -> str:
        return self.message


class InvalidArgError(ServingError):
    """The request is malformed or does not match the model (HTTP 400)."""

    code = Code.INVALID_ARG

    def __init__(self, message: str):
        super().__init__(message)


class InvalidParamError(InvalidArgError):
    """A request member that is malformed; ``param`` names it (an OpenAI error's ``param``)."""

    def __init__(self, message: str, param: str = ""):
        super().__init__(message)
        self.args = (message, param)  # what unpickling passes to the constructor
        self.param = param


class NotFoundError(ServingError):
    """The model, version or resource does not exist (HTTP 404)."""

    code = Code.NOT_FOUND

    def __init__(self, message: str):
        super().__init__(message)


class UnavailableError(ServingError):
    """The model exists but cannot serve now (HTTP 503)."""

    code = Code.UNAVAILABLE

    def __init__(self, message: str):
        super().__init__(message)


class UnsupportedError(ServingError):
    """The feature or setting is not supported (HTTP 501)."""

    code = Code.UNSUPPORTED

    def __init__(self, message: str):
        super().__init__(message)


# Triton's answer (INTERNAL) to a gRPC message that does not parse as the RPC's request.
UNPARSABLE_REQUEST = "Unable to parse request"


class InternalError(ServingError):
    """The server failed while handling a valid request (HTTP 500)."""

    code = Code.INTERNAL

    def __init__(self, message: str):
        super().__init__(message)


class ModelConfigError(ServingError):
    """A model's configuration is invalid; the message names the file and the reason."""

    code = Code.INVALID_ARG

    def __init__(self, message: str):
        super().__init__(message)


def http_status(code: Code) -> int:
    """HTTP status for a Triton code."""
    return _HTTP_STATUS[Code(code)]


def grpc_status_name(code: Code) -> str:
    """Name of the ``grpc.StatusCode`` member for a Triton code."""
    return _GRPC_STATUS[Code(code)]


def as_serving_error(exc: BaseException) -> ServingError:
    """Turn any exception into a :class:`ServingError`, unwrapping Ray's task-error wrappers."""
    seen = 0
    while not isinstance(exc, ServingError) and seen < 8:
        cause = getattr(exc, "cause", None) or exc.__cause__
        if cause is None or cause is exc:
            break
        exc = cause
        seen += 1
    if isinstance(exc, ServingError):
        return exc
    return InternalError(f"{type(exc).__name__}: {exc}")
