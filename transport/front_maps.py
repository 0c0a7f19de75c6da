"""A front's route maps: the files in its folder that its HAProxy's rules and its acceptor read,
and that :meth:`rayinfer.deployments.front.Front.publish` writes after each change.

Each map is HAProxy's map format, one ``<key> <value>`` line per entry: the replica count of each
route key (``<model>/<version>``; the default version's key is ``<model>/``), each replica's
listener (``<model>/<version>/<n>`` -> ``<host>|<port>``), the keys routed by sequence slot, and
a rollout's split of each model (the candidate's weight, its version, the sticky header).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from pathlib import Path

from rayinfer.transport.front_paths import FrontPaths
from rayinfer.transport.router import VersionSplit


@dataclass(frozen=True, slots=True)
class MapPaths:
    """The map files of the front whose folder is ``folder``."""

    counts: Path
    listeners: Path
    sequences: Path
    splits: Path
    split_versions: Path
    split_headers: Path

    @classmethod
    def of(cls, folder: Path) -> MapPaths:
        paths = FrontPaths(folder)
        return cls(*(paths.map_file(name) for name in ("replicas", "listeners", "sequences", "splits", "split_versions",
                                                         "split_headers")))

    def all(self) -> tuple[Path, ...]:
        return astuple(self)


def routes_on_disk(folder: Path) -> tuple[dict[str, list[tuple[str, int]]], frozenset[str]]:
    """The routes the front in ``folder`` was last given (its maps, as written after each
    change): ``<model>/<version>`` -> its listeners, and the keys routed by sequence slot."""
    paths = MapPaths.of(folder)
    addresses = {}
    for line in paths.listeners.read_text().splitlines():
        entry, _, listener = line.partition(" ")
        host, _, port = listener.rpartition("|")
        addresses[entry] = (host, int(port))
    routes = {}
    for line in paths.counts.read_text().splitlines():
        key, _, count = line.partition(" ")
        routes[key] = [addresses[f"{key}/{n}"] for n in range(int(count)) if f"{key}/{n}" in addresses]
    sequences = frozenset(line.partition(" ")[0] for line in paths.sequences.read_text().splitlines())
    return routes, sequences


def splits_on_disk(folder: Path) -> dict[str, tuple[int, str, str]]:
    """The rollouts' splits the front in ``folder`` was last given: model -> (the candidate's
    weight, its version, the sticky header or "")."""
    def read(path: Path) -> dict[str, str]:
        lines = path.read_text().splitlines() if path.exists() else []
        return dict(line.partition(" ")[::2] for line in lines if line)

    paths = MapPaths.of(folder)
    weights, versions, headers = read(paths.splits), read(paths.split_versions), read(paths.split_headers)
    return {model: (int(weight), versions[model], headers.get(model, ""))
            for model, weight in weights.items() if model in versions}


class RouteMaps:
    """The route maps of the front in ``folder`` as last written to disk, read again when they
    change."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        paths = MapPaths.of(folder)
        self._paths = [paths.counts, paths.listeners, paths.sequences, paths.splits]
        self._stamps: list[int] = []
        self.listeners: dict[str, list[tuple[str, int]]] = {}
        self.sequences: frozenset[str] = frozenset()
        # Models in a rollout: their version-less requests are split between two versions.
        self.splits: dict[str, VersionSplit] = {}

    def refresh(self) -> None:
        """Read the maps again if they changed (a stat of each per new connection)."""
        try:
            stamps = [path.stat().st_mtime_ns if path.exists() else 0 for path in self._paths]
            if stamps != self._stamps:
                self.listeners, self.sequences = routes_on_disk(self._folder)
                self.splits = {model: VersionSplit("", candidate, weight, header)
                               for model, (weight, candidate, header) in splits_on_disk(self._folder).items()}
                self._stamps = stamps
        except (OSError, ValueError):  # a map being written: the last one read stays
            return
