"""Where a request goes: the version of its model, then the replica, decided in one place.

Given a request's model, the version it names (or none), its sticky value (the value of its
rollout's sticky header), its sequence id and the node it arrives on, and the current
:class:`RouteTable` (each model's versions and rollout split, each version's replicas with their
node, their load and the model versions they hold), :meth:`RouteTable.pick` names the version
and the replica. Its guarantees (tests/unit/serving/test_router.py checks each as a property):

- **Named version**: a request naming a version goes to it (no split applies).
- **Shares**: a version-less request to a model in a rollout goes to the candidate with
  probability ``weight`` / 100: over n such requests without a sticky value the candidate's
  count is binomial (within 4.5 standard deviations of ``n * weight / 100`` but for about one
  time in 150,000). Without a split it goes to the model's default version.
- **Sticky**: requests with the same sticky value always reach the same version (the CRC-32 of
  the value modulo 100 against the weight: the rule the front's HAProxy applies with its
  ``crc32`` converter, :mod:`rayinfer.serving.front_config`).
- **Sequences**: the requests of one sequence reach one replica, the owner of the sequence's
  slot (:mod:`rayinfer.serving.sequence_routing`), whatever node they arrive on.
- **Local first**: a request goes to a replica on its own node when the version has one.
- **Least loaded of two**: among the candidates (the local ones, else all), two are drawn at
  random and the one with fewer requests in flight is picked, so a replica with the most load of
  more than one is never picked.
- **Pooled replicas**: a replica serves a version when that version is among the models it
  holds (``models``): a replica holding many model versions is one more row of each version's
  replicas, not another path.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from rayinfer.serving.sequence_routing import slot_of
from rayinfer.serving.version_split import VersionSplit, pick_version


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
