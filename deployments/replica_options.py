"""How model versions are deployed: the server's model control options (:class:`ModelControl`),
and what Ray and Serve give a version's replicas: how many, their resources and runtime
environment, and how many requests each takes at once (model control's and the rendered Serve
config's, :mod:`rayinfer.cluster.serve_config`, alike)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rayinfer.adapters.base import backend_uses_gpus
from rayinfer.deployments.autoscaling import serve_autoscaling_config
from rayinfer.deployments.names import DEFAULT_REPLICA_NUM_CPUS
from rayinfer.protocol.limits import DEFAULT_HTTP_MAX_INPUT_SIZE
from rayinfer.repository.autoscaling import autoscaling_spec
from rayinfer.repository.hosting import DEDICATED
from rayinfer.repository.instance_groups import replica_plan
from rayinfer.repository.scanner import ModelEntry

# Ongoing requests a replica accepts; at least twice the largest batch so batches can fill.
MIN_ONGOING_REQUESTS = 256
DEFAULT_GPU_WAIT_S = 180.0
DEFAULT_RESOURCE_WAIT_S = 180.0


@dataclass(frozen=True)
class ModelControl:
    """How models are (re)deployed: the control mode and the options of every model application."""

    mode: str = "none"  # none, poll or explicit
    replica_num_cpus: float = DEFAULT_REPLICA_NUM_CPUS
    auto_complete: bool = True
    timeout_s: float = 600.0
    poll_secs: float = 15.0
    log_level: str = "WARNING"
    # KIND_GPU groups run as CPU replicas (--gpu-fallback cpu).
    gpu_fallback: bool = False
    # How long a model waits for GPUs the cluster does not have before it is UNAVAILABLE.
    gpu_wait_s: float = DEFAULT_GPU_WAIT_S
    # The same for other resources (CPU, memory, a custom resource) the cluster does not have free.
    resource_wait_s: float = DEFAULT_RESOURCE_WAIT_S
    # The response cache's size on each node (--cache-config local,size=N); 0: no cache.
    cache_size_bytes: int = 0
    # tritonserver's --trace-config values (the trace extension's settings at start).
    trace_config: tuple[str, ...] = ()
    # tritonserver's --http-max-input-size: the largest HTTP body, decompressed, in bytes.
    max_input_size: int = DEFAULT_HTTP_MAX_INPUT_SIZE
    # The logging extension's settings at start (tritonserver's --log-* flags), as (key, value)
    # pairs; those not given keep Triton's defaults.
    log_settings: tuple[tuple[str, Any], ...] = ()
    # tritonserver's --http-restricted-api and --grpc-restricted-protocol values, which model
    # replicas check too.
    http_restricted: tuple[str, ...] = ()
    grpc_restricted: tuple[str, ...] = ()
    # The share of a GPU each model version's GPU instances reserve together (--gpu-fraction-per-model).
    gpu_fraction: float = 1.0
    # Model replicas report Ray's own metrics too (--replica-ray-metrics).
    replica_ray_metrics: bool = False
    # Limits on clients' connections to model replicas (ConnectionLimits' fields; the connection flags).
    connection_limits: tuple[tuple[str, float], ...] = ()
    # Where a model without a ``hosting`` parameter runs (--model-hosting: dedicated or pool), and
    # how many replicas the pool has (--pool-replicas), how many versions each keeps loaded
    # (--pool-max-models, 0: all) and how long a request waits for one to load again
    # (--pool-load-timeout-secs), and past how many requests per minute a busy version gets
    # another copy (--pool-scale-up-rpm, 0: never).
    hosting: str = DEDICATED
    pool_replicas: int = 1
    pool_max_models: int = 0
    pool_load_timeout_s: float = 60.0
    pool_scale_up_rpm: float = 0.0


def replica_resources(entry: ModelEntry, version: int, replica_num_cpus: float, *, cluster_has_gpus: bool,
                      gpu_fallback: bool, gpu_fraction: float = 1.0,
                      ray_metrics: bool = False) -> tuple[int, dict[str, Any]]:
    """How many replicas serve a (readable) model version and the ``ray_actor_options`` of each:
    CPUs, a share of a GPU for GPU instance groups, and (unless ``ray_metrics``) Ray's metrics
    off in the replica's process. Raises :class:`ModelConfigError` for instance groups Serve
    cannot express."""
    assert entry.config is not None
    # Triton's KIND_AUTO: GPU instances where there are GPUs and the backend can use them (an
    # ONNX model with onnxruntime's CPU build runs on CPU instances, as it would in Triton).
    auto_gpu = cluster_has_gpus and backend_uses_gpus(entry.config.backend)
    plan = replica_plan(entry.config, entry.path / "config.pbtxt", auto_gpu=auto_gpu, gpu_fallback=gpu_fallback,
                        gpu_fraction=gpu_fraction)
    options: dict[str, Any] = {"num_cpus": replica_num_cpus}
    if plan.num_gpus:
        options["num_gpus"] = plan.num_gpus
    if not ray_metrics:
        # Ray keeps the series of every process that reported metrics after it exits (in its
        # dashboard agent and Serve's processes): each reload would add a replica's (about 80).
        options["runtime_env"] = {"env_vars": dict(RAY_METRICS_OFF)}
    return plan.replicas, options


RAY_METRICS_OFF = {"RAY_enable_metrics_collection": "0"}


def with_callers_runtime_env(own: dict[str, Any], caller: dict[str, Any] | None) -> dict[str, Any]:
    """A replica's ``runtime_env`` on top of the deploying process's (``caller``), as Serve merges
    an application's with its deployments' (env vars joined, ours winning): Serve gives a
    deployment the caller's runtime_env only when the deployment sets none."""
    caller = dict(caller or {})
    env_vars = {**(caller.get("env_vars") or {}), **(own.get("env_vars") or {})}
    return {**caller, **own, **({"env_vars": env_vars} if env_vars else {})}


def replica_count(entry: ModelEntry, replicas: int) -> dict[str, Any]:
    """Serve's ``num_replicas``: the instance groups' count; or, for a model whose parameters
    ask for autoscaling, an ``autoscaling_config`` starting from that count."""
    assert entry.config is not None
    spec = autoscaling_spec(entry.config, entry.path / "config.pbtxt")
    if spec is None:
        return {"num_replicas": replicas}
    return {"autoscaling_config": serve_autoscaling_config(spec, replicas)}
