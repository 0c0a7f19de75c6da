"""Shadow traffic of a rollout: a share of the stable version's requests is also sent to the
candidate, whose answers are compared with the stable version's and discarded, so that a
candidate is judged on its answers before it answers anyone.

Two answers *agree* when they hold the same outputs with the same shapes and datatypes, and
every value is within the tolerance of the other (``numpy.isclose`` with the tolerance as both
its relative and absolute bound; strings and bytes equal). For a classifier, their *labels*
agree when each output's argmax along its last axis is the same. :class:`ShadowCounts` keeps
both, cumulative, as a replica reports them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from rayinfer.protocol.types import InferResponse

# Shadow requests a replica has in flight at most; past it, a request is not shadowed (counted).
MAX_SHADOW_IN_FLIGHT = 16


@dataclass(slots=True)
class ShadowCounts:
    """Shadow requests sent (``compared`` of them answered by both versions), how many of those
    agreed, how many had labels and how many of those agreed, how many the candidate failed, and
    how many were not sent (too many in flight)."""

    compared: int = 0
    agreed: int = 0
    labelled: int = 0
    labels_agreed: int = 0
    failed: int = 0
    skipped: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def add(self, other: ShadowCounts) -> None:
        for key, value in other.as_dict().items():
            setattr(self, key, getattr(self, key) + value)

    def record(self, stable: InferResponse, candidate: InferResponse, tolerance: float) -> None:
        self.compared += 1
        self.agreed += answers_agree(stable, candidate, tolerance)
        labels = labels_agree(stable, candidate)
        if labels is not None:
            self.labelled += 1
            self.labels_agreed += labels


def answers_agree(stable: InferResponse, candidate: InferResponse, tolerance: float) -> bool:
    """Whether every output of ``candidate`` is ``stable``'s within ``tolerance``."""
    mine = {o.name: o for o in stable.outputs}
    theirs = {o.name: o for o in candidate.outputs}
    if set(mine) != set(theirs):
        return False
    for name, output in mine.items():
        other = theirs[name]
        a, b = np.asarray(output.data), np.asarray(other.data)
        if output.datatype != other.datatype or a.shape != b.shape:
            return False
        if a.dtype.kind in "biuf":
            if not np.all(np.isclose(a, b, rtol=tolerance, atol=tolerance, equal_nan=True)):
                return False
        elif not np.array_equal(a, b):
            return False
    return True


def labels_agree(stable: InferResponse, candidate: InferResponse) -> bool | None:
    """Whether each numeric output with more than one class (its last axis) has the same argmax
    in both answers; None when no output is such."""
    theirs = {o.name: o for o in candidate.outputs}
    compared = False
    for output in stable.outputs:
        a = np.asarray(output.data)
        other = theirs.get(output.name)
        if a.dtype.kind not in "biuf" or a.ndim == 0 or a.shape[-1] < 2 or other is None:
            continue
        b = np.asarray(other.data)
        if b.shape != a.shape:
            return False
        compared = True
        if not np.array_equal(a.argmax(axis=-1), b.argmax(axis=-1)):
            return False
    return True if compared else None
