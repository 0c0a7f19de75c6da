"""Pure functions behind dynamic batching: merging along dim 0, splitting back, grouping."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def merge_inputs(per_request: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Concatenate each input along the first (batch) dimension."""
    if len(per_request) == 1:
        return dict(per_request[0])
    return {name: np.concatenate([req[name] for req in per_request], axis=0) for name in per_request[0]}


def split_outputs(outputs: dict[str, np.ndarray], rows: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """Split merged outputs back into one dict per request, by the requests' row counts."""
    if len(rows) == 1:
        return [outputs]
    bounds = np.cumsum(rows)[:-1]
    pieces = {name: np.split(array, bounds, axis=0) for name, array in outputs.items()}
    return [{name: pieces[name][i] for name in outputs} for i in range(len(rows))]


def group_by_signature(signatures: Sequence[object]) -> list[list[int]]:
    """Indices grouped by signature, in first-seen order: only equal signatures are merged."""
    groups: dict[object, list[int]] = {}
    for index, signature in enumerate(signatures):
        groups.setdefault(signature, []).append(index)
    return list(groups.values())
