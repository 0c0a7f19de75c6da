"""Triton's version_policy: which of the version folders on disk are served."""

from __future__ import annotations

from typing import Any


def select_versions(policy: Any, available: list[int]) -> list[int]:
    """Versions to serve, ascending, for a ``ModelVersionPolicy`` message and the versions on disk.

    ``latest { num_versions: N }`` (the default, N=1) keeps the N highest; ``all {}`` keeps
    every version; ``specific { versions: [...] }`` keeps the listed ones that exist.
    """
    versions = sorted(set(available))
    kind = policy.WhichOneof("policy_choice") if policy is not None else None
    if kind == "all":
        return versions
    if kind == "specific":
        wanted = {int(v) for v in policy.specific.versions}
        return [v for v in versions if v in wanted]
    count = policy.latest.num_versions if kind == "latest" else 1
    count = max(int(count), 1)
    return versions[-count:] if versions else []


def version_dirs(names: list[str]) -> list[int]:
    """Numeric version folder names among ``names`` (Triton ignores non-numeric folders)."""
    return sorted(int(n) for n in names if n.isdigit() and not (len(n) > 1 and n.startswith("0")))
