"""Application names and route prefixes (one Serve application per served model version), and
how a boolean is spelled in flags and Serve-config args."""

from __future__ import annotations

from collections.abc import Iterable

SERVER_APP = "rayinfer"
SERVER_DEPLOYMENT = "ServerDeployment"
SERVER_ROUTE_PREFIX = "/v2"
MODEL_DEPLOYMENT = "ModelDeployment"
# CPU reserved by each model replica: small, so many models fit on a small machine.
DEFAULT_REPLICA_NUM_CPUS = 0.1


def model_app_name(model: str, version: int, is_default: bool) -> str:
    """The default (highest) version is served as ``<model>``; others as ``<model>@v<N>``."""
    return model if is_default else f"{model}@v{version}"


def model_deployment_name(model: str, version: int) -> str:
    """The Serve deployment inside a model version's application."""
    return f"{model}_v{version}"


def deployment_version(deployment: str) -> int:
    """The version a deployment named by :func:`model_deployment_name` serves."""
    return int(deployment.rsplit("_v", 1)[1])


def model_apps(model: str, app_names: Iterable[str]) -> list[str]:
    """The applications of ``model`` among ``app_names`` (every version, default or not)."""
    return [name for name in app_names if name == model or name.startswith(f"{model}@v")]


def model_route_prefix(model: str, version: int, is_default: bool) -> str:
    """``/v2/models/<model>`` for the default version (it also answers ``.../versions/<N>``)."""
    base = f"/v2/models/{model}"
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
