"""grpc_wire.parse_frame reads the plain DATA, HEADERS and WINDOW_UPDATE frames itself and gives
every other frame to hyperframe: for any frame of those types (any flags, stream, length and
body), both read the same fields or both refuse it."""

from __future__ import annotations

from hyperframe.exceptions import HyperframeError
from hyperframe.frame import Frame
from hypothesis import given, settings
from hypothesis import strategies as st

from rayinfer.protocol.grpc_wire import DATA, HEADERS, WINDOW_UPDATE, parse_frame


def _fields(parse) -> tuple:
    try:
        parsed = parse()
    except HyperframeError as exc:
        return ("refused", type(exc).__name__)
    return (parsed.type, parsed.stream_id, frozenset(parsed.flags), getattr(parsed, "data", b""),
            getattr(parsed, "window_increment", 0))


def _hyperframe(raw: bytes):
    view = memoryview(raw)
    parsed, length = Frame.parse_frame_header(view[:9])
    parsed.parse_body(view[9:9 + length])
    return parsed


@settings(max_examples=3000, deadline=None)
@given(kind=st.sampled_from([DATA, HEADERS, WINDOW_UPDATE, 2, 3, 4, 6, 9, 0x20]),
       flags=st.integers(0, 255), stream=st.one_of(st.integers(0, 3), st.integers(0, 2**32 - 1)),
       body=st.one_of(st.binary(max_size=12), st.sampled_from([b"\0\0\0\0", b"\x80\0\0\1", b"\x7f\xff\xff\xff",
                                                               b"\0\0\0\1", b"\x03abc", b"\x05ab"])))
def test_parse_frame_reads_what_hyperframe_reads(kind: int, flags: int, stream: int, body: bytes) -> None:
    raw = len(body).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + body
    assert _fields(lambda: parse_frame(memoryview(raw), 0, len(body))) == _fields(lambda: _hyperframe(raw))


def test_the_plain_frames_of_a_call_are_read_without_hyperframe() -> None:
    for raw, kind in ((b"\0\0\2\0\1\0\0\0\3ab", DATA), (b"\0\0\1\1\5\0\0\0\3\x82", HEADERS),
                      (b"\0\0\4\x08\0\0\0\0\0\0\0\1\0", WINDOW_UPDATE)):
        parsed = parse_frame(memoryview(raw), 0, len(raw) - 9)
        assert type(parsed).__name__ == "HotFrame" and parsed.type == kind
