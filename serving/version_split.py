"""Weighted routing between two versions of one model (a rollout's stable and candidate).

A request that names no version of a model in a rollout goes to the candidate when its
*bucket* is below the candidate's weight (percent), else to the stable version. The bucket is
the CRC-32 of a chosen header's value modulo 100 when the request carries it (so the same value
always reaches the same version: sticky assignment), else chance. The front's HAProxy computes
the same bucket with its ``crc32`` converter (zlib's CRC-32) for the requests it routes
(:mod:`rayinfer.serving.front_config`); the Python paths (gRPC streams, BLS calls, ensemble
steps, requests the ``/v2`` application forwards) ask the router (:mod:`rayinfer.serving.router`),
which applies :func:`pick_version`.

A client's HTTP/1.1 connection that the front's acceptor hands to a model replica
(:mod:`rayinfer.serving.acceptor`) is not proxied request by request: the acceptor places it on
one version by the same pick, and the replica answers a *run* of its version-less requests
there (:class:`ConnectionTurn`, :func:`run_length`), then gives it back to the acceptor, which
places it again for the next run (:class:`SplitPlacement`). The minority version's runs are
:data:`RUN_REQUESTS` long (a gRPC connection's longer, :func:`minority_run`), the majority's as
much longer as its weight is larger. The acceptor
places each run at the version furthest behind its weight's share of the requests placed so far,
unless that version's replicas already hold one connection more than their weight's share of the
model's connections: so that each version answers its weight's share of the requests, and the
connections stay spread over both versions by weight instead of gathering at one. A request with a sticky value
goes by its bucket wherever it arrives (one on the other version's replica is relayed to the
front, and the connection placed again by its next request). A gRPC connection is placed for a
run the same way (by the requests placed only: the client's next connection comes from another
address), and its replica closes it when the run ends (:mod:`rayinfer.serving.replica_h2`); the
client's gRPC library opens the next one, which the acceptor places for the next run.
"""

from __future__ import annotations

import math
import random
import sys
import zlib
from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

BUCKETS = 100
# The version-less requests a connection sends in a row to the version with the smaller weight.
RUN_REQUESTS = 32
# A connection whose run ends with a new connection (gRPC): RUN_REQUESTS for each this many
# percent of the minority's weight, up to MAX_RUN_REQUESTS.
RUN_STEP_PERCENT = 10
MAX_RUN_REQUESTS = 4 * RUN_REQUESTS


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


def minority_run(split: VersionSplit, reconnects: bool = False) -> int:
    """The run at the version with the smaller weight. ``reconnects``: a run that ends with a new
    connection (a gRPC one: a TCP and HTTP/2 handshake, with the client's next calls waiting on
    it) is :data:`RUN_REQUESTS` for each :data:`RUN_STEP_PERCENT` percent of that weight, up to
    :data:`MAX_RUN_REQUESTS`: a run's end costs more, and less often near 50%, while a small
    weight keeps its share over a few hundred calls."""
    if not reconnects:
        return RUN_REQUESTS
    minority = min(split.weight, BUCKETS - split.weight)
    return min(max(minority // RUN_STEP_PERCENT, 1) * RUN_REQUESTS, MAX_RUN_REQUESTS)


def run_length(split: VersionSplit, version: str, reconnects: bool = False) -> int:
    """How many version-less requests a connection placed on ``version`` answers there in a row
    (0: none, the version has no weight; chance rounds a fractional mean); ``reconnects``: as
    :func:`minority_run` says."""
    share = split.weight if version == split.candidate else BUCKETS - split.weight
    minority = min(split.weight, BUCKETS - split.weight)
    if share <= 0:
        return 0
    if minority <= 0:
        return sys.maxsize
    mean = minority_run(split, reconnects) * share / minority
    whole = int(mean)
    return whole + (random.random() < mean - whole)


class ConnectionTurn:
    """A client connection's turn at a replica of one version of a split model: ``left``, the
    version-less requests it still answers here in its run (``weight``: the split's weight when
    the run began); ``move_to``: the version the connection goes to once its run ended;
    ``reconnects``: its runs end with a new connection (:func:`minority_run`)."""

    __slots__ = ("left", "move_to", "reconnects", "version", "weight")

    def __init__(self, left: int = 0, reconnects: bool = False) -> None:
        self.left = left  # a run carried over from another replica of this version, or none
        self.reconnects = reconnects
        self.move_to = ""
        self.version = ""
        self.weight = -1

    def serves(self, split: VersionSplit, version: str, sticky: bytes | str | None) -> bool:
        """Whether a version-less request (``sticky``: its sticky value) is answered here, at
        ``version``: one with a sticky value by its bucket, another while the run lasts (a new
        run begins when the last one ended with the connection still here; a new weight cuts a
        run to the new weight's length)."""
        if sticky:
            return pick_version(split, sticky) == version
        if split.weight != self.weight:
            length = run_length(split, version, self.reconnects)
            self.left, self.weight, self.move_to = min(self.left, length) if self.left else length, split.weight, ""
        elif not self.left:
            self.left, self.move_to = run_length(split, version, self.reconnects), ""
        if not self.left:
            return False
        self.version = version
        self.left -= 1
        if not self.left:
            self.move_to = split.stable if version == split.candidate else split.candidate
        return True

    def next_place(self) -> str:
        """Where the connection's next version-less request goes once it is given back: the
        other version (its run ended), the rest of its run at this version (``"<version>
        <left>"``: it is rebalanced, or its replica stops), or "" (it has no run)."""
        if self.move_to:
            return self.move_to
        return f"{self.version} {self.left}" if self.left and self.version else ""


class SplitPlacement:
    """Where a front's acceptor places the client connections of split models for their next run
    (``stable`` and ``candidate``: the versions as the split names them). A run goes to the
    version whose share of the requests placed so far (the runs' lengths, since the weight was
    last set) is furthest below its weight, unless that version already holds one connection more
    than its weight's share of the model's connections (rounded up): then to the other. Connections are known by their
    client's address; one not placed again within ``expire_s`` counts no more (it closed, or its
    client went idle: a replica gives a connection back between two requests every few seconds);
    ``reconnects``: the runs of connections that end with a new one (:func:`minority_run`)."""

    def __init__(self, expire_s: float, reconnects: bool = False) -> None:
        self._expire_s = expire_s
        self._reconnects = reconnects
        self._at: dict[Hashable, tuple[str, str, float]] = {}  # client -> (model, version, placed at)
        self._connections: Counter[tuple[str, str]] = Counter()  # (model, version) -> connections there
        self._requests: dict[str, tuple[int, Counter[str]]] = {}  # model -> (weight, requests placed per version)
        self._swept_at = 0.0

    def place(self, model: str, split: VersionSplit, client: Hashable, now: float,
              preferred: str = "") -> tuple[str, int]:
        """(version, run length) of the next run of ``client``'s connection to ``model``;
        ``preferred``: the version it goes to when both are as far behind (the other one than
        its last run's, so that one client's runs alternate)."""
        self._sweep(now)
        self.leaves(client)
        weight, placed = self._requests.get(model, (-1, Counter()))
        if weight != split.weight:  # a new weight: shares count from now
            placed = Counter()
            self._requests[model] = (split.weight, placed)
        shares = {split.stable: BUCKETS - split.weight, split.candidate: split.weight}
        connections = 1 + self._connections[(model, split.stable)] + self._connections[(model, split.candidate)]
        total = sum(placed.values())
        behind = sorted((v for v in shares if shares[v] > 0),
                        key=lambda v: (placed[v] - shares[v] * total / BUCKETS, v != preferred, random.random()))
        # One connection beyond its share (rounded up), so that a few connections never hold one
        # another in place: with two clients at 50%, each one's runs still alternate.
        version = next((v for v in behind
                        if self._connections[(model, v)] <= math.ceil(shares[v] * connections / BUCKETS)), behind[0])
        length = run_length(split, version, self._reconnects)
        placed[version] += min(length, 1 << 62)
        self.at(model, version, client, now)
        return version, length

    def at(self, model: str, version: str, client: Hashable, now: float) -> None:
        """``client``'s connection is at ``version`` of ``model`` (placed there to go on with its run;
        None: a client whose address is not known, not counted)."""
        self.leaves(client)
        if client is None:
            return
        self._at[client] = (model, version, now)
        self._connections[(model, version)] += 1

    def leaves(self, client: Hashable) -> None:
        """``client``'s connection is at no version (given back, or closed)."""
        entry = self._at.pop(client, None)
        if entry is not None:
            self._connections[entry[:2]] -= 1

    def connections(self, model: str, version: str) -> int:
        """How many connections to ``model`` are counted at ``version``."""
        return self._connections[(model, version)]

    def _sweep(self, now: float) -> None:
        if now - self._swept_at < self._expire_s / 4:
            return
        self._swept_at = now
        for client in [c for c, (_, _, placed_at) in self._at.items() if now - placed_at > self._expire_s]:
            self.leaves(client)
