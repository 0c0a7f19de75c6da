"""Application names and route prefixes (one Serve application per served model version), and
how a boolean is spelled in flags and Serve-config args."""

from __future__ import annotations

import string
from collections.abc import Iterable
from urllib.parse import quote, unquote

SERVER_APP = "rayinfer"
SERVER_DEPLOYMENT = "ServerDeployment"
SERVER_ROUTE_PREFIX = "/v2"
MODEL_DEPLOYMENT = "ModelDeployment"
# The pool of replicas that hosts the pooled model versions (deployments/pool.py), and what
# separates a pool replica from the model version in the key a hosted model registers under.
POOL_APP = "rayinfer-pool"
POOL_DEPLOYMENT = "PoolDeployment"
POOL_KEY_SEP = "#"
# The OpenAI-compatible API (deployments/openai_app.py).
OPENAI_APP = "openai"
OPENAI_ROUTE_PREFIX = "/v1"
# CPU reserved by each model replica: small, so many models fit on a small machine.
DEFAULT_REPLICA_NUM_CPUS = 0.1


# What Ray Serve takes in application and deployment names as they are; any other character of a
# model's name (Triton allows all but '/' and '..') is %-escaped there, '%' and '@' included.
_SERVE_SAFE = string.ascii_letters + string.digits + "-_.~!$&'()*+,;=: "


def serve_name(model: str) -> str:
    """``model`` as Ray Serve's names and route prefixes carry it (most names as they are)."""
    return quote(model, safe=_SERVE_SAFE)


def model_app_name(model: str, version: int, is_default: bool) -> str:
    """The default (highest) version is served as ``<model>``; others as ``<model>@v<N>``."""
    name = serve_name(model)
    return name if is_default else f"{name}@v{version}"


def app_model(app: str) -> str:
    """The model an application named by :func:`model_app_name` serves."""
    return unquote(app.split("@v", 1)[0])


def model_deployment_name(model: str, version: int) -> str:
    """The Serve deployment inside a model version's application."""
    return f"{serve_name(model)}_v{version}"


def deployment_version(deployment: str) -> int:
    """The version a deployment named by :func:`model_deployment_name` serves."""
    return int(deployment.rsplit("_v", 1)[1])


def model_apps(model: str, app_names: Iterable[str]) -> list[str]:
    """The applications of ``model`` among ``app_names`` (every version, default or not)."""
    served = serve_name(model)
    return [name for name in app_names if name == served or name.startswith(f"{served}@v")]


def pool_key(replica_key: str, app: str) -> str:
    """The key a model version hosted by a pool replica registers its listener under."""
    return f"{replica_key}{POOL_KEY_SEP}{app}"


def replica_of(key: str) -> str:
    """The replica (``<application>/<replica id>``) a listener's registration key names."""
    return key.split(POOL_KEY_SEP, 1)[0]


def model_route_prefix(model: str, version: int, is_default: bool) -> str:
    """``/v2/models/<model>`` for the default version (it also answers ``.../versions/<N>``)."""
    # Serve's proxy matches the decoded path: the name as it is, but for one Ray cannot carry
    # (not ASCII; the front routes such a name to its replicas instead).
    base = f"/v2/models/{model if model.isascii() else serve_name(model)}"
    return base if is_default else f"{base}/versions/{version}"


def parse_bool(value: str | bool) -> bool:
    """A boolean flag or Serve-config arg: YAML gives a bool, a command line a string."""
    if isinstance(value, bool):
        return value
    text = value.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got '{value}'")
