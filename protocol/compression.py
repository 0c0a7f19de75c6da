"""HTTP body compression as Triton's clients use it: gzip and deflate, both directions."""

from __future__ import annotations

import gzip
import zlib

from rayinfer.protocol.errors import InvalidArgError, UnsupportedError

ENCODINGS = ("gzip", "deflate")


def decompress_body(body: bytes, content_encoding: str | None) -> bytes:
    """The request body without its ``Content-Encoding`` (``identity``, ``gzip`` or ``deflate``)."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        return body
    try:
        if encoding == "gzip":
            return gzip.decompress(body)
        if encoding == "deflate":
            return zlib.decompress(body)
    except (OSError, EOFError, zlib.error) as exc:
        raise InvalidArgError(f"failed to decompress the {encoding} request body: {exc}") from None
    raise UnsupportedError(f"unsupported Content-Encoding '{encoding}'; supported: gzip, deflate")


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
