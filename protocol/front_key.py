"""The front key: a secret of the server's own parts, shared by the whole cluster.

A model replica's listener listens on its node's address, where the front's HAProxy and other
replicas (an ensemble's steps, a sequence's requests sent on) reach it; anyone else who can reach
that address could too. Every request the server's parts send there carries the key in
:data:`FRONT_KEY_HEADER` (HAProxy's ``backend replica`` sets it, :class:`ListenerClient` sends
it), and the listener serves a request that arrived over its port only when it carries the key
(:func:`front_key_matches`); a client's connection that the front's acceptor hands it is the
client's own and needs none. One key is made per cluster, kept in Ray's key-value store
(``deployments/cluster_records.py``).
"""

from __future__ import annotations

import hmac
import json
import re
import secrets

FRONT_KEY_HEADER = b"rayinfer-front-key"
# 32 random bytes, hex: what :func:`new_front_key` makes and HAProxy's configuration may hold.
_KEY = re.compile(r"[0-9a-f]{32,128}")
FORBIDDEN_MESSAGE = (f"Forbidden: this port serves the server's own parts only (a request without a valid "
                     f"'{FRONT_KEY_HEADER.decode()}' header)")


def new_front_key() -> str:
    """A new key: 32 random bytes as hex."""
    return secrets.token_hex(32)


def is_front_key(key: str) -> bool:
    """Whether ``key`` has the form of a key (hex, safe in HAProxy's configuration and a header)."""
    return _KEY.fullmatch(key) is not None


def front_key_matches(expected: str, given: bytes | None) -> bool:
    """Whether a request's key header (``given``; None when absent) is the key ``expected``,
    compared in constant time; never while ``expected`` is not known yet ("")."""
    return bool(expected) and given is not None and hmac.compare_digest(expected.encode(), given)


def forbidden_body() -> bytes:
    """Triton's JSON error body of a request refused for its key."""
    return json.dumps({"error": FORBIDDEN_MESSAGE}, separators=(",", ":")).encode()
