"""Triton's classification strings: top K per batch row, value formatting, labels, errors."""

from __future__ import annotations

import numpy as np
import pytest

from rayinfer.protocol.classification import classify
from rayinfer.protocol.errors import InvalidArgError


def test_floats_print_six_decimals_with_labels_where_there_are_some() -> None:
    rows = np.array([[0.1, 0.7, 0.2], [3.0, 1.0, 2.0]], np.float32)
    result = classify(rows, "FP32", 2, ("cat", "", "dog"), batching=True)
    assert result.tolist() == [[b"0.700000:1", b"0.200000:2:dog"], [b"3.000000:0:cat", b"2.000000:2:dog"]]


def test_integers_print_as_integers_and_rows_are_flattened() -> None:
    result = classify(np.array([[[1, 9], [4, 2]]], np.int8), "INT8", 3, None, batching=True)
    assert result.tolist() == [[b"9:1", b"4:2", b"2:3"]]


def test_without_batching_the_whole_tensor_is_one_row_and_k_is_clipped() -> None:
    result = classify(np.array([5, 7], np.uint32), "UINT32", 5, ("a", "b"), batching=False)
    assert result.shape == (2,) and result.tolist() == [b"7:1:b", b"5:0:a"]


@pytest.mark.parametrize("datatype", ["BYTES", "BOOL", "FP16"])
def test_other_datatypes_get_tritons_error(datatype: str) -> None:
    with pytest.raises(InvalidArgError, match=f"class result not available for output due to unsupported type '{datatype}'"):
        classify(np.zeros((1, 2)), datatype, 1, None, batching=True)
