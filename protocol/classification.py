"""Triton's classification extension: an output asked for with ``classification: K`` is answered
with its K largest values per batch row, as BYTES strings ``"<value>:<index>[:<label>]"``.

Values print as Triton prints them (``std::to_string``: six decimals for FP32 / FP64, integers
as integers); the label of class ``i`` is line ``i`` of the output's ``label_filename`` (none
when the file has no such line or the line is empty). The shape is ``[batch, min(K, row
elements)]`` for a model that batches, else ``[min(K, elements)]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rayinfer.protocol.errors import InvalidArgError

_CLASSIFIABLE = frozenset({"UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64"})


def classification_count(parameters: dict) -> int:
    """The K a requested output's parameters ask for (0: the tensor itself)."""
    return int(parameters.get("classification", 0) or 0)


def check_classifiable(datatype: str) -> None:
    """Triton's error (INVALID_ARG) for a classification of an output of another datatype."""
    if datatype not in _CLASSIFIABLE:
        raise InvalidArgError(f"class result not available for output due to unsupported type '{datatype}'")


def classify(array: np.ndarray, datatype: str, count: int, labels: Sequence[str] | None, batching: bool) -> np.ndarray:
    """The top ``count`` classes of ``array`` (per batch row when ``batching``) as strings."""
    check_classifiable(datatype)
    rows = array.reshape(array.shape[0], -1) if batching and array.ndim > 0 else array.reshape(1, -1)
    k = min(count, rows.shape[1])
    floating = datatype in ("FP32", "FP64")
    out = np.empty((rows.shape[0], k), dtype=object)
    for r, row in enumerate(rows):
        # Largest first; among equal values, the lower index first.
        order = np.argsort(-row.astype(np.float64), kind="stable")[:k]
        for c, index in enumerate(order):
            value = f"{float(row[index]):f}" if floating else str(int(row[index]))
            label = labels[index] if labels is not None and index < len(labels) else ""
            out[r, c] = (f"{value}:{index}:{label}" if label else f"{value}:{index}").encode()
    return out if batching and array.ndim > 0 else out.reshape(k)
