"""The header fields of a client's HTTP/2 request, checked as RFC 9113 (section 8.2 and 8.3)
requires before anything reads or relays them.

A request whose fields break these rules is *malformed* (section 8.1.1): its stream is reset
with PROTOCOL_ERROR and nothing of it goes further. The checks matter beyond the RFC: a
replica relays some calls to the front as HTTP/1.1 (:mod:`rayinfer.transport.client_relay`), on
connections that other clients' calls share, so a CR, LF or NUL in a name or value would let
one client write framing of its own there.

- a name is lower case and made of RFC 9110's token characters (no CR, LF, NUL, space, colon);
- a value has no CR, LF or NUL and neither starts nor ends with a space or a tab;
- pseudo-header fields: only ``:method``, ``:scheme``, ``:authority`` and ``:path``, each at most
  once, all before the regular fields; none in trailers; a request has ``:method``,
  ``:scheme`` and a non-empty ``:path``;
- connection-specific fields (``connection``, ``keep-alive``, ``proxy-connection``,
  ``transfer-encoding``, ``upgrade``) are refused, and ``te`` only carries ``trailers``.
"""

from __future__ import annotations

import re

Fields = list[tuple[bytes, bytes]]

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9a-z]+\Z")
_BAD_VALUE = re.compile(rb"[\x00\r\n]|\A[ \t]|[ \t]\Z")
REQUEST_PSEUDO_HEADERS = frozenset({b":method", b":scheme", b":authority", b":path"})
CONNECTION_SPECIFIC = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"})


class MalformedFields(ValueError):
    """A request's header fields break RFC 9113 section 8.2 or 8.3 (the message says how); its
    stream is reset with PROTOCOL_ERROR."""


def check_fields(fields: Fields) -> None:
    """Raise :class:`MalformedFields` when a field's name or value, or the order and set of the
    pseudo-header fields, breaks the rules above (those that hold for headers and trailers alike)."""
    seen: set[bytes] = set()
    regular = False
    for name, value in fields:
        if name[:1] == b":":
            if regular:
                raise MalformedFields(f"pseudo-header field {_shown(name)} after a regular field")
            if name not in REQUEST_PSEUDO_HEADERS:
                raise MalformedFields(f"unknown pseudo-header field {_shown(name)}")
            if name in seen:
                raise MalformedFields(f"pseudo-header field {_shown(name)} twice")
            seen.add(name)
        else:
            regular = True
            if not _TOKEN.match(name):
                raise MalformedFields(f"field name {_shown(name)} is not a lower-case token")
            if name in CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
                raise MalformedFields(f"connection-specific field {_shown(name)}")
        if _BAD_VALUE.search(value):
            raise MalformedFields(f"the value of {_shown(name)} holds CR, LF or NUL, or starts or ends with "
                                  "white space")


def check_request(fields: Fields) -> None:
    """Raise :class:`MalformedFields` unless a request's header block (checked by
    :func:`check_fields`) has ``:method``, ``:scheme`` and a non-empty ``:path``."""
    present = {name: value for name, value in fields if name[:1] == b":"}
    for name in (b":method", b":scheme", b":path"):
        if not present.get(name):
            raise MalformedFields(f"a request without {name.decode()}")


def check_trailers(fields: Fields) -> None:
    """Raise :class:`MalformedFields` for a pseudo-header field in trailers."""
    for name, _ in fields:
        if name[:1] == b":":
            raise MalformedFields(f"pseudo-header field {_shown(name)} in trailers")


def _shown(name: bytes) -> str:
    return repr(name[:64].decode("latin-1"))
