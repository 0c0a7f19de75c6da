"""Renders the Serve config (``serve deploy``) equivalent to ``rayinfer serve`` on a repository."""

from __future__ import annotations

import os
from typing import Any

from rayinfer.cluster.settings import ServerSettings
from rayinfer.cluster.settings_values import (
    auto_complete,
    connection_limit_values,
    grpc_front,
    http_front,
    metrics_endpoint,
    replica_log_level,
    repository_folder,
    repository_source,
    response_cache_bytes,
    startup_log_settings,
    tls_settings,
)
from rayinfer.deployments.grpc_service import SERVICER_FUNCTION
from rayinfer.deployments.names import (
    OPENAI_APP,
    OPENAI_ROUTE_PREFIX,
    SERVER_APP,
    SERVER_ROUTE_PREFIX,
    model_app_name,
    model_deployment_name,
    model_route_prefix,
)
from rayinfer.deployments.replica_options import replica_count, replica_resources
from rayinfer.protocol.errors import ModelConfigError
from rayinfer.repository.object_store import is_remote
from rayinfer.repository.scanner import ModelEntry, scan_repository

MODEL_IMPORT_PATH = "rayinfer.deployments.app:build_model_app"
SERVER_IMPORT_PATH = "rayinfer.deployments.app:build_server_app"
OPENAI_IMPORT_PATH = "rayinfer.deployments.app:build_openai_app"


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
    if settings.model_hosting != "dedicated":
        raise ValueError("--model-hosting pool is for rayinfer serve: a Serve config lists one application per model "
                         "version (its models are served dedicated)")
    repository = repository_source(settings)
    if relative_paths and not is_remote(repository):
        repository = os.path.relpath(repository).replace(os.sep, "/")
    common = {
        "replica_num_cpus": settings.replica_num_cpus,
        "auto_complete": auto_complete(settings),
        "log_level": replica_log_level(settings),
        "gpu_fallback": settings.gpu_fallback == "cpu",
        "cache_size_bytes": response_cache_bytes(settings),
        "http_max_input_size": settings.http_max_input_size,
        "log_settings": startup_log_settings(settings),
        "connection_limits": connection_limit_values(settings),
        **({"gpu_fraction_per_model": settings.gpu_fraction_per_model} if settings.gpu_fraction_per_model != 1.0
           else {}),
        **({"replica_ray_metrics": True} if settings.replica_ray_metrics else {}),
        # Checked by the front and by each model replica's listener (given only when set).
        **({"http_restricted_api": list(settings.http_restricted_api)} if settings.http_restricted_api else {}),
        **({"grpc_restricted_protocol": list(settings.grpc_restricted_protocol)}
           if settings.grpc_restricted_protocol else {}),
    }
    entries = scan_repository(repository_folder(settings)) if entries is None else entries
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
            "max_inflight_requests": settings.max_inflight_requests,
            "direct_connections": settings.direct_connections,
            **({"tls": tls_settings(settings)} if tls_settings(settings) else {}),
            **({"front_on_head": True} if settings.front_on_head else {}),
            **({"front_on_every_node": True} if settings.front_on_every_node else {}),
            "model_control_mode": settings.model_control_mode,
            "repository_poll_secs": settings.repository_poll_secs,
            "gpu_wait_secs": settings.gpu_wait_secs,
            "resource_wait_secs": settings.resource_wait_secs,
            "trace_config": list(settings.trace_config),
            **common,
        },
    }]
    if settings.model_control_mode == "explicit" and "*" not in settings.load_model:
        entries = [entry for entry in entries if entry.name in settings.load_model]
    configs = {entry.name: entry for entry in entries}
    applications[0]["args"]["startup_models"] = sorted(configs)
    for model, version, is_default in served_versions(entries):
        app: dict[str, Any] = {
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
        }
        deployment = _deployment_resources(settings, configs[model], version)
        if deployment is not None:
            app["deployments"] = [{"name": model_deployment_name(model, version), **deployment}]
        applications.append(app)
    if settings.openai_api:
        applications.append({
            "name": OPENAI_APP,
            "route_prefix": OPENAI_ROUTE_PREFIX,
            "import_path": OPENAI_IMPORT_PATH,
            "args": {
                "default_max_tokens": settings.openai_default_max_tokens,
                "max_choices": settings.openai_max_choices,
                "max_embedding_inputs": settings.openai_max_embedding_inputs,
                "max_ongoing_requests": settings.max_inflight_requests,
                "http_max_input_size": settings.http_max_input_size,
                **({"http_restricted_api": list(settings.http_restricted_api)} if settings.http_restricted_api else {}),
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


def _deployment_resources(settings: ServerSettings, entry: ModelEntry, version: int) -> dict[str, Any] | None:
    """The replicas and Ray resources of a model version, as Serve's config writes them (the
    application builds the same from the instance groups; edit these to override them). A
    KIND_AUTO group is rendered as GPU replicas when --num-gpus says the cluster has GPUs and the
    model's backend, as installed here, can use one. None
    when the instance groups cannot be served (the application reports why when deployed)."""
    try:
        replicas, options = replica_resources(entry, version, settings.replica_num_cpus,
                                              cluster_has_gpus=bool(settings.num_gpus),
                                              gpu_fallback=settings.gpu_fallback == "cpu",
                                              gpu_fraction=settings.gpu_fraction_per_model,
                                              ray_metrics=settings.replica_ray_metrics)
        count = replica_count(entry, replicas)
    except ModelConfigError:
        return None
    return {**count, "ray_actor_options": options}


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
        "summary_quantiles": list(metrics.summary_quantiles), "counter_latencies": metrics.counter_latencies,
        "histogram_latencies": metrics.histogram_latencies,
    }
