"""Size limits on what a client may send, checked while reading (before a body is buffered).

- HTTP bodies: tritonserver's ``--http-max-input-size`` (64 MiB by default), after
  decompression too. The front refuses a ``Content-Length`` over it before reading the body; the
  replica listener and the ``/v2`` application count bodies sent in chunks as they arrive.
- gRPC messages: tritonserver's gRPC server takes messages up to ``INT32_MAX`` bytes and has no
  flag for it; gRPC's own message and status (RESOURCE_EXHAUSTED) answer a larger one.
- HTTP request heads: at most 16 KB (request line and headers) and 100 headers, whoever reads
  them (the front's acceptor, HAProxy, a replica's listener on a client's connection); past either
  the client gets a 400 with a JSON error and the connection is closed.
- Requests in flight: ``--max-inflight-requests`` (rayinfer's; Triton has no server-wide limit)
  caps the calls the front relays to model replicas at once, over both protocols together; one
  more is answered at once with 503 / UNAVAILABLE instead of queueing without bound.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from rayinfer.protocol.errors import InternalError, InvalidArgError, UnavailableError

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


def body_too_large(limit: int, size: int | None = None, what: str = "Request JSON") -> BodyTooLarge:
    """Triton's rejection of a body over the limit; ``size`` when it is known (a Content-Length)."""
    of = f" of {size} bytes" if size is not None else ""
    return BodyTooLarge(f"{what} size{of} exceeds the maximum allowed value of {limit} bytes. {_INCREASE}")


class ModelLoadTooLarge(InternalError):
    """A model load request's body over ``--http-max-input-size``: as Triton's current release
    answers it, an internal error (500) whose message speaks of the input size."""


def load_too_large(limit: int, size: int | None = None) -> ModelLoadTooLarge:
    """Triton's rejection of a load request (its files inline, base64) over the limit."""
    of = f" of {size} bytes" if size is not None else ""
    return ModelLoadTooLarge(f"Load request JSON size{of} {load_limit_message(limit)}")


def load_limit_message(limit: int) -> str:
    """The rest of :func:`load_too_large`'s message (the front fills the size in before it)."""
    return f"exceeds the maximum allowed input size. The limit is {limit} bytes. {_INCREASE}"


def body_limit_message(limit: int) -> str:
    """The front's message for a ``Content-Length`` over the limit (the size is filled in there)."""
    return f"exceeds the maximum allowed value of {limit} bytes. {_INCREASE}"


def message_too_large(size: int, limit: int = GRPC_MAX_MESSAGE_SIZE) -> MessageTooLarge:
    """gRPC's own rejection of a message over the server's maximum receive size."""
    return MessageTooLarge(f"Received message larger than max ({size} vs. {limit})")


class StreamIdle(UnavailableError):
    """A gRPC stream with no request nor response for ``--stream-idle-timeout``."""

    grpc_status = "DEADLINE_EXCEEDED"


def stream_idle(timeout_s: float) -> StreamIdle:
    return StreamIdle(f"the stream had no request nor response for {timeout_s:g} s, the limit set by "
                      f"--stream-idle-timeout")


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


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client connection to a model replica's listener may hold or take, with the
    flag that sets each (HAProxy's and nginx's names where they have one). A connection that
    passes one is closed (HTTP/2: ``GOAWAY`` with the RFC 9113 error); nothing else notices."""

    # HTTP/1.1 and HTTP/2
    request_head_timeout_s: float = 30.0  # --http-request-timeout: a request head's bytes, from its first
    keepalive_timeout_s: float = 60.0  # --http-keepalive-timeout: idle between two requests (HTTP/2: no call open)
    send_timeout_s: float = 60.0  # --client-send-timeout: an answer not taken by the client for this long
    connection_buffer_bytes: int = 1 << 22  # --connection-buffer-bytes: answers a client has not read yet
    # HTTP/1.1
    max_pipelined_requests: int = 16  # --http-max-pipelined-requests: read ahead of the answers, then pause
    # HTTP/2 (RFC 9113)
    max_concurrent_streams: int = 100  # --grpc-max-concurrent-streams: advertised; one more is REFUSED_STREAM
    max_header_list_bytes: int = MAX_REQUEST_HEAD_BYTES  # --grpc-max-header-list-size: a header block, CONTINUATIONs with it
    max_reset_streams: int = 200  # --grpc-max-reset-streams: streams a client may reset in 10 s
    max_control_frames: int = 1000  # --grpc-max-control-frames: PING, SETTINGS, empty frames in 10 s
    stream_window_bytes: int = 1 << 20  # --grpc-stream-window: what a call may send before it is read
    connection_window_bytes: int = 1 << 26  # --grpc-connection-window: held by a connection's calls, then only its oldest gets more
    replica_buffer_bytes: int = 1 << 28  # --grpc-replica-buffer: held by all of a replica's calls, the same way
    max_message_bytes: int = 1 << 26  # --grpc-max-message-size: one gRPC message (unary or stream), after decompression too
    stream_idle_timeout_s: float = 300.0  # --stream-idle-timeout: a stream with no request in progress and no client byte
    max_queued_responses: int = 64  # --max-queued-responses: a stream's responses made and not yet sent; then its sender waits
    # A replica
    max_connections: int = 1024  # --replica-max-connections: clients' and the front's connections one replica holds
    # The front
    front_max_connections: int = 4096  # --front-max-connections: HAProxy's maxconn; the acceptor's connections waiting

    @classmethod
    def from_values(cls, values: dict[str, float] | None) -> ConnectionLimits:
        """The limits the server's flags set (``values``: the fields' values; the rest default)."""
        if not values:
            return DEFAULT_CONNECTION_LIMITS
        return cls(**{name: type(getattr(DEFAULT_CONNECTION_LIMITS, name))(value)
                      for name, value in values.items() if hasattr(DEFAULT_CONNECTION_LIMITS, name)})


DEFAULT_CONNECTION_LIMITS = ConnectionLimits()


def request_timeout_message(timeout_s: float) -> str:
    """The error of a request head not received whole within ``--http-request-timeout``."""
    return (f"request timeout: the request head was not received within {timeout_s:g} s, "
            f"the limit set by --http-request-timeout")


def request_timeout_answer(timeout_s: float) -> bytes:
    """The whole HTTP answer (408) to a request head not received within ``timeout_s``; the
    connection closes after it."""
    body = json.dumps({"error": request_timeout_message(timeout_s)}, separators=(",", ":")).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%b" % (len(body), body))

