"""The model pool's replicas' hosting reports: what each hosts and what failed to load in it.

A pool replica writes its report to Ray's key-value store after each reconfiguration
(:mod:`pool`); the deployer waits on the reports (it may run in a process whose deployment
handles cannot be called: the CLI's), and the repository index reads a pooled version's state
from them.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from rayinfer.deployments.serve_internals import kv_get, kv_keys

# Each pool replica's last reconfiguration's outcome, in Ray's key-value store (read by the
# deployer, which may run in a process whose deployment handles cannot be called: the CLI's).
KV_NAMESPACE = "rayinfer"


_REPORT_PREFIX = "pool-report/"


def report_key(replica: str) -> bytes:
    """The key of pool replica ``replica``'s (its id's) hosting report."""
    return f"{_REPORT_PREFIX}{replica}".encode()


def spec_digest(spec: tuple[Any, ...] | list[Any]) -> str:
    """A short fingerprint of one hosted version's spec (a reload changes it)."""
    return f"{zlib.crc32(json.dumps(list(spec), sort_keys=True).encode()):08x}"


def read_reports(replicas: list[str]) -> dict[str, dict[str, Any]]:
    """The hosting reports of these pool replicas (ids) that have written one (blocking)."""
    reports = {}
    for replica in replicas:
        raw = kv_get(report_key(replica), KV_NAMESPACE)
        if raw is not None:
            reports[replica] = json.loads(raw)
    return reports


def read_every_report() -> dict[str, dict[str, Any]]:
    """Every pool replica's hosting report in the store (blocking), by replica id: a stopped
    replica's may be among them until it is removed (each report says when it was written)."""
    replicas = [key.decode()[len(_REPORT_PREFIX):] for key in kv_keys(_REPORT_PREFIX.encode(), KV_NAMESPACE)]
    return read_reports(replicas)
