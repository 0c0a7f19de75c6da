"""The cluster's token for the ``/v2`` replica's calls to the model replicas' listeners.

A listener answers clients (its port is on the node's network, where other nodes' fronts reach
it) and also three internal routes the ``/v2`` replica calls: new trace settings, a shared-memory
region forgotten, a sequence model's new slots. Those calls carry
:data:`~rayinfer.protocol.listener_client.INTERNAL_HEADER` with this token, kept in Ray's
internal key-value store (made by whichever replica asks first), the same for every replica of
the cluster and across ``/v2`` replica restarts; a request to those routes without it is
answered 404 like any unknown route.
"""

from __future__ import annotations

import secrets

from rayinfer.protocol.listener_client import INTERNAL_HEADER

_KEY = b"internal-token"
_NAMESPACE = "rayinfer"


def cluster_token() -> bytes:
    """The token (created if this cluster has none yet); needs a connected Ray worker."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put

    token = _internal_kv_get(_KEY, namespace=_NAMESPACE)
    if token is None:
        _internal_kv_put(_KEY, secrets.token_hex(16).encode(), overwrite=False, namespace=_NAMESPACE)
        token = _internal_kv_get(_KEY, namespace=_NAMESPACE)
    return token


def internal_headers(token: bytes) -> tuple[tuple[bytes, bytes], ...]:
    return ((INTERNAL_HEADER, token),)
