"""What ``rayinfer serve`` learned at start, kept for a ``/v2`` replica that Serve starts again:
the models it loaded at start are all deployed or failed, and why each failed one failed.

Kept in Ray's key-value store (the GCS) under the server's id, with the launch it belongs to: a
``/v2`` replica started again by the same launch reads it (it has no startup model to wait for,
and the failed ones stay failed); a replica of another launch, or of a Serve config (which has no
launch), ignores it. The next launch of the same server id replaces it.
"""

from __future__ import annotations

import json
import logging

from rayinfer.deployments.serve_internals import kv_get, kv_put

logger = logging.getLogger(__name__)

_KV_NAMESPACE = "rayinfer"


def _key(server_id: str) -> bytes:
    return f"startup/{server_id}".encode()


def save_startup_ended(server_id: str, launch: str, load_errors: dict[str, str]) -> None:
    """Record that ``launch``'s start ended, with the models that failed to load (blocking: a
    GCS round trip)."""
    kv_put(_key(server_id), json.dumps({"launch": launch, "load_errors": load_errors}).encode(), _KV_NAMESPACE)


def saved_load_errors(server_id: str, launch: str) -> dict[str, str] | None:
    """The start-up load errors ``launch`` recorded once its start ended; None before that (or
    when what is kept cannot be read)."""
    raw = kv_get(_key(server_id), _KV_NAMESPACE)
    if not raw:
        return None
    try:
        record = json.loads(raw)
        if record.get("launch") != launch:
            return None
        return {str(model): str(reason) for model, reason in dict(record.get("load_errors") or {}).items()}
    except (ValueError, AttributeError, TypeError):
        logger.error("the server's start-up record in Ray's key-value store cannot be read; ignored")
        return None
