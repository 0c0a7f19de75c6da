"""Application factories: for ``rayinfer serve`` and for ``serve deploy`` config files.

``build_model_app`` and ``build_server_app`` are the ``import_path`` targets of a Serve config;
the CLI calls :func:`model_application` and :func:`server_application` directly.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application
from ray.serve.schema import LoggingConfig

from rayinfer.deployments.control import model_application
from rayinfer.deployments.replica_options import (
    DEFAULT_GPU_WAIT_S,
    DEFAULT_RESOURCE_WAIT_S,
    MIN_ONGOING_REQUESTS,
    ModelControl,
)
from rayinfer.deployments.control_channel import MAX_POLLING_REPLICAS
from rayinfer.deployments.names import DEFAULT_REPLICA_NUM_CPUS, parse_bool
from rayinfer.deployments.openai_app import OpenAIDeployment
from rayinfer.deployments.serve_internals import ray_version_problem, with_code_version
from rayinfer.deployments.server import ServerDeployment
from rayinfer.protocol.limits import DEFAULT_HTTP_MAX_INPUT_SIZE
from rayinfer.protocol.metrics import MetricsOptions
from rayinfer.serving.openai_service import OpenAIOptions

# Every Ray head node has this resource (1 unit), and no other node.
HEAD_NODE_RESOURCE = "node:__internal_head__"

__all__ = ["build_model_app", "build_openai_app", "build_server_app", "model_application", "openai_application",
           "server_application"]


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
    front_threads: int | None = None,
    max_inflight: int | None = None,
    launch: str | None = None,
    startup_models: list[str] | None = None,
    http_restricted: list[str] | None = None,
    grpc_restricted: list[str] | None = None,
    front_on_head: bool = False,
    direct_connections: bool = True,
    front_on_every_node: bool = False,
    tls: dict[str, dict[str, Any]] | None = None,
) -> Application:
    """The ``/v2`` application: health, metadata, repository index, statistics, unknown models,
    Triton's metrics port as ``metrics`` says and the front's gRPC and HTTP ports at
    ``grpc_front`` and ``http_front`` (address, port, Serve's gRPC or HTTP host and port) when
    given, with ``front_threads`` HAProxy threads (default: half the cores, 1 to 4) relaying at most
    ``max_inflight`` calls to model replicas at once (--max-inflight-requests).

    ``launch``: the ``rayinfer serve`` run deploying it, which tells the replica when its start
    ended (:meth:`ServerDeployment.startup_ended`); none for a Serve config. ``startup_models``: the
    models the server loads at start; it is not ready before each is served or failed.
    ``load_errors``: those of them that could not be read, with the reason.
    ``http_restricted`` / ``grpc_restricted``: the values of --http-restricted-api and
    --grpc-restricted-protocol (the front enforces them). ``front_on_head``: place the replica,
    and so the front's ports, on the Ray head node (Ray's ``node:__internal_head__`` resource),
    where a Kubernetes service or ``ray attach -p`` finds them. ``direct_connections``: HTTP
    and gRPC connections go straight to a model's replica (--direct-connections, :mod:`acceptor`).
    ``front_on_every_node``: the front's ports on every node with model replicas too
    (:mod:`node_fronts`). ``tls``: TLS on the front's ports by kind ("grpc", "http"; the
    fields of :class:`~rayinfer.transport.front_config.TlsSettings`).
    """
    control = control or ModelControl()
    deployment = ServerDeployment.options(
        num_replicas=1,
        max_ongoing_requests=MIN_ONGOING_REQUESTS + MAX_POLLING_REPLICAS,  # a control_poll per model replica
        ray_actor_options={"num_cpus": num_cpus, **({"resources": {HEAD_NODE_RESOURCE: 0.001}} if front_on_head else {})},
        graceful_shutdown_timeout_s=10.0,
        graceful_shutdown_wait_loop_s=0.2,
        logging_config=LoggingConfig(log_level="DEBUG" if control.log_level == "DEBUG" else "INFO"),
    )
    return deployment.bind(
        str(model_repository), server_id, strict_readiness, metrics, control, grpc_front, http_front, front_threads,
        list(http_restricted or ()), list(grpc_restricted or ()), max_inflight, direct_connections,
        front_on_every_node, dict(tls or {}),
        startup_models=sorted(startup_models or ()), load_errors=dict(load_errors or {}), launch=launch,
    )


def openai_application(options: OpenAIOptions, *, num_cpus: float = 0.1, max_ongoing_requests: int = 1024,
                       max_input_size: int = DEFAULT_HTTP_MAX_INPUT_SIZE, http_restricted: list[str] | None = None,
                       version: str | None = None) -> Application:
    """The ``/v1`` application: the OpenAI-compatible API (:mod:`openai_app`), one replica taking
    at most ``max_ongoing_requests`` requests at once (--max-inflight-requests; Serve's ingress
    queues as many more, then answers 503), bodies of at most ``max_input_size`` bytes
    (--http-max-input-size)."""
    deployment = OpenAIDeployment.options(
        num_replicas=1,
        max_ongoing_requests=max_ongoing_requests,
        max_queued_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": num_cpus},
        graceful_shutdown_timeout_s=10.0,
        graceful_shutdown_wait_loop_s=0.2,
    )
    if version is not None:
        deployment = with_code_version(deployment, version)
    return deployment.bind(options, max_input_size, list(http_restricted or ()))


def build_openai_app(args: dict[str, Any]) -> Application:
    """Serve-config entry point; ``args``: default_max_tokens, max_choices, max_embedding_inputs,
    and optionally max_ongoing_requests, http_max_input_size, http_restricted_api."""
    return openai_application(
        OpenAIOptions(default_max_tokens=int(args.get("default_max_tokens", 16)),
                      max_choices=int(args.get("max_choices", 16)),
                      max_embedding_inputs=int(args.get("max_embedding_inputs", 256))),
        max_ongoing_requests=int(args.get("max_ongoing_requests", 1024)),
        max_input_size=int(args.get("http_max_input_size", DEFAULT_HTTP_MAX_INPUT_SIZE)),
        http_restricted=[str(v) for v in args.get("http_restricted_api") or ()],
    )


def gpu_fraction_arg(args: dict[str, Any]) -> float:
    """``gpu_fraction_per_model`` of a Serve config's args: a share of one GPU (0 < F <= 1)."""
    fraction = float(args.get("gpu_fraction_per_model", 1.0))
    if not 0 < fraction <= 1:
        raise ValueError(f"gpu_fraction_per_model must be above 0 and at most 1, not {fraction}")
    return fraction


def build_model_app(args: dict[str, Any]) -> Application:
    """Serve-config entry point; ``args``: model_repository, model, version, is_default and
    optionally replica_num_cpus, auto_complete, log_level, gpu_fallback, gpu_fraction_per_model, replica_ray_metrics,
    cache_size_bytes,
    http_max_input_size, log_settings, connection_limits, http_restricted_api, grpc_restricted_protocol."""
    return model_application(
        args["model_repository"],
        args["model"],
        int(args["version"]),
        bool(args.get("is_default", True)),
        replica_num_cpus=float(args.get("replica_num_cpus", DEFAULT_REPLICA_NUM_CPUS)),
        auto_complete=parse_bool(args.get("auto_complete", True)),
        log_level=str(args.get("log_level", "WARNING")),
        gpu_fallback=parse_bool(args.get("gpu_fallback", False)),
        gpu_fraction=gpu_fraction_arg(args),
        ray_metrics=parse_bool(args.get("replica_ray_metrics", False)),
        cache_size_bytes=int(args.get("cache_size_bytes", 0)),
        max_input_size=int(args.get("http_max_input_size", DEFAULT_HTTP_MAX_INPUT_SIZE)),
        log_settings=dict(args.get("log_settings") or {}),
        http_restricted=[str(v) for v in args.get("http_restricted_api") or ()],
        grpc_restricted=[str(v) for v in args.get("grpc_restricted_protocol") or ()],
    )


def build_server_app(args: dict[str, Any]) -> Application:
    """Serve-config entry point; ``args``: model_repository, server_id, strict_readiness and,
    for the metrics port, metrics_address, metrics_port, metrics_interval_ms, allow_cpu_metrics,
    allow_gpu_metrics, summary_quantiles, counter_latencies and histogram_latencies; for the front's gRPC port, grpc_address,
    grpc_port, serve_grpc_host and serve_grpc_port; for its HTTP port, http_address, http_port,
    serve_http_host and serve_http_port; front_threads; max_inflight_requests; direct_connections; front_on_head; front_on_every_node; and model
    control's args
    (:func:`_control_from_args`)."""
    problem = ray_version_problem()
    if problem is not None:  # Serve reports it as the deployment's error
        raise RuntimeError(problem)
    return server_application(
        args["model_repository"],
        server_id=str(args.get("server_id", "triton")),
        strict_readiness=parse_bool(args.get("strict_readiness", True)),
        metrics=MetricsOptions(
            str(args.get("metrics_address", "127.0.0.1")), int(args["metrics_port"]),
            int(args.get("metrics_interval_ms", 2000)),
            parse_bool(args.get("allow_cpu_metrics", True)), parse_bool(args.get("allow_gpu_metrics", True)),
            tuple(float(q) for q in args.get("summary_quantiles", ())),
            parse_bool(args.get("counter_latencies", True)),
            parse_bool(args.get("histogram_latencies", False)),
        ) if args.get("metrics_port") else None,
        control=_control_from_args(args),
        grpc_front=(str(args.get("grpc_address", "127.0.0.1")), int(args["grpc_port"]),
                    str(args.get("serve_grpc_host", "127.0.0.1")), int(args["serve_grpc_port"]))
        if args.get("grpc_port") else None,
        http_front=(str(args.get("http_address", "127.0.0.1")), int(args["http_port"]),
                    str(args.get("serve_http_host", "127.0.0.1")), int(args["serve_http_port"]))
        if args.get("http_port") else None,
        front_threads=int(args["front_threads"]) if args.get("front_threads") else None,
        max_inflight=int(args["max_inflight_requests"]) if args.get("max_inflight_requests") else None,
        startup_models=[str(m) for m in args.get("startup_models") or ()],
        http_restricted=[str(v) for v in args.get("http_restricted_api") or ()],
        grpc_restricted=[str(v) for v in args.get("grpc_restricted_protocol") or ()],
        front_on_head=parse_bool(args.get("front_on_head", False)),
        direct_connections=parse_bool(args.get("direct_connections", True)),
        front_on_every_node=parse_bool(args.get("front_on_every_node", False)),
        tls={str(kind): dict(value) for kind, value in dict(args.get("tls") or {}).items()},
    )


def _control_from_args(args: dict[str, Any]) -> ModelControl:
    """model_control_mode, replica_num_cpus, auto_complete, repository_poll_secs, log_level,
    gpu_fallback, gpu_wait_secs, resource_wait_secs, gpu_fraction_per_model, replica_ray_metrics, cache_size_bytes, trace_config,
    http_max_input_size, log_settings, connection_limits, http_restricted_api, grpc_restricted_protocol."""
    return ModelControl(
        mode=str(args.get("model_control_mode", "none")),
        replica_num_cpus=float(args.get("replica_num_cpus", DEFAULT_REPLICA_NUM_CPUS)),
        auto_complete=parse_bool(args.get("auto_complete", True)),
        poll_secs=float(args.get("repository_poll_secs", 15.0)),
        log_level=str(args.get("log_level", "WARNING")),
        gpu_fallback=parse_bool(args.get("gpu_fallback", False)),
        gpu_wait_s=float(args.get("gpu_wait_secs", DEFAULT_GPU_WAIT_S)),
        resource_wait_s=float(args.get("resource_wait_secs", DEFAULT_RESOURCE_WAIT_S)),
        cache_size_bytes=int(args.get("cache_size_bytes", 0)),
        trace_config=tuple(args.get("trace_config") or ()),
        max_input_size=int(args.get("http_max_input_size", DEFAULT_HTTP_MAX_INPUT_SIZE)),
        log_settings=tuple(dict(args.get("log_settings") or {}).items()),
        connection_limits=tuple(dict(args.get("connection_limits") or {}).items()),
        http_restricted=tuple(str(v) for v in args.get("http_restricted_api") or ()),
        grpc_restricted=tuple(str(v) for v in args.get("grpc_restricted_protocol") or ()),
        gpu_fraction=gpu_fraction_arg(args),
        replica_ray_metrics=parse_bool(args.get("replica_ray_metrics", False)),
        hosting=str(args.get("model_hosting", "dedicated")),
        pool_replicas=int(args.get("pool_replicas", 1)),
        pool_max_models=int(args.get("pool_max_models", 0)),
        pool_load_timeout_s=float(args.get("pool_load_timeout_secs", 60.0)),
        pool_scale_up_rpm=float(args.get("pool_scale_up_rpm", 2000.0)),
    )
