"""Where a request goes: the version of its model, then the replica, decided in one place.

Given a request's model, the version it names (or none), its sticky value (the value of its
rollout's sticky header), its sequence id and the node it arrives on, and the current
:class:`RouteTable` (each model's versions and rollout split, each version's replicas with their
node, their load and the model versions they hold), :meth:`RouteTable.pick` names the version
and the replica. Every path asks it: BLS calls and ensemble steps, streams, the ``/v2``
application's forwarded calls, the front's acceptor (:class:`ConnectionPlacement`) and the
replicas holding clients' connections (:mod:`rayinfer.transport.replica_routes`); the front's
HAProxy applies the same version rule, rendered into its configuration from the split's
:meth:`VersionSplit.front_entry` (:mod:`rayinfer.transport.front_config`). Its guarantees
(tests/unit/transport/test_router.py checks each as a property):

- **Named version**: a request naming a version goes to it (no split applies).
- **Shares**: a version-less request to a model in a rollout goes to the candidate with
  probability ``weight`` / 100: over n such requests without a sticky value the candidate's
  count is binomial (within 4.5 standard deviations of ``n * weight / 100`` but for about one
  time in 150,000). Without a split it goes to the model's default version.
- **Sticky**: requests with the same sticky value always reach the same version (the CRC-32 of
  the value modulo 100 against the weight: the rule the front's HAProxy applies with its
  ``crc32`` converter).
- **Sequences**: the requests of one sequence reach one replica, the owner of the sequence's
  slot (:mod:`rayinfer.serving.sequence_routing`), whatever node they arrive on.
- **Local first**: a request goes to a replica on its own node when the version has one.
- **Least loaded of two**: among the candidates (the local ones, else all), two are drawn at
  random and the one with fewer requests in flight is picked, so a replica with the most load of
  more than one is never picked.
- **Pooled replicas**: a replica serves a version when that version is among the models it
  holds (``models``): a replica holding many model versions is one more row of each version's
  replicas, not another path.

**Connections at a split.** A client's HTTP/1.1 connection that the front's acceptor hands to a
model replica (:mod:`rayinfer.transport.acceptor`) is not proxied request by request: the acceptor
places it on one version (:class:`ConnectionPlacement`), and the replica answers a *run* of its
version-less requests there (:class:`ConnectionTurn`, :func:`run_length`), then gives it back to
the acceptor, which places it again for the next run. The minority version's runs are
:data:`RUN_REQUESTS` long (a gRPC connection's longer, :func:`minority_run`), the majority's as
much longer as its weight is larger. Each run goes to the version furthest behind its weight's
share of the requests placed so far, unless that version's replicas already hold one connection
more than their weight's share of the model's connections (:class:`SplitPlacement`): so each
version answers its weight's share of the requests (the **Shares** guarantee, counted in runs),
and the connections stay spread over both versions by weight. A request with a sticky value goes
by its bucket wherever it arrives (one on the other version's replica is relayed to the front).
A gRPC connection is placed for a run the same way (by the requests placed only: the client's
next connection comes from another address), and its replica closes it when the run ends; the
client's gRPC library opens the next one, which the acceptor places for the next run.
"""

from __future__ import annotations

import math
import random
import sys
import zlib
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from rayinfer.serving.sequence_routing import slot_of

BUCKETS = 100
# The version-less requests a connection sends in a row to the version with the smaller weight.
RUN_REQUESTS = 64
# A connection whose run ends with a new connection (gRPC): its minority run at 50%, shorter in
# proportion to a smaller weight (at least RUN_REQUESTS), so that such a connection is replaced
# about once every GRPC_RUN_REQUESTS calls at any weight.
GRPC_RUN_REQUESTS = 512


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



@dataclass(frozen=True, slots=True)
class Replica:
    """One replica as the router sees it: ``key`` (its listener's address, or another id),
    ``node`` (the Ray node it runs on), ``load`` (its requests in flight, as last reported) and
    ``models`` (the ``<model>/<version>`` it holds: one for a dedicated replica)."""

    key: Hashable
    node: str = ""
    load: int = 0
    models: frozenset[str] = frozenset()

    def holds(self, model: str, version: str) -> bool:
        return not self.models or f"{model}/{version}" in self.models


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """One model's row: ``default`` (the version a version-less request goes to without a
    split), ``split`` (its rollout's, or None), ``replicas`` (per version) and ``slots`` (per
    version of a sequence model: each routing slot's replica key)."""

    default: str
    split: VersionSplit | None = None
    replicas: Mapping[str, Sequence[Replica]] = field(default_factory=dict)
    slots: Mapping[str, Sequence[Hashable]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Decision:
    """The version picked, and the replica (None: the version has no replica in the table)."""

    version: str
    replica: Replica | None


class RouteTable:
    """The models the router knows (:class:`ModelRoute` by name); ``rng``: its source of chance."""

    def __init__(self, models: Mapping[str, ModelRoute] | None = None, rng: random.Random | None = None) -> None:
        self.models: dict[str, ModelRoute] = dict(models or {})
        self._rng = rng or random.Random()

    def version(self, model: str, version: str = "", sticky: bytes | str | None = None) -> str | None:
        """The version a request to ``model`` naming ``version`` ("" for none) goes to; None for
        a model the table does not hold."""
        route = self.models.get(model)
        if route is None:
            return version or None
        return choose_version(version, route.split, route.default, sticky)

    def pick(self, model: str, version: str = "", sticky: bytes | str | None = None, sequence_id: object = None,
             node: str = "") -> Decision | None:
        """The version and replica for one request (see the module's guarantees); None for a
        model the table does not hold."""
        picked = self.version(model, version, sticky)
        if picked is None:
            return None
        route = self.models[model]
        replicas = [r for r in route.replicas.get(picked, ()) if r.holds(model, picked)]
        return Decision(picked, self.replica(replicas, route.slots.get(picked), sequence_id, node))

    def replica(self, replicas: Sequence[Replica], slots: Sequence[Hashable] | None = None, sequence_id: object = None,
                node: str = "") -> Replica | None:
        """The replica among ``replicas`` for one request (:func:`choose_replica`)."""
        return choose_replica(replicas, slots, sequence_id, node, self._rng)


def choose_version(version: str, split: VersionSplit | None, default: str, sticky: bytes | str | None = None) -> str:
    """The version of one request: ``version`` when it names one, else the split's pick (by
    ``sticky``, or chance), else ``default`` (the rules of the module's docstring)."""
    if version:
        return version
    return pick_version(split, sticky) if split is not None else default


def choose_replica(replicas: Sequence[Replica], slots: Sequence[Hashable] | None = None, sequence_id: object = None,
                   node: str = "", rng: random.Random | None = None) -> Replica | None:
    """The replica among ``replicas`` for one request: a sequence's slot owner, else the less
    loaded of two drawn among those on ``node`` (or among all when none is); None without one."""
    if not replicas:
        return None
    if sequence_id is not None and slots:
        owner = slots[slot_of(sequence_id) % len(slots)]
        held = next((r for r in replicas if r.key == owner), None)
        if held is not None:
            return held
    local = [r for r in replicas if node and r.node == node]
    candidates = local or list(replicas)
    if len(candidates) == 1:
        return candidates[0]
    first, second = (rng or random).sample(candidates, 2)
    return first if first.load <= second.load else second


def minority_run(split: VersionSplit, reconnects: bool = False) -> int:
    """The run at the version with the smaller weight. ``reconnects``: a run that ends with a new
    connection (a gRPC one: a TCP and HTTP/2 handshake, with the client's next calls waiting on
    it) is :data:`GRPC_RUN_REQUESTS` at 50% and in proportion to a smaller weight, at least
    :data:`RUN_REQUESTS`: both runs together are then about twice GRPC_RUN_REQUESTS, so a client
    opens a new connection about once every GRPC_RUN_REQUESTS calls whatever the weight, and the
    shares hold over a few thousand calls per connection."""
    if not reconnects:
        return RUN_REQUESTS
    minority = min(split.weight, BUCKETS - split.weight)
    return max(GRPC_RUN_REQUESTS * minority // (BUCKETS // 2), RUN_REQUESTS)


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


class ConnectionPlacement:
    """Where the front's acceptor places a client's connection to a model in a rollout, by its
    first request (the module's **Connections at a split**); ``expire_s``: how long a connection
    not placed again still counts at its version (:class:`SplitPlacement`)."""

    def __init__(self, expire_s: float) -> None:
        self._http = SplitPlacement(expire_s)
        self._grpc = SplitPlacement(expire_s, reconnects=True)

    def place(self, key: str, split: VersionSplit, grpc: bool, inference: bool,
              headers: Callable[[], Iterable[tuple[bytes | str, bytes | str]]], directed: str, client: Hashable,
              routable: Callable[[str], bool], now: float) -> tuple[str, int]:
        """(route key, run length) for a connection whose first request is for ``key``
        ("<model>/"): ``grpc``, a gRPC connection (placed for a run, its client not counted: its
        next connection comes from another address); ``inference``, an HTTP inference (a model's
        GET stays the stable version's, run 0); ``headers``: the request's (read only when the
        split has a sticky header); ``directed``: what its last replica said of its next request
        ("<key><version>" or "<key><version> <left>", :meth:`ConnectionTurn.next_place`);
        ``client``: its client's address; ``routable``: whether a route key has replicas."""
        if grpc:
            version, run = self._grpc.place(key, split, None, now)
            return f"{key}{version}", run
        if not inference:
            return key, 0
        directed, _, left = directed.partition(" ")
        # The version the last run's replica named, as the split names it ("": the stable one).
        named = directed[len(key):] if directed.startswith(key) else ""
        named = named if named == split.candidate else ""
        sticky = sticky_value(split, headers()) if split.sticky_header else None
        if sticky:
            return (f"{key}{split.candidate}" if pick_version(split, sticky) == split.candidate else key), 0
        if left.isdigit() and directed.startswith(key) and routable(directed):
            # The rest of a run (its connection was rebalanced, or its replica stops).
            self._http.at(key, named, client, now)
            return directed, int(left)
        version, run = self._http.place(key, split, client, now, named)  # a new run: the other version's
        return f"{key}{version}", run

    def leaves(self, client: Hashable) -> None:
        """``client``'s HTTP/1.1 connection is at no version (given back, waiting for its next request)."""
        self._http.leaves(client)
