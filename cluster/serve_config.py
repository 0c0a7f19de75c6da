"""Renders the Serve config (``serve deploy``) equivalent to ``rayinfer serve`` on a repository."""

from __future__ import annotations

import os
from typing import Any

from rayinfer.cluster.settings import (
    ServerSettings,
    auto_complete,
    grpc_front,
    http_front,
    metrics_endpoint,
    replica_log_level,
)
from rayinfer.deployments.grpc_service import SERVICER_FUNCTION
from rayinfer.deployments.names import (
    SERVER_APP,
    SERVER_ROUTE_PREFIX,
    model_app_name,
    model_route_prefix,
)
from rayinfer.repository.scanner import ModelEntry, scan_repository

MODEL_IMPORT_PATH = "rayinfer.deployments.app:build_model_app"
SERVER_IMPORT_PATH = "rayinfer.deployments.app:build_server_app"


def served_versions(entries: list[ModelEntry]) -> list[tuple[str, int, bool]]:
    """(model, version, is_default) for every servable version; the highest is the default."""
    out = []
    for entry in entries:
        if entry.error is None and entry.versions:
            latest = max(entry.versions)
            out.extend((entry.name, v, v == latest) for v in entry.versions)
    return out


def render_serve_config(
    settings: ServerSettings, entries: list[ModelEntry] | None = None, *, relative_paths: bool = False
) -> dict[str, Any]:
    """A ``ServeDeploySchema`` document as plain data (dump it as YAML).

    The model repository is written as an absolute path, or with ``relative_paths`` relative to
    the current directory (replicas then resolve it from their own working directory).
    """
    repository = str(settings.model_repository.resolve())
    if relative_paths:
        repository = os.path.relpath(repository).replace(os.sep, "/")
    common = {
        "replica_num_cpus": settings.replica_num_cpus,
        "auto_complete": auto_complete(settings),
        "log_level": replica_log_level(settings),
    }
    entries = scan_repository(settings.model_repository) if entries is None else entries
    applications: list[dict[str, Any]] = [{
        "name": SERVER_APP,
        "route_prefix": SERVER_ROUTE_PREFIX,
        "import_path": SERVER_IMPORT_PATH,
        "args": {
            "model_repository": repository,
            "server_id": settings.id,
            "strict_readiness": settings.strict_readiness,
            **_metrics_args(settings),
            **_front_args(settings),
            "front_threads": settings.http_thread_count,
            "model_control_mode": settings.model_control_mode,
            "repository_poll_secs": settings.repository_poll_secs,
            **common,
        },
    }]
    if settings.model_control_mode == "explicit" and "*" not in settings.load_model:
        entries = [entry for entry in entries if entry.name in settings.load_model]
    for model, version, is_default in served_versions(entries):
        applications.append({
            "name": model_app_name(model, version, is_default),
            "route_prefix": model_route_prefix(model, version, is_default),
            "import_path": MODEL_IMPORT_PATH,
            "args": {
                "model_repository": repository,
                "model": model,
                "version": version,
                "is_default": is_default,
                **common,
            },
        })
    doc: dict[str, Any] = {
        "proxy_location": "EveryNode",
        # Serve's HTTP ingress sits behind the front's HTTP port (--http-port).
        "http_options": {"host": settings.http_address, "port": settings.serve_http_port},
    }
    front = grpc_front(settings)
    if front is not None:
        doc["grpc_options"] = {"port": front[3], "grpc_servicer_functions": [SERVICER_FUNCTION]}
    doc["applications"] = applications
    return doc


def _front_args(settings: ServerSettings) -> dict[str, Any]:
    address, port, upstream_host, upstream_port = http_front(settings)
    args: dict[str, Any] = {"http_address": address, "http_port": port, "serve_http_host": upstream_host,
                            "serve_http_port": upstream_port}
    front = grpc_front(settings)
    if front is not None:
        address, port, upstream_host, upstream_port = front
        args.update(grpc_address=address, grpc_port=port, serve_grpc_host=upstream_host, serve_grpc_port=upstream_port)
    return args


def _metrics_args(settings: ServerSettings) -> dict[str, Any]:
    metrics = metrics_endpoint(settings)
    if metrics is None:
        return {}
    return {
        "metrics_address": metrics.address, "metrics_port": metrics.port,
        "metrics_interval_ms": metrics.interval_ms,
        "allow_cpu_metrics": metrics.cpu, "allow_gpu_metrics": metrics.gpu,
    }
