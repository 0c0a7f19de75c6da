"""rayinfer's records in Ray's key-value store (the GCS): what outlives the process that wrote it.

Every record is here, under its own key of one namespace, each written and read by the
functions below (JSON, the front key as text):

| record | key | written by | read by |
|---|---|---|---|
| the front key (:mod:`rayinfer.protocol.front_key`) | ``front-key`` | the first part to ask | model replicas, the ``/v2`` replica's front, each node's front |
| a server's rollouts (:class:`~rayinfer.deployments.rollout_store.Rollout`) | ``rollouts/<server id>`` | the ``/v2`` replica, at each change | a ``/v2`` replica started again |
| the end of a start | ``startup/<server id>`` | the ``/v2`` replica, told by ``rayinfer serve`` | a ``/v2`` replica started again for that launch |
| a pool replica's hosting report | ``pool-report/<replica id>`` | each pool replica, after each change | the deployer, the repository index, the other pool replicas |

Every call blocks for a GCS round trip; Ray must be connected (the rollouts: nothing is read or
written without it, for the ``/v2`` application's tests without a cluster).
"""

from __future__ import annotations

import json
import logging
import zlib
from typing import Any

from rayinfer.deployments.serve_internals import kv_delete, kv_get, kv_keys, kv_put
from rayinfer.protocol.front_key import is_front_key, new_front_key

logger = logging.getLogger(__name__)

NAMESPACE = "rayinfer"
_FRONT_KEY = b"front-key"
_REPORT_PREFIX = "pool-report/"


# ---- the front key ---------------------------------------------------------------------------

def cluster_front_key() -> str:
    """The cluster's front key, made and kept on the first call. Parts asking at once get the
    one that was stored first; a ``/v2`` replica started again gets the same key, so it can take
    the running front over."""
    stored = kv_get(_FRONT_KEY, NAMESPACE)
    if stored is None:
        kv_put(_FRONT_KEY, new_front_key().encode(), NAMESPACE, overwrite=False)
        stored = kv_get(_FRONT_KEY, NAMESPACE)
    key = stored.decode() if stored is not None else ""
    if not is_front_key(key):
        raise RuntimeError("the front key in Ray's key-value store is missing or malformed")
    return key


# ---- a server's rollouts ---------------------------------------------------------------------

def saved_rollouts(server_id: str) -> list[dict[str, Any]]:
    """The server's rollouts as saved (each as ``Rollout.as_dict`` gives it); none without a
    connected Ray, or when what is saved cannot be read."""
    raw = kv_get(_rollouts_key(server_id), NAMESPACE) if _ray_connected() else None
    try:
        return json.loads(raw) if raw else []
    except ValueError:
        logger.error("the saved rollouts cannot be read; starting with none")
        return []


def save_rollouts(server_id: str, rollouts: list[dict[str, Any]]) -> None:
    """Save the server's ``rollouts`` (nothing without a connected Ray)."""
    if _ray_connected():
        kv_put(_rollouts_key(server_id), json.dumps(rollouts).encode(), NAMESPACE)


def _rollouts_key(server_id: str) -> bytes:
    return f"rollouts/{server_id}".encode()


def _ray_connected() -> bool:
    import ray

    return ray.is_initialized()


# ---- the end of a start ----------------------------------------------------------------------
# Kept with the launch it belongs to: a /v2 replica of another launch, or of a Serve config (which
# has no launch), ignores it; the next launch of the same server id replaces it.

def save_startup_ended(server_id: str, launch: str, load_errors: dict[str, str]) -> None:
    """Record that ``launch``'s start ended, with the models that failed to load at start."""
    kv_put(_startup_key(server_id), json.dumps({"launch": launch, "load_errors": load_errors}).encode(), NAMESPACE)


def saved_load_errors(server_id: str, launch: str) -> dict[str, str] | None:
    """The start-up load errors ``launch`` recorded once its start ended; None before that (or
    when what is kept cannot be read)."""
    raw = kv_get(_startup_key(server_id), NAMESPACE)
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


def _startup_key(server_id: str) -> bytes:
    return f"startup/{server_id}".encode()


# ---- pool replicas' hosting reports ----------------------------------------------------------
# What each pool replica hosts and what failed to load in it ({"loaded": {application: spec
# digest}, "evicted": ..., "failed": {application: [spec digest, reason]}, "rpm": ..., "at": Unix
# time}). The deployer waits on them: it may run in a process whose deployment handles cannot be
# called (the CLI's).

def spec_digest(spec: tuple[Any, ...] | list[Any]) -> str:
    """A short fingerprint of one hosted version's spec (a reload changes it)."""
    return f"{zlib.crc32(json.dumps(list(spec), sort_keys=True).encode()):08x}"


def write_report(replica: str, report: bytes) -> None:
    """Pool replica ``replica``'s (its id's) hosting report, JSON-encoded."""
    kv_put(_report_key(replica), report, NAMESPACE)


def delete_report(replica: str) -> None:
    kv_delete(_report_key(replica), NAMESPACE)


def read_reports(replicas: list[str]) -> dict[str, dict[str, Any]]:
    """The hosting reports of these pool replicas (ids) that have written one."""
    reports = {}
    for replica in replicas:
        raw = kv_get(_report_key(replica), NAMESPACE)
        if raw is not None:
            reports[replica] = json.loads(raw)
    return reports


def read_every_report() -> dict[str, dict[str, Any]]:
    """Every pool replica's hosting report in the store, by replica id: a stopped replica's may
    be among them until it is removed (each report says when it was written)."""
    replicas = [key.decode()[len(_REPORT_PREFIX):] for key in kv_keys(_REPORT_PREFIX.encode(), NAMESPACE)]
    return read_reports(replicas)


def _report_key(replica: str) -> bytes:
    return f"{_REPORT_PREFIX}{replica}".encode()
