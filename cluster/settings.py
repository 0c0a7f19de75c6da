"""Server settings: one pydantic-settings class, filled from CLI flags or RAYINFER_* variables."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rayinfer.deployments.names import DEFAULT_REPLICA_NUM_CPUS
from rayinfer.protocol.metrics import parse_metrics_config
from rayinfer.protocol.limits import DEFAULT_CONNECTION_LIMITS, DEFAULT_HTTP_MAX_INPUT_SIZE, DEFAULT_MAX_INFLIGHT_REQUESTS
from rayinfer.protocol.errors import ModelConfigError
from rayinfer.protocol.restricted_api import parse_restrictions
from rayinfer.repository.object_store import is_remote, parse_s3_url
from rayinfer.serving.response_cache import parse_cache_config
from rayinfer.serving.trace import settings_from_flags

logger = logging.getLogger(__name__)

# Ray Serve's high-throughput mode: HAProxy in front of replicas that receive HTTP directly.
RAY_ENVIRONMENT = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_worker_niceness": "0",
    # Serve's HAProxy checks each of its servers every 5 s (Ray's default; 250 ms once a check
    # failed), and every backend (two per model: HTTP and gRPC) lists Serve's proxy as a backup
    # server too, so the proxy took most of those checks. With the metrics timer below, checking
    # every second cost an idle server with 30 models 12% of a core more (benchmarks/idle_cpu.py).
    # They concern Serve's own ingress only: rayinfer's front sends requests to the replicas'
    # listeners.
    "RAY_SERVE_HAPROXY_HEALTH_CHECK_INTER": "5s",
    # Per-request HAProxy log lines feed ray_serve HTTP metrics through a parser actor that
    # costs as much CPU as HAProxy itself (Serve's own replicas export theirs; model replicas
    # report none of Ray's metrics unless --replica-ray-metrics).
    "RAY_SERVE_HAPROXY_METRICS_ENABLED": "0",
    # One HAProxy thread per core at most on small machines.
    "RAY_SERVE_HAPROXY_NBTHREAD": str(min(4, max(1, (os.cpu_count() or 2) // 2))),
    "RAY_USAGE_STATS_ENABLED": "0",
    # Serve's controller wakes every 0.5 s instead of 0.1 s: its periodic work stays out of the
    # latency tail on small machines, and each step of a deployment is noticed up to 0.4 s
    # later (docs/dev/benchmark-log.md has what each costs).
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    # Replicas of autoscaled models (and only those) report their requests in flight to Serve's
    # controller every second instead of every 10 s, so that a rise in load is seen in time.
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
    # Serve reloads its HAProxy whenever applications or replicas change; the old process keeps
    # the requests in flight and is stopped hard 120 s after the reload by Ray's default. A
    # model load through Serve's ingress that took 135 s (a pip environment that could not be
    # built), begun just before such a reload, lost its answer (seen once; the timing points
    # here). Loads wait up to --startup-timeout-s (600 s by default).
    "RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S": "900",
    # Serve's replicas and request routers export their cached request metrics every second
    # instead of every 100 ms. Every model replica and every router (the proxy holds one per
    # application) wakes up on that timer while idle (with the health checks above: 12% of a core
    # on an idle server with 30 models, docs/dev/benchmark-log.md). Prometheus scrapes every 10 s or more.
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    # Ray's description: the old process's idle connections are closed over this window after
    # a reload, so they move to the new process and its routes instead of staying until the
    # hard stop.
    "RAY_SERVE_HAPROXY_CLOSE_SPREAD_TIME_S": "2",
    # Serve's HAProxy reads the request heads rayinfer's front passes on (up to 16 KB: see
    # rayinfer.protocol.limits); its default 16 KB buffer takes heads up to 15 KB only, and
    # answers a larger one with an HTML page.
    "RAY_SERVE_HAPROXY_TUNE_BUFSIZE": "32768",
    # How long a stopping replica keeps taking requests from Serve's HAProxy before it refuses
    # new connections (which HAProxy then sends to another replica: retry-on conn-failure); Ray's
    # default waits 30 s. Every unload and every server stop waits it out (a stop of the example
    # repository waited it three times: Serve stopped its replicas in three waves). The front's
    # routes do not depend on it: a stopping replica withdraws its listener before it closes it.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0.5",
    # Ports of the replicas' own HTTP and gRPC servers, below Linux's ephemeral range
    # (32768-60999). Ray's default gRPC range, 40000-41000, lies inside it, which every socket
    # bound to port 0 draws from (each replica's inter-deployment gRPC server; in the embedded
    # Ray, all of Ray's own servers): a port may then serve one server and later another while
    # callers still hold the old address.
    "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "30000",
    "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "31000",
    "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": "31000",
    "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": "32000",
    # Marks v2 requests so Serve runs them without a disconnect watcher (Triton's semantics);
    # see rayinfer.deployments.ingress.
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "rayinfer.deployments.ingress:http_middlewares",
    # Serve's controller builds one replica actor class per replica name instead of one per
    # deployment, which Ray keeps in its processes for good; see rayinfer.deployments.serve_internals.
    "RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH": "rayinfer.deployments.serve_internals:reuse_replica_classes",
    # What Serve's gRPC servers (its ingress, the /v2 replica's) take in one message: the default of
    # --grpc-max-message-size, instead of gRPC's 2 GiB, for calls the front sends them.
    "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(DEFAULT_CONNECTION_LIMITS.max_message_bytes),
    # What one call between replicas carries (a Python model's BLS request, an ensemble's step, a
    # call the /v2 replica forwards): gRPC's largest message, 2 GiB - 1, instead of its 4 MiB
    # default. What a client sends is bounded where it comes in (--grpc-max-message-size,
    # --http-max-input-size); a model's own BLS tensors are bounded by this.
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31 - 1),
}


class ServerSettings(BaseSettings):
    """Everything ``rayinfer serve`` needs; flag names follow tritonserver's where they apply."""

    model_config = SettingsConfigDict(env_prefix="RAYINFER_", extra="forbid", protected_namespaces=())

    model_repository: Path | str = Field(
        description="Triton model repository to serve: a folder, or on S3 or an S3-compatible store "
        "(s3://bucket/path, s3://host:port/bucket/path, s3://https://host:port/bucket/path).",
    )
    http_address: str = Field(
        "127.0.0.1",
        description="Address HTTP binds to (HAProxy and the model replicas); use 0.0.0.0 on multi-node clusters.",
    )
    http_port: int = Field(8000, description="KServe v2 HTTP port.")
    serve_http_port: int = Field(
        9000,
        description="Port of Ray Serve's own HTTP ingress, which the front on --http-port forwards what it does "
        "not route to a model replica itself (metadata, health, the repository; on every node).",
    )
    grpc_port: int = Field(8001, description="KServe v2 / Triton gRPC port (GRPCInferenceService).")
    grpc_address: str | None = Field(None, description="Address the gRPC port binds to; default: --http-address.")
    allow_grpc: bool = Field(True, description="Serve the gRPC port.")
    serve_grpc_port: int = Field(
        9001,
        description="Port of Ray Serve's own gRPC ingress, which the gRPC front on --grpc-port forwards to "
        "(on every node; loopback is enough).",
    )
    metrics_port: int = Field(8002, description="Port of Triton's Prometheus metrics (nv_inference_*, nv_cpu_*).")
    metrics_address: str | None = Field(None, description="Address the metrics port binds to; default: --http-address.")
    allow_metrics: bool = Field(True, description="Serve the metrics port.")
    allow_cpu_metrics: bool = Field(True, description="Report nv_cpu_* figures on the metrics port.")
    allow_gpu_metrics: bool = Field(True, description="Report nv_gpu_* and nv_energy_* figures on the metrics port.")
    metrics_interval_ms: int = Field(
        2000, gt=0, description="How often CPU and GPU figures are sampled, in milliseconds."
    )
    metrics_config: list[str] = Field(
        default_factory=list,
        description="tritonserver's --metrics-config SETTING=VALUE, repeatable: summary_latencies=true adds the "
        "nv_inference_*_summary_us latency summaries (quantiles over the last minute), summary_quantiles="
        "Q:E,... picks their quantiles (default 0.5, 0.9, 0.95, 0.99, 0.999), counter_latencies=false drops the "
        "nv_inference_*_duration_us counters, histogram_latencies=true adds nv_inference_first_response_histogram_ms "
        "(time to first response; buckets from a config's model_metrics).",
    )
    model_control_mode: Literal["none", "poll", "explicit"] = Field(
        "none",
        description="none: load every model at start; poll: also load, reload and unload models as "
        "the repository changes; explicit: load only --load-model at start, then load and unload "
        "through the repository API.",
    )
    repository_poll_secs: float = Field(15.0, description="Poll mode: seconds between repository scans.", gt=0)
    load_model: list[str] = Field(
        default_factory=list, description="Explicit mode: models to load at start; '*' loads all."
    )
    id: str = Field("triton", description="Server name reported by GET /v2.")
    strict_readiness: bool = Field(
        True, description="If true, /v2/health/ready is 200 only when every model is ready."
    )
    disable_auto_complete_config: bool = Field(
        False, description="Do not fill missing config fields (inputs, outputs, max_batch_size) from the model."
    )
    strict_model_config: bool | None = Field(
        None,
        description="tritonserver's older name for the same switch: true turns auto-complete off (as "
        "--disable-auto-complete-config), false leaves it on. --disable-auto-complete-config wins when both "
        "are given, as in tritonserver.",
    )
    exit_on_error: bool = Field(
        False,
        description="Exit with a non-zero status, after stopping what it started, if a model fails to load at "
        "start (its config unreadable or its replicas failing). tritonserver's default is true; rayinfer's is "
        "false: it keeps serving the other models and reports the failed ones UNAVAILABLE.",
    )
    http_thread_count: int | None = Field(
        None,
        gt=0,
        description="Threads of the front (HAProxy's nbthread), which takes the HTTP and the gRPC port; "
        "default: half the cores of the node, 1 to 4.",
    )
    log_verbose: int = Field(
        0,
        ge=0,
        description="0: the CLI and the /v2 replica log at INFO, model replicas at WARNING; 1 or more: "
        "DEBUG in the CLI and every replica.",
    )
    log_info: bool = Field(True, description="tritonserver's --log-info: INFO lines of rayinfer and the models.")
    log_warning: bool = Field(True, description="tritonserver's --log-warning: WARNING lines.")
    log_error: bool = Field(True, description="tritonserver's --log-error: ERROR lines.")
    log_format: Literal["default", "ISO8601"] = Field(
        "default", description="tritonserver's --log-format: the lines' format (default or ISO8601)."
    )
    log_file: str = Field(
        "", description="tritonserver's --log-file: rayinfer's and the models' lines are appended to this file "
        "(on each node, by each process that logs) instead of stderr.",
    )
    ray_address: str | None = Field(
        None, description="Address of an existing Ray cluster; default: RAY_ADDRESS, else start a local Ray."
    )
    # A whole number: Ray hands min(cores, num_cpus) to the raylet as an integer flag, and a float
    # there (2.0 on a machine with more than 2 cores) stops the raylet before it logs anything.
    num_cpus: int | None = Field(None, gt=0, description="CPUs of the embedded local Ray (default: all cores).")
    num_gpus: float | None = Field(
        None,
        description="GPUs of the embedded local Ray (default: those Ray finds); on a machine without GPUs, "
        "logical GPUs for trying out placement.",
    )
    gpu_fallback: Literal["none", "cpu"] = Field(
        "none", description="cpu: run KIND_GPU instance groups as CPU replicas (development without a GPU)."
    )
    gpu_fraction_per_model: float = Field(
        1.0, gt=0, le=1,
        description="The share of a GPU one model version's GPU instances reserve together (each of N "
        "instances reserves this / N): below 1, several models share a GPU, as in Triton.",
    )
    replica_ray_metrics: bool = Field(
        False,
        description="Model replicas report Ray's own metrics (ray_serve_* and ray_* per replica) too. Off by "
        "default: Ray keeps every replica's series after the replica is gone, so each reload would grow Ray's "
        "processes; rayinfer's nv_inference_* metrics cover the replicas either way.",
    )
    cache_config: list[str] = Field(
        default_factory=list,
        description="tritonserver's --cache-config: local,size=<bytes> enables the response cache for models "
        "whose config sets response_cache { enable: true }.",
    )
    trace_config: list[str] = Field(
        default_factory=list,
        description="tritonserver's --trace-config: rate=N, level=OFF|TIMESTAMPS|TENSORS, count=N, "
        "mode=triton|opentelemetry, triton,file=PATH, triton,log-frequency=N, opentelemetry,url=URL, "
        "opentelemetry,resource=KEY=VALUE, opentelemetry,bsp_max_queue_size=N, opentelemetry,bsp_schedule_delay=MS, "
        "opentelemetry,bsp_max_export_batch_size=N (the trace extension's settings at start).",
    )
    http_restricted_api: list[str] = Field(
        default_factory=list,
        description="tritonserver's --http-restricted-api: '<group>[,<group>...]:<header>=<value>'; the groups' "
        "endpoints answer 403 to HTTP requests without that header and value.",
    )
    grpc_restricted_protocol: list[str] = Field(
        default_factory=list,
        description="tritonserver's --grpc-restricted-protocol: the same for gRPC, whose calls must carry "
        "'triton-grpc-protocol-<header>' (UNAVAILABLE otherwise).",
    )
    openai_api: bool = Field(
        True,
        description="Serve the OpenAI-compatible API under /v1 on the HTTP port (GET /v1/models, POST "
        "/v1/completions, /v1/chat/completions and /v1/embeddings) over the repository's language and embedding "
        "models; clients use base_url http://HOST:PORT/v1. Costs one Serve replica.",
    )
    openai_default_max_tokens: int = Field(
        16, ge=0, description="The OpenAI-compatible API: max_tokens of a completion or chat completion request "
        "that gives none (Triton's OpenAI frontend's --default-max-tokens).")
    openai_max_choices: int = Field(
        16, gt=0, description="The OpenAI-compatible API: the most choices one request may ask for (n times its "
        "prompts); each choice is one request to the model, all sent at once. More is refused with 400.")
    openai_max_embedding_inputs: int = Field(
        256, gt=0, description="The OpenAI-compatible API: the most texts one /v1/embeddings request may carry; "
        "more is refused with 400.")
    http_max_input_size: int = Field(
        DEFAULT_HTTP_MAX_INPUT_SIZE, gt=0, le=2**31 - 1,
        description="tritonserver's --http-max-input-size: the largest HTTP request body, in bytes, after "
        "decompression (at most 2 GiB - 1); a larger one is refused with 400 before it is read whole.",
    )
    max_inflight_requests: int = Field(
        DEFAULT_MAX_INFLIGHT_REQUESTS, gt=0, le=2**31 - 1,
        description="Inference calls (HTTP and gRPC together) in progress at once: the front relays at most this "
        "many to model replicas, and a model replica takes at most this many on the connections given straight to it "
        "(--direct-connections); one more is answered at once with 503 / UNAVAILABLE. Bounds what the replicas "
        "queue and hold.",
    )
    http_request_timeout: float = Field(
        30.0, gt=0, description="Seconds a client's connection to a model replica may take to send a request head "
        "(HTTP/1.1) or a header block (gRPC); past it the connection is closed (HTTP/1.1: 408 first). HAProxy's "
        "'timeout http-request'.")
    http_keepalive_timeout: float = Field(
        60.0, gt=0, description="Seconds a client's connection to a model replica may stay idle (no request or call "
        "open) before it is closed (gRPC: gracefully, GOAWAY); also how long a gRPC call may wait for its client's "
        "next bytes. HAProxy's 'timeout http-keep-alive'.")
    client_send_timeout: float = Field(
        60.0, gt=0, description="Seconds a client may leave its answers unread (the connection's send buffer full) "
        "before its connection is closed. HAProxy's 'timeout client'.")
    connection_buffer_bytes: int = Field(
        1 << 22, gt=0, description="Bytes of answers a model replica buffers for one client connection that does not "
        "read; past it the replica stops reading that connection until the client reads.")
    http_max_pipelined_requests: int = Field(
        16, gt=0, description="Requests a model replica reads ahead of its answers on one HTTP/1.1 connection; past "
        "it the connection is not read until answers go out.")
    grpc_max_concurrent_streams: int = Field(
        100, gt=0, le=2**31 - 1, description="HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS a model replica advertises; a call "
        "past it is refused (RST_STREAM REFUSED_STREAM).")
    grpc_max_header_list_size: int = Field(
        16384, ge=1024, le=1 << 24, description="Bytes of one gRPC call's header block (its CONTINUATION frames "
        "included, before and after HPACK decoding); a larger one closes the connection (ENHANCE_YOUR_CALM).")
    grpc_max_reset_streams: int = Field(
        200, gt=0, description="Streams a client may reset (RST_STREAM) on one connection in 10 s; one more closes "
        "the connection (ENHANCE_YOUR_CALM). Bounds 'rapid reset' (CVE-2023-44487).")
    grpc_max_control_frames: int = Field(
        1000, gt=0, description="PING, SETTINGS, PRIORITY, empty DATA and unknown frames a client may send on one "
        "connection in 10 s, beyond two WINDOW_UPDATEs and a PING for each DATA frame sent to it (a gRPC client's "
        "flow control and bandwidth probes); one more closes the connection (ENHANCE_YOUR_CALM).")
    grpc_stream_window: int = Field(
        1 << 20, ge=65535, le=2**31 - 1, description="HTTP/2 stream window: bytes a gRPC call may send before a "
        "model replica reads them (SETTINGS_INITIAL_WINDOW_SIZE).")
    grpc_connection_window: int = Field(
        1 << 26, ge=65535, le=2**31 - 1, description="Bytes the calls of one gRPC connection may hold in a model "
        "replica; past it only the connection's oldest call being received gets more window.")
    grpc_replica_buffer: int = Field(
        1 << 28, gt=0, description="Bytes the gRPC calls of all connections may hold in one model replica; past it "
        "only each connection's oldest call being received gets more window.")
    grpc_max_message_size: int = Field(
        1 << 26, ge=1024, le=2**31 - 1, description="Bytes of one gRPC message a client may send (a unary call's "
        "or one of a stream's), after decompression too; a larger one ends its call with RESOURCE_EXHAUSTED, "
        "checked while it arrives.")
    stream_idle_timeout: float = Field(
        300.0, gt=0, description="Seconds a gRPC stream (ModelStreamInfer) may stay open with no request in "
        "progress and nothing from its client; past it the stream ends (DEADLINE_EXCEEDED).")
    max_queued_responses: int = Field(
        64, gt=0, description="Responses of one stream (a gRPC stream, generate_stream, a decoupled model's) made "
        "and not yet sent to the client; past it the model's response sender waits until the client reads.")
    replica_max_connections: int = Field(
        1024, gt=0, description="Connections one model replica holds at once (clients' connections given to it, "
        "the front's and other replicas'); one more is closed at once.")
    front_max_connections: int = Field(
        4096, gt=0, description="Connections the front takes at once: HAProxy's maxconn (past it HAProxy accepts no "
        "more until some close), and the connections its acceptor holds while it waits for their first request "
        "(past it a new one is closed at once).")
    grpc_use_ssl: bool = Field(
        False, description="Serve the gRPC port over TLS, terminated by the front's HAProxy (tritonserver's "
        "--grpc-use-ssl); needs --grpc-server-cert and --grpc-server-key. Connections then go through HAProxy (no "
        "direct connections on that port).")
    grpc_use_ssl_mutual: bool = Field(
        False, description="TLS on the gRPC port with client certificates signed by --grpc-root-cert required "
        "(--grpc-use-ssl-mutual; implies --grpc-use-ssl).")
    grpc_server_cert: str | None = Field(None, description="PEM file of the gRPC port's certificate (chain).")
    grpc_server_key: str | None = Field(None, description="PEM file of the gRPC port's private key.")
    grpc_root_cert: str | None = Field(
        None, description="PEM file of the root certificate(s) that sign clients' certificates (mutual TLS on the gRPC port).")
    http_use_ssl: bool = Field(
        False, description="Serve the HTTP port over TLS, terminated by the front's HAProxy (like gRPC's; tritonserver has no HTTPS "
        "--http-use-ssl); needs --http-server-cert and --http-server-key. Connections then go through HAProxy (no "
        "direct connections on that port).")
    http_use_ssl_mutual: bool = Field(
        False, description="TLS on the HTTP port with client certificates signed by --http-root-cert required "
        "(--http-use-ssl-mutual; implies --http-use-ssl).")
    http_server_cert: str | None = Field(None, description="PEM file of the HTTP port's certificate (chain).")
    http_server_key: str | None = Field(None, description="PEM file of the HTTP port's private key.")
    http_root_cert: str | None = Field(
        None, description="PEM file of the root certificate(s) that sign clients' certificates (mutual TLS on the HTTP port).")
    direct_connections: bool = Field(
        True,
        description="Give each HTTP and gRPC connection straight to a replica on the front's machine of the model "
        "its next request (gRPC: its first call) names, which then answers its requests with no proxy in between "
        "(it relays others to the front; an HTTP connection is given back, a gRPC one takes its turn). Off: the "
        "front relays every request. Not on a port with restricted APIs (--http-restricted-api, "
        "--grpc-restricted-protocol), which the front checks on every request.",
    )
    front_on_head: bool = Field(
        False,
        description="Run the front (the HTTP, gRPC and metrics ports) on the Ray cluster's head node; "
        "by default Serve places it on any node. Needs a head node with CPUs for it.",
    )
    front_on_every_node: bool = Field(
        False,
        description="Run the front (the HTTP and gRPC ports) on every node with model replicas too, not only on "
        "the node of the /v2 replica (the metrics port stays there). Each node's front routes to the replicas "
        "of every node; use --http-address 0.0.0.0 (Serve's ingress binds it on every node too).",
    )
    gpu_wait_secs: float = Field(
        180.0, gt=0,
        description="How long a model waits for GPUs the cluster does not have free (an autoscaler may add a GPU "
        "node), counted from when Ray reports its replicas waiting (a few seconds into the load), before it is "
        "UNAVAILABLE with the missing resource as its reason.",
    )
    resource_wait_secs: float = Field(
        180.0, gt=0,
        description="How long a model waits for CPU, memory or a custom resource the cluster does not have free "
        "(every replica reserves --replica-num-cpus; an autoscaler may add a node), counted from when Ray reports "
        "its replicas waiting, before it is UNAVAILABLE with the missing resource and what to change as its "
        "reason. The wait is logged, and shown in the repository index, as soon as it is seen.",
    )
    model_hosting: Literal["dedicated", "pool"] = Field(
        "dedicated",
        description="Where a model without a 'rayinfer_hosting' parameter in its config runs: 'dedicated', replicas of its "
        "own (a process each); or 'pool', in the model pool's replicas, which hold many models in one process "
        "each. Only a model that needs nothing of its own is pooled (one CPU instance, "
        "not decoupled, not an ensemble, no pip or conda environment or autoscaling, and for a Python model no "
        "modules of its own beside model.py); the others stay dedicated. A model's 'rayinfer_hosting' parameter ('dedicated' or 'pool') overrides this.",
    )
    pool_replicas: int = Field(
        1, ge=1,
        description="How many replicas the model pool has (--model-hosting pool, or models whose 'hosting' "
        "parameter is 'pool'); each holds every pooled model and reserves --replica-num-cpus.",
    )
    pool_max_models: int = Field(
        0, ge=0,
        description="How many pooled model versions each model pool replica keeps loaded at once (0: every "
        "one). Past it, a replica unloads the least recently used version that has no request in flight; a "
        "request for a version that is not loaded loads it again and waits (--pool-load-timeout-secs). Every "
        "pooled version is loaded once when it is loaded into the server, so that a broken one fails then.",
    )
    pool_scale_up_rpm: float = Field(
        2000.0, ge=0,
        description="With several model pool replicas and --pool-max-models, a pooled model version gets one more "
        "loaded copy (on the pool replica holding fewest versions) for every this many requests per minute it "
        "receives, over the last 10 s, as ModelMesh's scaleup_rpm_threshold; the front and Serve's router then "
        "spread its requests over its copies. 0: a version is loaded only where a request asks for it.",
    )
    pool_load_timeout_secs: float = Field(
        60.0, gt=0,
        description="How long a request for a pooled model version that its pool replica does not hold "
        "(--pool-max-models) waits for the version to load before it fails UNAVAILABLE.",
    )
    dashboard_port: int | None = Field(
        None,
        description="Start the embedded Ray's dashboard on this port (Ray's default is 8265), bound to "
        "--dashboard-address; default: no dashboard (it costs CPU on small machines).",
    )
    dashboard_address: str = Field(
        "127.0.0.1",
        description="Address the embedded Ray's dashboard (--dashboard-port) binds. Its Jobs API runs "
        "whatever code it is sent, so exposing the dashboard exposes the whole cluster: keep it on "
        "127.0.0.1 (or a private network) unless a proxy that authenticates stands in front of it.",
    )
    ray_metrics_port: int | None = Field(
        None,
        description="Port of the embedded Ray's own Prometheus metrics (ray_serve_*, ray_*); default: a free port.",
    )
    replica_num_cpus: float = Field(
        DEFAULT_REPLICA_NUM_CPUS,
        description="num_cpus reserved by each KIND_CPU model replica; fractional on small machines.",
    )
    startup_timeout_s: float = Field(600.0, description="How long to wait for models to finish loading.")

    @field_validator("model_repository", mode="before")
    @classmethod
    def _repository_folder_or_url(cls, value: Path | str) -> Path | str:
        if is_remote(value):
            try:
                parse_s3_url(str(value))
            except ModelConfigError as exc:
                raise ValueError(exc.message) from None
            return str(value)
        return Path(value)

    @field_validator("cache_config")
    @classmethod
    def _parse_cache_config(cls, values: list[str]) -> list[str]:
        parse_cache_config(values)  # ValueError naming the value
        return values

    @field_validator("http_restricted_api", "grpc_restricted_protocol")
    @classmethod
    def _parse_restrictions(cls, values: list[str], info: ValidationInfo) -> list[str]:
        parse_restrictions(values, "--" + str(info.field_name).replace("_", "-"))  # ValueError naming the value
        return values

    @field_validator("metrics_config")
    @classmethod
    def _parse_metrics_config(cls, values: list[str]) -> list[str]:
        parse_metrics_config(values)  # ValueError naming the value
        return values

    @field_validator("trace_config")
    @classmethod
    def _parse_trace_config(cls, values: list[str]) -> list[str]:
        settings_from_flags(values)  # ValueError naming the value
        # A relative trace file is relative to where the command runs, not to Ray's workers.
        return [f"triton,file={os.path.abspath(v.split('=', 1)[1])}"
                if v.startswith("triton,file=") and v.split("=", 1)[1] else v for v in values]

    @model_validator(mode="after")
    def _check_tls_files(self) -> ServerSettings:
        for kind in ("grpc", "http"):
            if not (getattr(self, f"{kind}_use_ssl") or getattr(self, f"{kind}_use_ssl_mutual")):
                continue
            needed = ["server_cert", "server_key"] + (["root_cert"] if getattr(self, f"{kind}_use_ssl_mutual") else [])
            for name in needed:
                path = getattr(self, f"{kind}_{name}")
                flag = f"--{kind}-{name.replace('_', '-')}"
                if not path:
                    raise ValueError(f"--{kind}-use-ssl needs {flag}")
                if not os.access(path, os.R_OK):
                    raise ValueError(f"{flag}: cannot read {path}")
        return self

    @model_validator(mode="after")
    def _warn_on_overridden_strict_model_config(self) -> ServerSettings:
        if self.disable_auto_complete_config and self.strict_model_config is False:
            logger.warning("--strict-model-config false is overridden by --disable-auto-complete-config")
        return self
