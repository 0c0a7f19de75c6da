"""What the server's parts take from its settings (:class:`~rayinfer.cluster.settings.ServerSettings`):
the repository as replicas and this machine see it, the front's ports and TLS, the metrics port,
the replicas' connection limits, log settings and response cache size, each derived from the
flags the same way for ``rayinfer serve`` and for a rendered Serve config."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rayinfer.cluster.settings import ServerSettings
from rayinfer.protocol.metrics import MetricsOptions, parse_metrics_config
from rayinfer.repository.object_store import local_repository
from rayinfer.serving.openai_service import OpenAIOptions
from rayinfer.serving.response_cache import parse_cache_config


def repository_source(settings: ServerSettings) -> str:
    """The repository as replicas are given it: an s3:// URL, or the folder's absolute path."""
    repository = settings.model_repository
    return repository if isinstance(repository, str) else str(repository.resolve())


def repository_folder(settings: ServerSettings) -> Path:
    """The repository on this machine: the folder, or an s3:// repository's up-to-date copy."""
    return local_repository(settings.model_repository)


def auto_complete(settings: ServerSettings) -> bool:
    """Whether missing config fields are filled from the model (tritonserver's auto-complete)."""
    return not (settings.disable_auto_complete_config or settings.strict_model_config)


def response_cache_bytes(settings: ServerSettings) -> int:
    """The response cache's size on each node, in bytes (0: no cache)."""
    return parse_cache_config(settings.cache_config)


def startup_log_settings(settings: ServerSettings) -> dict[str, Any]:
    """The logging extension's settings at start (tritonserver's --log-* flags); the log file as
    an absolute path, which every process opens from its own working directory."""
    return {"log_file": os.path.abspath(settings.log_file) if settings.log_file else "", "log_info": settings.log_info, "log_warning": settings.log_warning,
            "log_error": settings.log_error, "log_verbose_level": settings.log_verbose,
            "log_format": settings.log_format}


def replica_log_level(settings: ServerSettings) -> str:
    """Log level of the model replicas: DEBUG with --log-verbose 1 or more, else WARNING (a
    per-request log line would cost more than the request). The ``/v2`` replica logs at INFO,
    or DEBUG with --log-verbose (its lines are about loads, polls and routes, not requests)."""
    return "DEBUG" if settings.log_verbose > 0 else "WARNING"


def _serve_host(settings: ServerSettings) -> str:
    """Where the front reaches Serve's ingress on its own node."""
    return "127.0.0.1" if settings.http_address in ("0.0.0.0", "::") else settings.http_address


def http_front(settings: ServerSettings) -> tuple[str, int, str, int]:
    """(address, port, Serve's HTTP host, Serve's HTTP port) of the front's HTTP port."""
    return (settings.http_address, settings.http_port, _serve_host(settings), settings.serve_http_port)


def grpc_front(settings: ServerSettings) -> tuple[str, int, str, int] | None:
    """(address, port, Serve's gRPC host, Serve's gRPC port) of the front's gRPC port, or None."""
    if not settings.allow_grpc:
        return None
    return (settings.grpc_address or settings.http_address, settings.grpc_port, _serve_host(settings),
            settings.serve_grpc_port)


def metrics_endpoint(settings: ServerSettings) -> MetricsOptions | None:
    """The metrics port and what it samples, or None when metrics are off (port 0 as well)."""
    if not settings.allow_metrics or not settings.metrics_port:
        return None
    config = parse_metrics_config(settings.metrics_config)
    return MetricsOptions(
        settings.metrics_address or settings.http_address, settings.metrics_port, settings.metrics_interval_ms,
        settings.allow_cpu_metrics, settings.allow_gpu_metrics, config.summary_quantiles, config.counter_latencies,
        config.histogram_latencies,
    )


def connection_limit_values(settings: ServerSettings) -> dict[str, float]:
    """The model replicas' :class:`~rayinfer.protocol.limits.ConnectionLimits`, from the flags."""
    return {
        "request_head_timeout_s": settings.http_request_timeout,
        "keepalive_timeout_s": settings.http_keepalive_timeout,
        "send_timeout_s": settings.client_send_timeout,
        "connection_buffer_bytes": settings.connection_buffer_bytes,
        "max_pipelined_requests": settings.http_max_pipelined_requests,
        "max_concurrent_streams": settings.grpc_max_concurrent_streams,
        "max_header_list_bytes": settings.grpc_max_header_list_size,
        "max_reset_streams": settings.grpc_max_reset_streams,
        "max_control_frames": settings.grpc_max_control_frames,
        "stream_window_bytes": settings.grpc_stream_window,
        "connection_window_bytes": settings.grpc_connection_window,
        "replica_buffer_bytes": settings.grpc_replica_buffer,
        "max_message_bytes": settings.grpc_max_message_size,
        "stream_idle_timeout_s": settings.stream_idle_timeout,
        "max_queued_responses": settings.max_queued_responses,
        "max_connections": settings.replica_max_connections,
        "front_max_connections": settings.front_max_connections,
    }


def tls_settings(settings: ServerSettings) -> dict[str, dict[str, Any]]:
    """TLS by port kind ("grpc", "http"), as the front's TlsSettings take it; {} without TLS."""
    tls = {}
    for kind in ("grpc", "http"):
        mutual = getattr(settings, f"{kind}_use_ssl_mutual")
        if getattr(settings, f"{kind}_use_ssl") or mutual:
            root = getattr(settings, f"{kind}_root_cert")
            tls[kind] = {"cert": os.path.abspath(getattr(settings, f"{kind}_server_cert")),
                         "key": os.path.abspath(getattr(settings, f"{kind}_server_key")),
                         "root_cert": os.path.abspath(root) if root else "", "mutual": mutual}
    return tls


def openai_options(settings: ServerSettings) -> OpenAIOptions | None:
    """The OpenAI-compatible API's limits, or None when it is not served (--openai-api false)."""
    if not settings.openai_api:
        return None
    return OpenAIOptions(default_max_tokens=settings.openai_default_max_tokens,
                         max_choices=settings.openai_max_choices,
                         max_embedding_inputs=settings.openai_max_embedding_inputs)
