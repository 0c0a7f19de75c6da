"""Application factories: for ``rayinfer serve`` and for ``serve deploy`` config files.

``build_model_app`` and ``build_server_app`` are the ``import_path`` targets of a Serve config;
the CLI calls :func:`model_application` and :func:`server_application` directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray.serve import Application
from ray.serve.schema import LoggingConfig

from rayinfer.deployments.model import ModelDeployment
from rayinfer.deployments.names import DEFAULT_REPLICA_NUM_CPUS, model_deployment_name, parse_bool
from rayinfer.deployments.server import ServerDeployment
from rayinfer.protocol.errors import ModelConfigError
from rayinfer.protocol.metrics import MetricsOptions
from rayinfer.repository.scanner import scan_model

if TYPE_CHECKING:
    from rayinfer.deployments.control import ModelControl

# Ongoing requests a replica accepts; at least twice the largest batch so batches can fill.
MIN_ONGOING_REQUESTS = 256


def model_application(
    model_repository: str,
    model: str,
    version: int,
    is_default: bool,
    *,
    replica_num_cpus: float = DEFAULT_REPLICA_NUM_CPUS,
    auto_complete: bool = True,
    config_override: str | None = None,
) -> Application:
    """The application serving one version of one model; replicas from its ``instance_group``.

    ``config_override``: a load request's config (Triton's JSON form) used instead of config.pbtxt.
    """
    entry = scan_model(Path(model_repository) / model, config_override)
    if entry.config is None:
        raise ModelConfigError(entry.error or f"model '{model}' cannot be read")
    config = entry.config
    replicas = sum(max(group.count, 1) for group in config.instance_group) or 1
    deployment = ModelDeployment.options(
        name=model_deployment_name(model, version),
        num_replicas=replicas,
        max_ongoing_requests=max(MIN_ONGOING_REQUESTS, 2 * int(config.max_batch_size)),
        ray_actor_options={"num_cpus": replica_num_cpus},
        health_check_period_s=5.0,
        graceful_shutdown_timeout_s=10.0,
        # A per-request access log line costs more than the request's own decoding.
        logging_config=LoggingConfig(enable_access_log=False, log_level="WARNING"),
    )
    return deployment.bind(str(model_repository), model, int(version), auto_complete, config_override)


def server_application(
    model_repository: str,
    *,
    server_id: str = "triton",
    strict_readiness: bool = True,
    load_errors: dict[str, str] | None = None,
    num_cpus: float = 0.1,
    metrics: MetricsOptions | None = None,
    control: ModelControl | None = None,
    grpc_front: tuple[str, int, str, int] | None = None,
    http_front: tuple[str, int, str, int] | None = None,
    version: str | None = None,
) -> Application:
    """The ``/v2`` application: health, metadata, repository index, statistics, unknown models,
    Triton's metrics port as ``metrics`` says and the front's gRPC and HTTP ports at
    ``grpc_front`` and ``http_front`` (address, port, Serve's gRPC or HTTP host and port) when
    given.

    ``version``: the deployment's code version. ``serve.run`` gives a deployment without one a
    new random version each time, which restarts its replica; the CLI passes one version per
    launch, so that running the app again with new ``load_errors`` only reconfigures the
    replica (which keeps its metrics port and the front's routes).
    """
    deployment = ServerDeployment.options(
        num_replicas=1,
        max_ongoing_requests=MIN_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": num_cpus},
        user_config={"load_errors": load_errors or {}},
        graceful_shutdown_timeout_s=10.0,
    )
    if version is not None:
        # ``version`` left Serve's public options; the pinned Ray still takes it with ``_internal``.
        deployment = deployment.options(version=version, _internal=True)
    return deployment.bind(str(model_repository), server_id, strict_readiness, metrics, control, grpc_front, http_front)


def build_model_app(args: dict[str, Any]) -> Application:
    """Serve-config entry point; ``args``: model_repository, model, version, is_default."""
    return model_application(
        args["model_repository"],
        args["model"],
        int(args["version"]),
        bool(args.get("is_default", True)),
        replica_num_cpus=float(args.get("replica_num_cpus", DEFAULT_REPLICA_NUM_CPUS)),
        auto_complete=parse_bool(args.get("auto_complete", True)),
    )


def build_server_app(args: dict[str, Any]) -> Application:
    """Serve-config entry point; ``args``: model_repository, server_id, strict_readiness and,
    for the metrics port, metrics_address, metrics_port, metrics_interval_ms, allow_cpu_metrics and
    allow_gpu_metrics; for the front's gRPC port, grpc_address,
    grpc_port, serve_grpc_host and serve_grpc_port; for its HTTP port, http_address, http_port,
    serve_http_host and serve_http_port."""
    return server_application(
        args["model_repository"],
        server_id=str(args.get("server_id", "triton")),
        strict_readiness=parse_bool(args.get("strict_readiness", True)),
        metrics=MetricsOptions(
            str(args.get("metrics_address", "127.0.0.1")), int(args["metrics_port"]),
            int(args.get("metrics_interval_ms", 2000)),
            parse_bool(args.get("allow_cpu_metrics", True)), parse_bool(args.get("allow_gpu_metrics", True)),
        ) if args.get("metrics_port") else None,
        control=_control_from_args(args),
        grpc_front=(str(args.get("grpc_address", "127.0.0.1")), int(args["grpc_port"]),
                    str(args.get("serve_grpc_host", "127.0.0.1")), int(args["serve_grpc_port"]))
        if args.get("grpc_port") else None,
        http_front=(str(args.get("http_address", "127.0.0.1")), int(args["http_port"]),
                    str(args.get("serve_http_host", "127.0.0.1")), int(args["serve_http_port"]))
        if args.get("http_port") else None,
    )


def _control_from_args(args: dict[str, Any]) -> ModelControl:
    from rayinfer.deployments.control import ModelControl

    return ModelControl(
        mode=str(args.get("model_control_mode", "none")),
        replica_num_cpus=float(args.get("replica_num_cpus", DEFAULT_REPLICA_NUM_CPUS)),
        auto_complete=parse_bool(args.get("auto_complete", True)),
        poll_secs=float(args.get("repository_poll_secs", 15.0)),
    )
