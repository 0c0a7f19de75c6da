"""gRPC on the wire: a unary call's message framing and statuses, and as much of HTTP/2 (RFC
9113, HPACK: RFC 7541) as a model replica needs to answer unary calls on a client's connection
and the front's acceptor to read a connection's first call.

What a peer sends is parsed by python-hyper's libraries: frames by ``hyperframe``, header
blocks by ``hpack``; SETTINGS values are checked here (:func:`check_settings`). What this
side sends is encoded here, every field
indexed in the static table or a literal without indexing and without Huffman coding, so the
client's decoder table never changes (the response headers and the OK trailers are constant
bytes).
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Any, NamedTuple

import grpc
import hpack
from hyperframe.exceptions import HyperframeError
from hyperframe.frame import Frame

from rayinfer.protocol.compression import INLINE_INFLATE_BYTES, inflate
from rayinfer.protocol.h2_fields import check_fields
from rayinfer.protocol.errors import InternalError, UnsupportedError, as_serving_error, grpc_status_name
from rayinfer.protocol.limits import DEFAULT_CONNECTION_LIMITS, message_too_large

DEFAULT_MAX_MESSAGE_BYTES = DEFAULT_CONNECTION_LIMITS.max_message_bytes
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SERVICE = "/inference.GRPCInferenceService/"
# Frame types and flags.
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
# Settings and error codes this side uses.
SETTINGS_ENABLE_PUSH = 0x2
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_INITIAL_WINDOW_SIZE = 0x4
SETTINGS_MAX_FRAME_SIZE = 0x5
SETTINGS_MAX_HEADER_LIST_SIZE = 0x6
SETTINGS_ENABLE_CONNECT_PROTOCOL = 0x8
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, STREAM_CLOSED, FRAME_SIZE_ERROR = 0x0, 0x1, 0x3, 0x5, 0x6
REFUSED_STREAM, CANCEL, ENHANCE_YOUR_CALM = 0x7, 0x8, 0xB
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME_SIZE = 16_384
MAX_FRAME_SIZE = (1 << 24) - 1
MAX_WINDOW = (1 << 31) - 1
# The model RPCs the front routes by the model name and version their message starts with.
ROUTED_RPCS = ("ModelInfer", "ModelReady", "ModelMetadata", "ModelConfig", "ModelStatistics")
# A stream: the acceptor gives a connection that starts with one to a replica of the model its
# first message names (any replica of its machine when that message is not there yet).
STREAM_RPC = "ModelStreamInfer"
# Calls a replica never answers itself (a call that may stop the replica): the acceptor gives a
# connection that starts with one to the front's HAProxy; on a connection a replica holds, they
# are sent again elsewhere.
NOT_DIRECT_RPCS = frozenset({"RepositoryModelLoad", "RepositoryModelUnload"})


def grpc_message_header(message: str) -> bytes:
    """``grpc-message``'s value: UTF-8, percent-encoded outside printable ASCII and for ``%``."""
    return b"".join(
        bytes([b]) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in message.encode()
    )


def grpc_status(exc: BaseException) -> tuple[int, bytes]:
    """Triton's gRPC status for ``exc`` (or the gRPC status it names) and its ``grpc-message``."""
    error = as_serving_error(exc)
    status = grpc.StatusCode[getattr(error, "grpc_status", None) or grpc_status_name(error.code)].value[0]
    return status, grpc_message_header(error.message)


def message_frame(message: bytes) -> bytes:
    """One uncompressed message in gRPC's length-prefixed framing (what :func:`unframe` reads)."""
    return b"\0" + len(message).to_bytes(4, "big") + message


def reset_stream(stream: int, code: int = 0) -> bytes:
    """An RST_STREAM frame (``code``: RFC 9113's error code; 0 is NO_ERROR)."""
    return frame(RST_STREAM, 0, stream, code.to_bytes(4, "big"))


def unframe(body: bytes, encoding: bytes | None, limit: int = DEFAULT_MAX_MESSAGE_BYTES) -> bytes:
    """The one message of a unary call's body (gRPC length-prefixed framing), inflated when it is
    compressed; a message over ``limit`` bytes (``--grpc-max-message-size``; inflating stops
    as soon as it passes it) is refused with gRPC's RESOURCE_EXHAUSTED."""
    if len(body) < 5:
        raise InternalError("malformed gRPC request: incomplete message frame")
    compressed, length = body[0], int.from_bytes(body[1:5], "big")
    if len(body) != 5 + length:
        raise InternalError("malformed gRPC request: expected exactly one message")
    if length > limit:
        raise message_too_large(length, limit)
    message = body[5:]
    if not compressed:
        return message
    name = (encoding or b"identity").decode("latin-1")
    if name not in ("gzip", "deflate"):
        raise UnsupportedError(f"gRPC message compression '{name}' is not supported")
    try:
        inflated = inflate(message, 31 if name == "gzip" else 15, limit)
    except zlib.error as exc:
        raise InternalError(f"malformed gRPC request: cannot decompress ({exc})") from None
    if inflated is None:
        raise message_too_large(limit + 1, limit)
    return inflated


async def unframe_off_loop(body: bytes, encoding: bytes | None, limit: int = DEFAULT_MAX_MESSAGE_BYTES) -> bytes:
    """:func:`unframe` on a worker thread when the message is compressed and over
    :data:`INLINE_INFLATE_BYTES` (inflating it may take long), else at once on the event loop."""
    if len(body) > INLINE_INFLATE_BYTES and body[0]:
        return await asyncio.to_thread(unframe, body, encoding, limit)
    return unframe(body, encoding, limit)


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


def _string(data: bytes) -> bytes:
    """An HPACK string literal, not Huffman-coded (7-bit prefix length)."""
    return _integer(len(data), 7) + data


def _integer(value: int, prefix: int) -> bytes:
    top = (1 << prefix) - 1
    if value < top:
        return bytes((value,))
    out, value = [top], value - top
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """A header field as a literal without indexing, with a literal name."""
    return b"\x00" + _string(name) + _string(value)


# ":status: 200" (static table entry 8) and gRPC's content type.
RESPONSE_HEADERS = b"\x88" + literal(b"content-type", b"application/grpc")
OK_TRAILERS = literal(b"grpc-status", b"0")


def header_frames(stream: int, block: bytes, end_stream: bool, max_frame: int) -> bytes:
    """A header block as a HEADERS frame, and CONTINUATIONs when it is over ``max_frame``."""
    first, rest = block[:max_frame], block[max_frame:]
    flags = END_STREAM if end_stream else 0
    if not rest:
        return frame(HEADERS, flags | END_HEADERS, stream, first)
    parts = [frame(HEADERS, flags, stream, first)]
    while rest:
        chunk, rest = rest[:max_frame], rest[max_frame:]
        parts.append(frame(CONTINUATION, 0 if rest else END_HEADERS, stream, chunk))
    return b"".join(parts)


def trailers(status: int, message: bytes = b"") -> bytes:
    block = literal(b"grpc-status", b"%d" % status)
    return block + literal(b"grpc-message", message) if message else block


def settings(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in values.items()))


class H2ProtocolError(ValueError):
    """A peer broke RFC 9113 in a way that ends the connection: ``code`` is the error its
    ``GOAWAY`` carries."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return self.message


def check_settings(values: dict[int, int]) -> None:
    """Raise :class:`H2ProtocolError` for a SETTINGS value RFC 9113 (section 6.5.2) forbids."""
    for setting, value in values.items():
        if setting in (SETTINGS_ENABLE_PUSH, SETTINGS_ENABLE_CONNECT_PROTOCOL) and value > 1:
            raise H2ProtocolError(PROTOCOL_ERROR, f"SETTINGS 0x{setting:x} = {value}: must be 0 or 1")
        if setting == SETTINGS_INITIAL_WINDOW_SIZE and value > MAX_WINDOW:
            raise H2ProtocolError(FLOW_CONTROL_ERROR, f"SETTINGS_INITIAL_WINDOW_SIZE = {value}: over 2^31-1")
        if setting == SETTINGS_MAX_FRAME_SIZE and not DEFAULT_FRAME_SIZE <= value <= MAX_FRAME_SIZE:
            raise H2ProtocolError(PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE = {value}: not in 16384..2^24-1")


class HotFrame:
    """A DATA, HEADERS or WINDOW_UPDATE frame in the form a unary call's frames take (no padding,
    no priority fields): the attributes of hyperframe's frame classes that this side reads."""

    __slots__ = ("type", "stream_id", "flags", "data", "window_increment")

    def __init__(self, kind: int, stream: int, flags: frozenset[str], data: bytes, increment: int = 0) -> None:
        self.type, self.stream_id, self.flags, self.data, self.window_increment = kind, stream, flags, data, increment


# DATA's and HEADERS' flag bits by the names hyperframe gives them; a frame with PADDED (0x8) or
# PRIORITY (0x20) goes to hyperframe.
_FLAG_NAMES = {(kind, bits): frozenset(name for bit, name in ((END_STREAM, "END_STREAM"), (END_HEADERS, "END_HEADERS"))
                                       if bits & bit and (kind == HEADERS or bit == END_STREAM))
               for kind in (DATA, HEADERS) for bits in range(8)}
_UNCOMMON_FLAGS = 0x8 | 0x20


def parse_frame(view: memoryview, at: int, length: int) -> Any:
    """The frame at ``at`` in ``view`` (its 9-byte header and ``length`` bytes of body there).

    The frames every unary call brings (HEADERS, DATA, and the client's WINDOW_UPDATEs for the
    answer) are read here when they take their plain form, by hyperframe's rules (a DATA or
    HEADERS frame on stream 0, or a WINDOW_UPDATE whose body is not 4 bytes or whose increment is
    not 1..2^31-1, goes to hyperframe, which refuses it); every other frame is hyperframe's own.
    hyperframe builds an object with a flag set per frame, about 2.5 us, four times per call;
    tests/unit/protocol/test_grpc_wire_frames.py
    checks that both read every such frame alike."""
    kind, bits = view[at + 3], view[at + 4]
    stream = int.from_bytes(view[at + 5:at + 9], "big") & MAX_WINDOW
    if stream and (kind == DATA or kind == HEADERS) and not bits & _UNCOMMON_FLAGS:
        return HotFrame(kind, stream, _FLAG_NAMES[kind, bits & 0x7], bytes(view[at + 9:at + 9 + length]))
    if kind == WINDOW_UPDATE and length == 4:
        increment = int.from_bytes(view[at + 9:at + 13], "big")
        if 1 <= increment <= MAX_WINDOW:
            return HotFrame(kind, stream, frozenset(), b"", increment)
    parsed, _ = Frame.parse_frame_header(view[at:at + 9])
    parsed.parse_body(view[at + 9:at + 9 + length])
    return parsed


def window_update(stream: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream, increment.to_bytes(4, "big"))


def goaway(last_stream: int, code: int = NO_ERROR) -> bytes:
    return frame(GOAWAY, 0, 0, last_stream.to_bytes(4, "big") + code.to_bytes(4, "big"))


Headers = list[tuple[bytes, bytes]]


class HeaderDecoder:
    """One connection's HPACK decoder. A block made only of one-byte indexed fields (what a
    client sends once its headers are in the table) changes nothing, so its fields are kept and
    the next identical block is not decoded again. Every block's fields are checked
    (:func:`~rayinfer.protocol.h2_fields.check_fields`): one that breaks RFC 9113's rules raises
    :class:`~rayinfer.protocol.h2_fields.MalformedFields` after the table has taken it."""

    def __init__(self, max_header_list_size: int = 1 << 16) -> None:
        self._decoder = hpack.Decoder()
        # A block whose fields add up to more (RFC 7541's sizes) raises OversizedHeaderListError.
        self._decoder.max_header_list_size = max_header_list_size
        self._known: dict[bytes, Headers] = {}

    def decode(self, block: bytes) -> Headers:
        known = self._known.get(block)
        if known is not None:
            return known
        headers = [(bytes(name), bytes(value)) for name, value in self._decoder.decode(block, raw=True)]
        check_fields(headers)  # (a block kept below was checked when it was first decoded)
        if all(0x81 <= byte <= 0xFE for byte in block):
            if len(self._known) >= 64:
                self._known.clear()
            self._known[block] = headers
        else:  # the table may have changed: the fields of a kept block's indices with it
            self._known.clear()
        return headers


def varint(data: bytes, at: int) -> tuple[int, int] | None:
    """A protobuf varint at ``at``: (value, where it ends), None if ``data`` ends first."""
    value = shift = 0
    while at < len(data):
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")
    return None


def name_and_version(message: bytes, complete: bool = True) -> tuple[str, str] | None:
    """Fields 1 and 2 (the model's name and version) a model RPC's message starts with; None
    when ``message`` (not ``complete``) ends before them."""
    name = version = b""
    at = 0
    while at < len(message) and message[at] in (0x0A, 0x12):
        read = varint(message, at + 1)
        if read is None or read[1] + read[0] > len(message):
            if complete:
                raise ValueError("truncated message")
            return None
        value = message[read[1]:read[1] + read[0]]
        if message[at] == 0x0A:
            name = value
        else:
            version = value
        at = read[1] + read[0]
    if at >= len(message) and not complete:
        return None
    return name.decode("utf-8", "replace"), version.decode("utf-8", "replace")


def with_version(message: bytes, version: str) -> bytes:
    """A model RPC's ``message`` that names no version, naming ``version`` (field 2, written
    first: the fields a message starts with are what :func:`name_and_version` and the front's
    HAProxy read)."""
    value = version.encode()
    if len(value) > 0x7F:
        raise ValueError("version too long")
    return b"\x12" + bytes([len(value)]) + value + message


class FirstCall(NamedTuple):
    """The first call on a client's connection: its method (the part of the path after the
    service's name; the whole path for another service's), and for a model RPC the model and
    version its message names (None when it cannot be read: a compressed message)."""

    method: str
    model: str | None = None
    version: str = ""


INCOMPLETE = FirstCall("")


def first_call(data: bytes, max_header_list_size: int = 1 << 14, stream_message: bool = True) -> FirstCall | None:
    """The first call of a connection whose first bytes are ``data``; :data:`INCOMPLETE` (test
    with ``is``) when more bytes are needed to tell; None when they are not HTTP/2 with prior
    knowledge, or not valid. Frames are parsed by ``hyperframe``, the header block decoded by
    ``hpack`` (at most ``max_header_list_size`` bytes, before and after decoding). A stream is
    :data:`INCOMPLETE` until its first message is there, unless ``stream_message`` is False
    (then a stream whose message has not come is a call naming no model)."""
    if not PREFACE.startswith(data[:len(PREFACE)]):
        return None
    view, at, stream, block, method, body = memoryview(data), len(PREFACE), 0, b"", "", b""
    try:
        while at + 9 <= len(data):
            parsed: Any  # the frame's own class (DataFrame, HeadersFrame, ...)
            parsed, length = Frame.parse_frame_header(view[at:at + 9])
            if length > DEFAULT_FRAME_SIZE:
                return None
            if at + 9 + length > len(data):
                if parsed.type == DATA and method:  # the start of a message may be enough
                    return _first_message(method, body + bytes(view[at + 9:]), False, parsed.flags)
                return INCOMPLETE
            parsed.parse_body(view[at + 9:at + 9 + length])
            at += 9 + length
            if parsed.type == HEADERS and not stream:
                stream, block = parsed.stream_id, parsed.data
            elif parsed.type == CONTINUATION and parsed.stream_id == stream and not method:
                block += parsed.data
            elif parsed.type == DATA and parsed.stream_id == stream and method:
                body += parsed.data
                found = _first_message(method, body, "END_STREAM" in parsed.flags)
                if found is not INCOMPLETE:
                    return found
                continue
            else:
                continue
            if len(block) > max_header_list_size:
                return None
            if "END_HEADERS" not in parsed.flags:
                continue
            decoder = hpack.Decoder()
            decoder.max_header_list_size = max_header_list_size
            headers = dict(decoder.decode(block, raw=True))
            path = bytes(headers.get(b":path", b"")).decode("latin-1")
            method = path[len(SERVICE):] if path.startswith(SERVICE) else path
            if method not in ROUTED_RPCS and method != STREAM_RPC:
                return FirstCall(method)
    except (HyperframeError, hpack.HPACKError, ValueError):
        return None
    if method == STREAM_RPC and not body and not stream_message:
        return FirstCall(method)  # its client has not sent its first message: no model to read
    return INCOMPLETE


def _first_message(method: str, body: bytes, ended: bool, flags: Any = ()) -> FirstCall:
    """The model and version at the start of a first call's message (``body``: its DATA so far)."""
    if len(body) >= 5:
        if body[0]:  # compressed: the acceptor cannot read it
            return FirstCall(method)
        if flags and "PADDED" in flags:  # a padded frame not whole: its padding is not known yet
            return INCOMPLETE
        end = 5 + int.from_bytes(body[1:5], "big")
        found = name_and_version(body[5:end], ended or len(body) >= end)
        if found is not None:
            return FirstCall(method, *found)
    return FirstCall(method, "", "") if ended else INCOMPLETE
