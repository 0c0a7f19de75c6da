"""Deployment handles to the replicas of a model version, wherever it is hosted.

A route names a model version as ``(application, deployment)``: its own application and
deployment, or, for a pooled version (:mod:`pool`), its application name and the pool's
deployment. The pool's replicas are reached through the pool's handle with the version's
application name as Serve's multiplexed model id, which the pool replica reads to pick the
hosted model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ray import serve

from rayinfer.deployments.names import POOL_APP, POOL_DEPLOYMENT


def model_handle(route: tuple[str, str], new: Callable[[str, str], Any] | None = None) -> Any:
    """A deployment handle whose calls reach a replica serving ``route``; ``new(app,
    deployment)`` makes the handle (default: the replica's shared one)."""
    app, deployment = route
    make = new or (lambda a, d: serve.get_deployment_handle(d, a))
    if deployment == POOL_DEPLOYMENT:
        return make(POOL_APP, POOL_DEPLOYMENT).options(multiplexed_model_id=app)
    return make(app, deployment)
