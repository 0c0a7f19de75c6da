"""Weighted routing between two versions of one model (a rollout's stable and candidate).

A request that names no version of a model in a rollout goes to the candidate when its
*bucket* is below the candidate's weight (percent), else to the stable version. The bucket is
the CRC-32 of a chosen header's value modulo 100 when the request carries it (so the same value
always reaches the same version: sticky assignment), else chance. The front's HAProxy computes
the same bucket with its ``crc32`` converter (zlib's CRC-32) for the requests it routes
(:mod:`rayinfer.serving.front_config`); the Python paths (gRPC streams, BLS calls, ensemble
steps, requests the ``/v2`` application forwards) use :func:`pick_version`.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

BUCKETS = 100


@dataclass(frozen=True, slots=True)
class VersionSplit:
    """``weight`` percent of a model's version-less requests go to ``candidate``, the rest to
    ``stable``; ``sticky_header``: the (lowercase) header whose value picks instead of chance."""

    stable: str
    candidate: str
    weight: int
    sticky_header: str = ""

    def front_entry(self) -> tuple[int, str, str]:
        """(weight, candidate version, sticky header) as the front's maps hold them."""
        return self.weight, self.candidate, self.sticky_header


def bucket_of(sticky_value: bytes | str | None) -> int:
    """The request's bucket: CRC-32 of the sticky header's value modulo :data:`BUCKETS`, or a
    random one without a value."""
    if sticky_value:
        data = sticky_value.encode("utf-8", "surrogatepass") if isinstance(sticky_value, str) else sticky_value
        return zlib.crc32(data) % BUCKETS
    return random.randrange(BUCKETS)


def pick_version(split: VersionSplit, sticky_value: bytes | str | None = None) -> str:
    """The version a version-less request goes to."""
    return split.candidate if bucket_of(sticky_value) < split.weight else split.stable


def sticky_value(split: VersionSplit, headers: Iterable[tuple[bytes | str, bytes | str]]) -> bytes | str | None:
    """The last value of the split's sticky header among ``headers`` (name, value), as the
    front reads it; None without one."""
    if not split.sticky_header:
        return None
    found = None
    for name, value in headers:
        text = name.decode("latin-1") if isinstance(name, bytes) else name
        if text.lower() == split.sticky_header:
            found = value
    return found
