"""tritonserver's flags that ``rayinfer serve`` does not take, and a parser that answers in one line.

A manifest written for tritonserver may carry flags rayinfer has no counterpart for (memory
pools, tracing, caches, ...). Each of them is registered, hidden, on the ``serve`` and
``config`` parsers and refused by name as soon as it is met, whatever value it carries; any
other command-line error is also one line on stderr, exit status 2, without argparse's usage
dump (``--help`` still prints the usage).
"""

from __future__ import annotations

import argparse
from typing import Any, NoReturn

# tritonserver 2.x's flags (its command_line_parser.cc) that rayinfer does not implement, each
# with what to use instead (or why there is nothing to set). Flags rayinfer takes (--http-port,
# --log-verbose, ...) and --backend-directory (accepted, ignored: the backends are built in) are
# not here.
_KEEPALIVE = ("use --http-keepalive-timeout (idle connections are closed, gRPC with GOAWAY) and "
              "--grpc-max-control-frames (PING floods)")
_OLD_TRACE = "tritonserver's older tracing flag: use --trace-config"
_NO_POOLS = "no counterpart: tensors live in each replica's process, and the frameworks manage GPU memory"
REFUSED_FLAGS: dict[str, str] = {
    # Server and logging
    "exit-timeout-secs": "no counterpart: on SIGINT or SIGTERM rayinfer stops once Serve has stopped the replicas",
    # Model repository
    "model-load-thread-count": "no counterpart: models load in parallel, each in replicas of its own",
    "model-load-retry-count": "no counterpart: a model that fails to load is UNAVAILABLE; load it again "
                              "through the repository API",
    "model-namespacing": "not implemented: model names must be unique in the repository",
    "repoagent-directory": "repository agents are not implemented",
    "model-config-name": "not implemented: a model's config is its config.pbtxt (or a load request's config)",
    # HTTP
    "allow-http": "the HTTP port is always served",
    "reuse-http-port": "no counterpart: the front's HAProxy owns the port",
    "http-header-forward-pattern": "not implemented: request headers are not passed to the models",
    # gRPC
    "reuse-grpc-port": "no counterpart: the front's HAProxy owns the port",
    "grpc-header-forward-pattern": "not implemented: request headers are not passed to the models",
    "grpc-infer-allocation-pool-size": "no counterpart: rayinfer's own HTTP/2 listener serves gRPC",
    "grpc-infer-response-compression-level": "not implemented",
    "grpc-keepalive-time": _KEEPALIVE,
    "grpc-keepalive-timeout": _KEEPALIVE,
    "grpc-keepalive-permit-without-calls": _KEEPALIVE,
    "grpc-http2-max-pings-without-data": _KEEPALIVE,
    "grpc-http2-min-recv-ping-interval-without-data": _KEEPALIVE,
    "grpc-http2-max-ping-strikes": _KEEPALIVE,
    "grpc-max-connection-age": "not implemented: --http-keepalive-timeout closes idle connections",
    "grpc-max-connection-age-grace": "not implemented: --http-keepalive-timeout closes idle connections",
    # SageMaker and Vertex AI endpoints
    "allow-sagemaker": "the SageMaker endpoint is not implemented",
    "sagemaker-port": "the SageMaker endpoint is not implemented",
    "sagemaker-safe-port-range": "the SageMaker endpoint is not implemented",
    "sagemaker-thread-count": "the SageMaker endpoint is not implemented",
    "allow-vertex-ai": "the Vertex AI endpoint is not implemented",
    "vertex-ai-port": "the Vertex AI endpoint is not implemented",
    "vertex-ai-thread-count": "the Vertex AI endpoint is not implemented",
    "vertex-ai-default-model": "the Vertex AI endpoint is not implemented",
    # Metrics and tracing
    "trace-file": _OLD_TRACE + " triton,file=PATH",
    "trace-level": _OLD_TRACE + " level=LEVEL",
    "trace-rate": _OLD_TRACE + " rate=N",
    "trace-count": _OLD_TRACE + " count=N",
    "trace-log-frequency": _OLD_TRACE + " triton,log-frequency=N",
    # Response cache and rate limiter
    "cache-directory": "only the local cache is built in: use --cache-config local,size=N",
    "response-cache-byte-size": "tritonserver's older cache flag: use --cache-config local,size=N",
    "rate-limit": "the rate limiter is not implemented: use --max-inflight-requests and instance counts",
    "rate-limit-resource": "the rate limiter is not implemented: use --max-inflight-requests and instance counts",
    # Memory, devices and backends
    "pinned-memory-pool-byte-size": _NO_POOLS,
    "cuda-memory-pool-byte-size": _NO_POOLS,
    "cuda-virtual-address-size": _NO_POOLS,
    "enable-peer-access": "no counterpart: Ray gives each GPU replica its GPU",
    "min-supported-compute-capability": "no counterpart: Ray gives each GPU replica its GPU",
    "buffer-manager-thread-count": "no counterpart: tensors are not copied between server and backend",
    "host-policy": "not implemented",
    "model-load-gpu-limit": "use --gpu-fraction-per-model (the share of a GPU each model version reserves)",
    "backend-config": "backend settings go in each model's config.pbtxt parameters (onnxruntime's thread "
                      "counts, for example); the Python backend's shared-memory sizes have no counterpart",
}
UNSUPPORTED_FLAGS: tuple[str, ...] = tuple(REFUSED_FLAGS)


# Every flag `tritonserver --help` lists in Triton 2.51 (without its leading --).
TRITONSERVER_FLAGS: tuple[str, ...] = tuple("""
allow-cpu-metrics allow-gpu-metrics allow-grpc allow-http allow-metrics allow-sagemaker allow-vertex-ai backend-config
backend-directory buffer-manager-thread-count cache-config cache-directory cuda-memory-pool-byte-size
cuda-virtual-address-size disable-auto-complete-config enable-peer-access exit-on-error exit-timeout-secs grpc-address
grpc-header-forward-pattern grpc-http2-max-ping-strikes grpc-http2-max-pings-without-data
grpc-http2-min-recv-ping-interval-without-data grpc-infer-allocation-pool-size grpc-infer-response-compression-level
grpc-keepalive-permit-without-calls grpc-keepalive-time grpc-keepalive-timeout grpc-max-connection-age
grpc-max-connection-age-grace grpc-port grpc-restricted-protocol grpc-root-cert grpc-server-cert grpc-server-key
grpc-use-ssl grpc-use-ssl-mutual help host-policy http-address http-header-forward-pattern http-port
http-restricted-api http-thread-count id load-model log-error log-file log-format log-info log-verbose log-warning
metrics-address metrics-config metrics-interval-ms metrics-port min-supported-compute-capability model-config-name
model-control-mode model-load-gpu-limit model-load-retry-count model-load-thread-count model-namespacing
model-repository model-store pinned-memory-pool-byte-size rate-limit rate-limit-resource repoagent-directory
repository-poll-secs response-cache-byte-size reuse-grpc-port reuse-http-port sagemaker-port sagemaker-safe-port-range
sagemaker-thread-count strict-model-config strict-readiness trace-config trace-count trace-file trace-level
trace-log-frequency trace-rate vertex-ai-default-model vertex-ai-port vertex-ai-thread-count
""".split())


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``rayinfer: error: <message>``, exit status 2.

    Subparsers are built with the same class, so the rule holds for every subcommand.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog.split()[0]}: error: {message}\n")


class UnsupportedFlagAction(argparse.Action):
    """Refuses a tritonserver flag by name the moment argparse meets it, with or without a value."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        flag = self.option_strings[0]
        parser.error(f"tritonserver flag {flag} is not supported by {parser.prog}: {REFUSED_FLAGS[flag[2:]]}")


def add_unsupported_flags(parser: argparse.ArgumentParser) -> None:
    """Register every flag of :data:`UNSUPPORTED_FLAGS` on ``parser``, hidden from ``--help``."""
    for flag in UNSUPPORTED_FLAGS:
        parser.add_argument(f"--{flag}", action=UnsupportedFlagAction)
