"""Per-request settings for the HTTP servers Ray Serve runs inside model replicas.

Ray Serve wraps every replica's HTTP server in middlewares named by
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``; rayinfer names :func:`http_middlewares`, which
adds one that marks v2 requests the way Triton treats them:

- ``x-request-disconnect-disabled: ?1``: Triton finishes an inference whose client has gone away.
  Without the mark Serve watches every request for a disconnect with a task of its own and
  waits on both (docs/dev/benchmark-log.md has what that costs per request).
- ``x-request-id``: when the client sent none, a cheap process-unique id instead of Serve's
  random UUID.

Requests outside ``/v2`` (other Serve applications on a shared cluster) pass untouched.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from starlette.middleware import Middleware

from rayinfer.deployments.asgi import Receive, Scope, Send, header

_DISCONNECT_DISABLED = (b"x-request-disconnect-disabled", b"?1")
_REQUEST_ID = b"x-request-id"


class TritonRequestMarks:
    """ASGI middleware adding the marks above to requests under ``/v2``."""

    def __init__(self, app: Any) -> None:
        self._app = app
        self._prefix = f"{os.getpid():x}-{os.urandom(4).hex()}-"
        self._ids = itertools.count()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v2"):
            extra = [_DISCONNECT_DISABLED]
            if header(scope, _REQUEST_ID) is None:
                extra.append((_REQUEST_ID, f"{self._prefix}{next(self._ids)}".encode()))
            scope["headers"] = [*scope["headers"], *extra]
        await self._app(scope, receive, send)


def http_middlewares() -> list[Middleware]:
    """The middlewares Ray Serve applies around each replica's HTTP server."""
    return [Middleware(TritonRequestMarks)]
