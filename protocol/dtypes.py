"""Triton datatypes: wire names (``FP32``), config names (``TYPE_FP32``) and numpy dtypes."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np

from rayinfer.protocol.errors import InvalidArgError

# Wire datatype -> numpy dtype. BYTES tensors are numpy object arrays of ``bytes``.
_WIRE_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
    # numpy has no bfloat16 of its own: ml_dtypes' (the one JAX and ONNX use) holds the same 2 bytes.
    "BF16": np.dtype(ml_dtypes.bfloat16),
}

_NUMPY_TO_WIRE: dict[np.dtype, str] = {v: k for k, v in _WIRE_TO_NUMPY.items()}

WIRE_DATATYPES = frozenset(_WIRE_TO_NUMPY)
BF16 = _WIRE_TO_NUMPY["BF16"]


def numpy_dtype(datatype: str) -> np.dtype:
    """numpy dtype for a wire datatype (BF16: ml_dtypes' bfloat16); raises for unknown names."""
    try:
        return _WIRE_TO_NUMPY[datatype]
    except KeyError:
        raise InvalidArgError(f"unsupported datatype '{datatype}'") from None


def wire_datatype(dtype: np.dtype) -> str:
    """Wire datatype of a numpy dtype (str and bytes arrays are BYTES)."""
    dtype = np.dtype(dtype)
    if dtype.kind in ("U", "S", "O"):
        return "BYTES"
    try:
        return _NUMPY_TO_WIRE[dtype]
    except KeyError:
        raise InvalidArgError(f"unsupported numpy dtype '{dtype}'") from None


def config_to_wire(config_type: str) -> str:
    """``TYPE_FP32`` -> ``FP32``; ``TYPE_STRING`` -> ``BYTES``."""
    name = config_type[len("TYPE_"):] if config_type.startswith("TYPE_") else config_type
    return "BYTES" if name == "STRING" else name


def wire_to_config(datatype: str) -> str:
    """``FP32`` -> ``TYPE_FP32``; ``BYTES`` -> ``TYPE_STRING``."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


# A tensor's element count and byte size are 64-bit signed integers in Triton's protocol.
_MAX_COUNT = 2**63 - 1


def element_count(shape: Sequence[int], name: str, datatype: str) -> int:
    """The number of elements of input ``name``'s ``shape``; INVALID_ARG with Triton's message
    when it, or its size in bytes, does not fit a 64-bit signed integer."""
    count = math.prod(shape)
    if count > _MAX_COUNT:
        raise InvalidArgError(f"invalid shape for input '{name}': shape [{','.join(map(str, shape))}] causes total "
                              f"element count to exceed maximum size of {_MAX_COUNT}")
    size = element_size_bytes(datatype)
    if count * size > _MAX_COUNT:
        raise InvalidArgError(f"byte size overflow for input '{name}': element count ({count}) * data type size "
                              f"({size}) exceeds maximum allowed size ({_MAX_COUNT})")
    return count


def element_size_bytes(datatype: str) -> int:
    """Size of one element in the binary encoding; 0 for BYTES (variable length)."""
    if datatype == "BYTES":
        return 0
    return numpy_dtype(datatype).itemsize


def serialize_bytes_tensor(array: np.ndarray) -> bytes:
    """Binary form of a BYTES tensor: each element as a 4-byte little-endian length + bytes."""
    parts = []
    for item in array.reshape(-1):
        data = item.encode("utf-8") if isinstance(item, str) else bytes(item)
        parts.append(len(data).to_bytes(4, "little"))
        parts.append(data)
    return b"".join(parts)


def deserialize_bytes_tensor(buffer: bytes | memoryview, count: int, name: str) -> np.ndarray:
    """Parse ``count`` length-prefixed elements; raises naming the tensor when framing is wrong."""
    view = memoryview(buffer)
    items: list[bytes] = []
    offset = 0
    for _ in range(count):
        if offset + 4 > len(view):
            raise InvalidArgError(f"unexpected end of BYTES data for input '{name}'")
        length = int.from_bytes(view[offset:offset + 4], "little")
        offset += 4
        if offset + length > len(view):
            raise InvalidArgError(f"unexpected end of BYTES data for input '{name}'")
        items.append(bytes(view[offset:offset + length]))
        offset += length
    if offset != len(view):
        raise InvalidArgError(
            f"unexpected {len(view) - offset} trailing bytes in BYTES data for input '{name}'"
        )
    out = np.empty(count, dtype=object)
    out[:] = items
    return out


def array_from_buffer(
    buffer: bytes | memoryview, datatype: str, shape: Sequence[int], name: str, subject: str,
    size_mismatch: Callable[[int, int], str],
) -> np.ndarray:
    """A tensor from its binary form (HTTP's binary extension and gRPC's raw contents share it).

    ``subject`` names the tensor in messages; ``size_mismatch(got, expected)`` is the message
    when the buffer's size does not fit ``shape`` and ``datatype``.
    """
    count = math.prod(shape)
    if datatype == "BYTES":
        return deserialize_bytes_tensor(buffer, count, name).reshape(shape)
    expected = count * element_size_bytes(datatype)
    if len(buffer) != expected:
        raise InvalidArgError(size_mismatch(len(buffer), expected))
    return np.frombuffer(buffer, dtype=numpy_dtype(datatype)).reshape(shape)
