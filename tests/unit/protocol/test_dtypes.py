"""Datatype names (wire, config, numpy) and the BYTES tensor framing."""

from __future__ import annotations

import numpy as np
import pytest

from rayinfer.protocol.dtypes import (
    array_from_buffer,
    WIRE_DATATYPES,
    config_to_wire,
    deserialize_bytes_tensor,
    element_size_bytes,
    numpy_dtype,
    serialize_bytes_tensor,
    wire_datatype,
    wire_to_config,
)
from rayinfer.protocol.errors import InvalidArgError

WIRE_TO_NUMPY = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BYTES": object,
}


@pytest.mark.parametrize("wire, numpy_type", WIRE_TO_NUMPY.items())
def test_wire_numpy_round_trip(wire: str, numpy_type: type) -> None:
    dtype = numpy_dtype(wire)
    assert dtype == np.dtype(numpy_type)
    assert wire_datatype(dtype) == wire


def test_wire_datatypes_lists_every_type_and_bf16() -> None:
    assert WIRE_DATATYPES == set(WIRE_TO_NUMPY) | {"BF16"}


@pytest.mark.parametrize("dtype", ["U5", "S3", object])
def test_string_like_numpy_dtypes_are_bytes(dtype: object) -> None:
    assert wire_datatype(np.dtype(dtype)) == "BYTES"


@pytest.mark.parametrize("name", ["FP8", "float32"])
def test_numpy_dtype_rejects_unsupported_names(name: str) -> None:
    with pytest.raises(InvalidArgError, match=name):
        numpy_dtype(name)


def test_bf16_is_ml_dtypes_bfloat16_both_ways() -> None:
    import ml_dtypes

    assert numpy_dtype("BF16") == np.dtype(ml_dtypes.bfloat16) and wire_datatype(np.dtype(ml_dtypes.bfloat16)) == "BF16"
    data = np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)
    back = array_from_buffer(data.tobytes(), "BF16", [2], "X", "input 'X'", lambda got, expected: "size")
    assert back.dtype == data.dtype and back.astype(np.float32).tolist() == [1.5, -2.0]


def test_wire_datatype_rejects_complex() -> None:
    with pytest.raises(InvalidArgError, match="complex"):
        wire_datatype(np.dtype(np.complex64))


@pytest.mark.parametrize("wire", sorted(WIRE_TO_NUMPY))
def test_config_wire_round_trip(wire: str) -> None:
    config = wire_to_config(wire)
    assert config.startswith("TYPE_")
    assert config_to_wire(config) == wire


def test_string_config_type_is_bytes_on_the_wire() -> None:
    assert config_to_wire("TYPE_STRING") == "BYTES"
    assert wire_to_config("BYTES") == "TYPE_STRING"
    assert config_to_wire("TYPE_FP32") == "FP32"
    assert wire_to_config("FP32") == "TYPE_FP32"
    assert config_to_wire("INT8") == "INT8"  # already a wire name


def test_element_sizes() -> None:
    assert element_size_bytes("BYTES") == 0
    assert element_size_bytes("BF16") == 2
    assert element_size_bytes("FP16") == 2
    assert element_size_bytes("INT64") == 8
    assert element_size_bytes("BOOL") == 1


def test_bytes_tensor_round_trip() -> None:
    array = np.array([[b"one", b""], [b"\x00\xff", "caf\u00e9"]], dtype=object)
    raw = serialize_bytes_tensor(array)
    assert raw[:7] == b"\x03\x00\x00\x00one"
    assert len(raw) == 4 * 4 + 3 + 0 + 2 + len("caf\u00e9".encode())
    out = deserialize_bytes_tensor(raw, 4, "INPUT0")
    assert out.dtype == object
    assert list(out) == [b"one", b"", b"\x00\xff", "caf\u00e9".encode()]


def test_bytes_tensor_of_zero_elements() -> None:
    assert serialize_bytes_tensor(np.empty(0, dtype=object)) == b""
    assert deserialize_bytes_tensor(b"", 0, "X").shape == (0,)


def test_deserialize_accepts_memoryview() -> None:
    raw = serialize_bytes_tensor(np.array([b"ab", b"c"], dtype=object))
    out = deserialize_bytes_tensor(memoryview(b"junk" + raw)[4:], 2, "X")
    assert list(out) == [b"ab", b"c"]


@pytest.mark.parametrize(
    "raw, count",
    [
        (b"\x05\x00\x00\x00abc", 1),  # length says 5, only 3 bytes follow
        (b"\x01\x00", 1),  # length prefix itself cut short
        (b"\x01\x00\x00\x00a", 2),  # second element missing
    ],
)
def test_truncated_bytes_data_names_the_input(raw: bytes, count: int) -> None:
    with pytest.raises(InvalidArgError, match="unexpected end of BYTES data for input 'INPUT7'"):
        deserialize_bytes_tensor(raw, count, "INPUT7")


def test_trailing_bytes_name_the_input() -> None:
    raw = serialize_bytes_tensor(np.array([b"a"], dtype=object)) + b"xyz"
    with pytest.raises(InvalidArgError, match="3 trailing bytes in BYTES data for input 'TEXT'"):
        deserialize_bytes_tensor(raw, 1, "TEXT")
