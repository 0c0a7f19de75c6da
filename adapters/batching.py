"""Pure functions behind dynamic batching: row counting, merging along dim 0, splitting back."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def effective_batch_size(
    rows: Sequence[int], max_batch_size: int, preferred: Sequence[int] = ()
) -> int:
    """How full a batch of requests with these row counts is, for ``@serve.batch``.

    Triton counts rows, not requests. A batch whose rows reach a preferred batch size counts as
    full so it is dispatched at once; a request that would push a batch past a preferred size it
    had already reached counts as overflow (more than ``max_batch_size``), so it waits for the
    next batch.
    """
    total = sum(rows)
    if preferred and len(rows) > 1 and total not in preferred:
        if total - rows[-1] in preferred:
            return max_batch_size + 1
    if preferred and total in preferred:
        return max(max_batch_size, total)
    return total


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
