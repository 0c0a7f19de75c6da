"""Size limits on what a client may send, checked while reading (before a body is buffered).

- HTTP bodies: tritonserver's ``--http-max-input-size`` (64 MiB by default), after
  decompression too. The front refuses a ``Content-Length`` over it before reading the body; the
  replica listener and the ``/v2`` application count bodies sent in chunks as they arrive.
- gRPC messages: tritonserver's gRPC server takes messages up to ``INT32_MAX`` bytes and has no
  flag for it; gRPC's own message and status (RESOURCE_EXHAUSTED) answer a larger one.
- HTTP request heads: at most 16 KB (request line and headers) and 100 headers, whoever reads
  them (the front's door, HAProxy, a replica's listener on a client's connection); past either
  the client gets a 400 with a JSON error and the connection is closed.
- Requests in flight: ``--max-inflight-requests`` (rayinfer's; Triton has no server-wide limit)
  caps the calls the front relays to model replicas at once, over both protocols together; one
  more is answered at once with 503 / UNAVAILABLE instead of queueing without bound.
"""

from __future__ import annotations

import json

from rayinfer.protocol.errors import InvalidArgError

DEFAULT_HTTP_MAX_INPUT_SIZE = 1 << 26
GRPC_MAX_MESSAGE_SIZE = 2**31 - 1
_INCREASE = "Use --http-max-input-size to increase the limit."
DEFAULT_MAX_INFLIGHT_REQUESTS = 1024
MAX_REQUEST_HEAD_BYTES = 16384
MAX_REQUEST_HEADERS = 100
HEAD_TOO_LARGE = f"request headers too large (over {MAX_REQUEST_HEAD_BYTES} bytes)"
TOO_MANY_HEADERS = f"too many request headers (over {MAX_REQUEST_HEADERS})"


class BodyTooLarge(InvalidArgError):
    """An HTTP request body (or its decompressed form) over ``--http-max-input-size``."""


class MessageTooLarge(InvalidArgError):
    """A gRPC message over the server's maximum; answered with gRPC's own status for it."""

    grpc_status = "RESOURCE_EXHAUSTED"


def body_too_large(limit: int, size: int | None = None, what: str = "Request body") -> BodyTooLarge:
    """Triton's rejection of a body over the limit; ``size`` when it is known (a Content-Length)."""
    of = f" of {size} bytes" if size is not None else ""
    return BodyTooLarge(f"{what} size{of} exceeds the maximum allowed value of {limit} bytes. {_INCREASE}")


def body_limit_message(limit: int) -> str:
    """The front's message for a ``Content-Length`` over the limit (the size is filled in there)."""
    return f"exceeds the maximum allowed value of {limit} bytes. {_INCREASE}"


def message_too_large(size: int, limit: int = GRPC_MAX_MESSAGE_SIZE) -> MessageTooLarge:
    """gRPC's own rejection of a message over the server's maximum receive size."""
    return MessageTooLarge(f"Received message larger than max ({size} vs. {limit})")


def inflight_limit_message(limit: int) -> str:
    """The front's answer (503 / UNAVAILABLE) to a call over ``--max-inflight-requests``."""
    return (f"Server is busy: {limit} inference requests are in flight, the limit set by "
            f"--max-inflight-requests. Retry later.")


def malformed_head_message(reason: str) -> str:
    """The error of a request head refused before it is read whole (``reason``: why)."""
    return f"malformed HTTP request: {reason}"


def bad_head_answer(reason: str) -> bytes:
    """The whole HTTP answer to a request head refused for ``reason``; the connection closes after it."""
    body = json.dumps({"error": malformed_head_message(reason)}, separators=(",", ":")).encode()
    return (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%b" % (len(body), body))
