"""Pure batching functions: merging along dim 0, splitting back, grouping."""

from __future__ import annotations

import numpy as np

from rayinfer.adapters.batching import group_by_signature, merge_inputs, split_outputs


def test_merge_and_split_round_trip_with_uneven_rows() -> None:
    rows = [1, 3, 2]
    requests = [
        {"A": np.full((n, 4), i, dtype=np.float32), "B": np.arange(n * 2, dtype=np.int64).reshape(n, 2) + 100 * i}
        for i, n in enumerate(rows)
    ]
    merged = merge_inputs(requests)
    assert merged["A"].shape == (6, 4) and merged["B"].shape == (6, 2)
    np.testing.assert_array_equal(merged["A"][:, 0], [0, 1, 1, 1, 2, 2])
    back = split_outputs(merged, rows)
    assert len(back) == 3
    for original, piece in zip(requests, back):
        assert set(piece) == {"A", "B"}
        for name in original:
            np.testing.assert_array_equal(piece[name], original[name])


def test_single_request_is_passed_through() -> None:
    array = np.ones((2, 3))
    merged = merge_inputs([{"A": array}])
    assert merged["A"] is array
    outputs = {"Y": np.zeros((2, 1))}
    assert split_outputs(outputs, [2]) == [outputs]


def test_bytes_tensors_merge_and_split() -> None:
    a = np.array([[b"a"], [b"b"]], dtype=object)
    b = np.array([[b"c"]], dtype=object)
    merged = merge_inputs([{"S": a}, {"S": b}])
    assert merged["S"].dtype == object and merged["S"].ravel().tolist() == [b"a", b"b", b"c"]
    first, second = split_outputs(merged, [2, 1])
    assert first["S"].ravel().tolist() == [b"a", b"b"] and second["S"].ravel().tolist() == [b"c"]


def test_group_by_signature_first_seen_order() -> None:
    signatures = [("x", (16,)), ("x", (8,)), ("x", (16,)), "other", ("x", (8,))]
    assert group_by_signature(signatures) == [[0, 2], [1, 4], [3]]
    assert group_by_signature([]) == []
    assert group_by_signature([0, 1, 2]) == [[0], [1], [2]]
