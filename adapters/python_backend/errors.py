"""Errors of Triton's Python backend API: ``TritonError`` (carried by a response) and
``TritonModelException`` (raised)."""

from __future__ import annotations

from rayinfer.protocol.errors import Code


class TritonError:
    """An error carried by a response: a message and one of Triton's codes."""

    UNKNOWN = 0
    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_ARG = 3
    UNAVAILABLE = 4
    UNSUPPORTED = 5
    ALREADY_EXISTS = 6
    CANCELLED = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        self._message = str(message)
        self._code = int(code)

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, {self._code})"


class TritonModelException(Exception):
    """Raised by pb_utils calls that fail (and by models for their own errors)."""

    def message(self) -> str:
        return str(self)


# The server's error codes as Triton's TritonError codes, and back.
TRITON_CODES = {
    Code.UNKNOWN: TritonError.UNKNOWN, Code.INTERNAL: TritonError.INTERNAL, Code.NOT_FOUND: TritonError.NOT_FOUND,
    Code.INVALID_ARG: TritonError.INVALID_ARG, Code.UNAVAILABLE: TritonError.UNAVAILABLE,
    Code.UNSUPPORTED: TritonError.UNSUPPORTED, Code.ALREADY_EXISTS: TritonError.ALREADY_EXISTS,
    Code.CANCELLED: TritonError.CANCELLED,
}
SERVING_CODES = {triton: code for code, triton in TRITON_CODES.items()}
