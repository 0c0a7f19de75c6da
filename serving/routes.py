"""The one parser of v2 model routes, and the one list of request headers the core reads.

Every entry point (Serve's ingress in the model and ``/v2`` replicas, the replica listener)
parses ``/v2/models/<model>[/versions/<version>][/<action>]`` here; the front's HAProxy config
matches the same shape for inference requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

from rayinfer.protocol import http_codec
from rayinfer.protocol.listener_client import STREAM_HEADER, TRACE_PARENT_HEADER
from rayinfer.serving.sequence_routing import FORWARDED_HEADER

MODELS_PREFIX = "/v2/models/"
# The front puts this before the path of a model GET it has no replica for, which sends it to
# the ``/v2`` application (Serve would send it to the model's application while that exists).
UNROUTED_PREFIX = "/v2/unrouted"
# Actions under a model route ("" is the model's metadata).
MODEL_ACTIONS = frozenset({"", "ready", "config", "stats", "infer", "generate", "generate_stream"})
# The actions a POST asks for: an inference (the generate extension's two among them).
POST_ACTIONS = frozenset({"infer", "generate", "generate_stream"})

HEADER_LENGTH = http_codec.HEADER_LENGTH.encode()
# Request headers an infer request's answer depends on; every other header is dropped on entry.
REQUEST_HEADERS = frozenset({b"content-encoding", b"accept-encoding", HEADER_LENGTH, FORWARDED_HEADER,
                             STREAM_HEADER, TRACE_PARENT_HEADER})


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """A request addressed to one model: ``version`` "" is the default version, ``action`` ""
    the model's metadata."""

    model: str
    version: str = ""
    action: str = ""


def parse_model_route(path: str, encoded: bool = False) -> ModelRoute | None:
    """The model route of ``path``, or None when ``path`` is not ``/v2/models/<model>...``
    (``/v2/models/stats``, every model's statistics, is not a model route). ``encoded``: the
    path is as sent (a request line), not already decoded (an ASGI scope's path): the model
    name is %-decoded."""
    if not path.startswith(MODELS_PREFIX):
        return None
    parts = path[len(MODELS_PREFIX):].rstrip("/").split("/")
    model, rest = unquote(parts[0]) if encoded else parts[0], parts[1:]
    if not model or (model == "stats" and not rest):
        return None
    version = ""
    if rest and rest[0] == "versions":
        if len(rest) < 2 or not rest[1]:
            return None
        version, rest = rest[1], rest[2:]
    if len(rest) > 1 or (rest and rest[0] not in MODEL_ACTIONS):
        return None
    return ModelRoute(model, version, rest[0] if rest else "")


def front_routed(method: str, path: str) -> ModelRoute | None:
    """The model route of a request (``path`` as sent) that the front sends to one of the model's
    replicas: ``POST .../infer`` (or ``generate``, ``generate_stream``), or a ``GET`` of its
    metadata, readiness, config or statistics."""
    if method not in ("GET", "POST"):
        return None
    route = parse_model_route(path, encoded=True)
    if route is None or (method == "POST") != (route.action in POST_ACTIONS):
        return None
    return route


def keep_request_headers(headers: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """The headers of :data:`REQUEST_HEADERS` among ASGI-style (lower-case name, value) pairs."""
    return {name: value for name, value in headers if name in REQUEST_HEADERS}
