"""Where the server's front key (:mod:`rayinfer.protocol.front_key`) is kept: Ray's key-value
store (the GCS), so that every part of the server in the cluster has the same one: the model
replicas' listeners and their calls to one another, the ``/v2`` replica's front and every node's
front. The first part that asks makes it; a ``/v2`` replica started again gets the same key, so
it can take the running front over."""

from __future__ import annotations

from rayinfer.deployments.serve_internals import kv_get, kv_put
from rayinfer.protocol.front_key import is_front_key, new_front_key

_KV_NAMESPACE = "rayinfer"
_KV_KEY = b"front-key"


def cluster_front_key() -> str:
    """The cluster's front key, made and kept on the first call (blocking: a GCS round trip;
    Ray must be connected). Parts asking at once get the one that was stored first."""
    stored = kv_get(_KV_KEY, _KV_NAMESPACE)
    if stored is None:
        kv_put(_KV_KEY, new_front_key().encode(), _KV_NAMESPACE, overwrite=False)
        stored = kv_get(_KV_KEY, _KV_NAMESPACE)
    key = stored.decode() if stored is not None else ""
    if not is_front_key(key):
        raise RuntimeError("the front key in Ray's key-value store is missing or malformed")
    return key
