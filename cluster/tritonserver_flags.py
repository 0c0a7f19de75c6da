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

# tritonserver 2.x's flags (its command_line_parser.cc) that rayinfer does not implement. Flags
# rayinfer takes (--http-port, --log-verbose, ...) and --backend-directory (accepted, ignored:
# the backends are built in) are not here.
UNSUPPORTED_FLAGS: tuple[str, ...] = (
    # Server and logging
    "exit-timeout-secs",
    # Model repository
    "model-load-thread-count", "model-load-retry-count", "model-namespacing", "repoagent-directory",
    # HTTP
    "allow-http", "reuse-http-port", "http-header-forward-pattern",
    # gRPC
    "reuse-grpc-port", "grpc-header-forward-pattern", "grpc-infer-allocation-pool-size",
    "grpc-infer-response-compression-level", "grpc-keepalive-time", "grpc-keepalive-timeout",
    "grpc-keepalive-permit-without-calls", "grpc-http2-max-pings-without-data",
    "grpc-http2-min-recv-ping-interval-without-data", "grpc-http2-max-ping-strikes",
    "grpc-max-connection-age", "grpc-max-connection-age-grace",
    # SageMaker and Vertex AI endpoints
    "allow-sagemaker", "sagemaker-port", "sagemaker-safe-port-range", "sagemaker-thread-count",
    "allow-vertex-ai", "vertex-ai-port", "vertex-ai-thread-count", "vertex-ai-default-model",
    # Metrics and tracing
    "metrics-config", "trace-file", "trace-level", "trace-rate", "trace-count",
    "trace-log-frequency",
    # Response cache and rate limiter
    "cache-directory", "response-cache-byte-size", "rate-limit", "rate-limit-resource",
    # Memory, devices and backends
    "pinned-memory-pool-byte-size", "cuda-memory-pool-byte-size", "cuda-virtual-address-size",
    "min-supported-compute-capability", "buffer-manager-thread-count", "host-policy",
    "model-load-gpu-limit", "backend-config",
)


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
        parser.error(f"tritonserver flag {self.option_strings[0]} is not supported by {parser.prog}")


def add_unsupported_flags(parser: argparse.ArgumentParser) -> None:
    """Register every flag of :data:`UNSUPPORTED_FLAGS` on ``parser``, hidden from ``--help``."""
    for flag in UNSUPPORTED_FLAGS:
        parser.add_argument(f"--{flag}", action=UnsupportedFlagAction)
