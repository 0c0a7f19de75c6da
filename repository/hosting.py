"""Where a model version runs: replicas of its own (dedicated) or a pool shared with other models.

A model chooses with its config's ``rayinfer_hosting`` parameter::

    parameters { key: "rayinfer_hosting" value: { string_value: "pool" } }

and without one takes the server's ``--model-hosting`` (``dedicated`` by default). A pool
replica holds many models in one process, so a model is pooled only when it needs nothing a
shared process cannot give it: one CPU instance (the pool's replicas are its instances), no
GPU, not decoupled, not an ensemble (its
steps call other models), no pip or conda environment of its own and no autoscaling of its own.
A Python model is pooled only when its folders hold no modules of its own besides ``model.py``:
the pool's models share one interpreter's ``sys.modules``, where two models' ``utils.py`` would
be one module. A sequence model is pooled like any other: the pool never unloads it while it
holds an open sequence (``--pool-max-models`` may be exceeded meanwhile). A model that asks for
the pool and cannot have it fails to load with the reason; one that only inherits the server's
choice is served dedicated.
"""

from __future__ import annotations

from pathlib import Path

from rayinfer.protocol.errors import ModelConfigError
from rayinfer.repository.autoscaling import PREFIX as AUTOSCALING_PREFIX
from rayinfer.repository.ensemble import is_ensemble
from rayinfer.repository.instance_groups import ReplicaPlan
from rayinfer.repository.model_config import ModelConfig
from rayinfer.repository.python_env import ENV_PARAMETER, PIP_PARAMETER, model_requirements, own_modules

HOSTING_PARAMETER = "rayinfer_hosting"
DEDICATED = "dedicated"
POOL = "pool"
HOSTINGS = (DEDICATED, POOL)


def pool_obstacle(config: ModelConfig, plan: ReplicaPlan, folder: Path, version: int) -> str | None:
    """Why the model (in ``folder``, at ``version``) cannot share a pool's replicas (None when it can)."""
    if is_ensemble(config):
        return "it is an ensemble"
    if config.backend == "python":
        obstacle = _python_obstacle(config, folder, version)
        if obstacle is not None:
            return obstacle
    if config.model_transaction_policy.decoupled:
        return "it is decoupled"
    if plan.kind != "KIND_CPU":
        return "it has GPU instances"
    if plan.replicas != 1:
        return f"it has {plan.replicas} instances (a pool's replicas are every pooled model's instances)"
    if PIP_PARAMETER in config.parameters:
        return f"it has its own pip environment ('{PIP_PARAMETER}')"
    if any(key.startswith(AUTOSCALING_PREFIX) for key in config.parameters):
        return "it has autoscaling parameters"
    return None


def _python_obstacle(config: ModelConfig, folder: Path, version: int) -> str | None:
    if ENV_PARAMETER in config.parameters:
        return f"it has its own execution environment ('{ENV_PARAMETER}')"
    if model_requirements(folder, version, config):
        return "it has requirements of its own (requirements.txt)"
    model_file = folder / str(version) / (config.default_model_filename or "model.py")
    for where in (model_file.parent, folder):
        if own_modules(where, model_file):
            return (f"its folder {where} holds Python modules besides {model_file.name} (the pool's models share "
                    "one interpreter's modules)")
    return None


def model_hosting(config: ModelConfig, path: Path, plan: ReplicaPlan, server_hosting: str, version: int) -> str:
    """``dedicated`` or ``pool`` for a (defaults-filled) config at ``path`` (the model's
    ``config.pbtxt``), at ``version``: its ``rayinfer_hosting`` parameter, else
    ``server_hosting`` (--model-hosting) where the model can be pooled.
    :class:`ModelConfigError` naming the file for an unknown value, or for a model that asks
    for the pool and cannot be pooled."""
    asked = config.parameters.get(HOSTING_PARAMETER)
    if asked is None:
        if server_hosting == POOL and pool_obstacle(config, plan, path.parent, version) is None:
            return POOL
        return DEDICATED
    value = asked.string_value.strip().lower()
    if value not in HOSTINGS:
        raise ModelConfigError(f"{path}: parameter '{HOSTING_PARAMETER}' must be one of {', '.join(HOSTINGS)}, "
                               f"got '{asked.string_value}'")
    if value == POOL:
        obstacle = pool_obstacle(config, plan, path.parent, version)
        if obstacle is not None:
            raise ModelConfigError(f"{path}: parameter '{HOSTING_PARAMETER}' asks for the pool, but {obstacle}; "
                                   f"serve it '{DEDICATED}'")
    return value
