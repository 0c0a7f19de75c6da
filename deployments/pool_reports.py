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

from rayinfer.deployments.serve_internals import kv_get

# Each pool replica's last reconfiguration's outcome, in Ray's key-value store (read by the
# deployer, which may run in a process whose deployment handles cannot be called: the CLI's).
KV_NAMESPACE = "rayinfer"


def report_key(replica: str) -> bytes:
    """The key of pool replica ``replica``'s (its id's) hosting report."""
    return f"pool-report/{replica}".encode()


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
