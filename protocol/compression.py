"""HTTP body compression as Triton's clients use it: gzip and deflate, both directions."""

from __future__ import annotations

import asyncio
import gzip
import zlib

from rayinfer.protocol.errors import InvalidArgError, UnsupportedError
from rayinfer.protocol.limits import DEFAULT_HTTP_MAX_INPUT_SIZE, body_too_large

ENCODINGS = ("gzip", "deflate")
# A compressed body or message larger than this is inflated on a worker thread, off the event loop.
INLINE_INFLATE_BYTES = 1 << 16
_WBITS = {"gzip": 31, "deflate": 15}


def decompress_body(body: bytes, content_encoding: str | None, limit: int = DEFAULT_HTTP_MAX_INPUT_SIZE) -> bytes:
    """The request body without its ``Content-Encoding`` (``identity``, ``gzip`` or ``deflate``);
    inflating stops as soon as the result would pass ``limit`` bytes (a small body may inflate
    to gigabytes)."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding not in _WBITS:
        raise UnsupportedError(f"unsupported Content-Encoding '{encoding}'; supported: gzip, deflate")
    try:
        inflated = inflate(body, _WBITS[encoding], limit)
    except zlib.error as exc:
        raise InvalidArgError(f"failed to decompress the {encoding} request body: {exc}") from None
    if inflated is None:
        raise body_too_large(limit, what="Decompressed request body")
    return inflated


async def decompress_off_loop(body: bytes, content_encoding: str | None,
                              limit: int = DEFAULT_HTTP_MAX_INPUT_SIZE) -> bytes:
    """:func:`decompress_body` on a worker thread for a compressed body over
    :data:`INLINE_INFLATE_BYTES` (inflating it may take long), else at once on the event loop."""
    if content_encoding and len(body) > INLINE_INFLATE_BYTES and content_encoding.strip().lower() != "identity":
        return await asyncio.to_thread(decompress_body, body, content_encoding, limit)
    return decompress_body(body, content_encoding, limit)


def inflate(data: bytes, wbits: int, limit: int) -> bytes | None:
    """zlib (15) or gzip (31, members in a row) data inflated, or None if that passes ``limit``
    bytes (found without inflating further); ``zlib.error`` for data corrupt or ending early."""
    parts: list[bytes] = []
    total = 0
    while True:
        inflater = zlib.decompressobj(wbits)
        part = inflater.decompress(data, limit - total + 1)
        total += len(part)
        if total > limit:
            return None
        parts.append(part)
        if not inflater.eof:
            raise zlib.error("the compressed data ends before its end-of-stream marker")
        data = inflater.unused_data
        if not data or wbits != 31:
            break
    if data:
        raise zlib.error(f"{len(data)} bytes after the end of the compressed data")
    return parts[0] if len(parts) == 1 else b"".join(parts)


def response_encoding(accept_encoding: str | None) -> str | None:
    """The first of gzip or deflate that the client accepts, or None for an uncompressed reply."""
    if not accept_encoding:
        return None
    accepted = [part.split(";")[0].strip().lower() for part in accept_encoding.split(",")]
    for encoding in accepted:
        if encoding in ENCODINGS:
            return encoding
    return None


def compress_body(body: bytes, encoding: str) -> bytes:
    """Compress a response body with ``gzip`` or ``deflate``."""
    return gzip.compress(body, compresslevel=1) if encoding == "gzip" else zlib.compress(body, 1)
