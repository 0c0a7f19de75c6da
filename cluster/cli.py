"""``rayinfer``: serve a Triton model repository on Ray Serve.

    rayinfer serve --model-repository DIR [--http-port 8000] [--ray-address ADDR] ...
    rayinfer config --model-repository DIR [--relative-paths]   # the equivalent Serve config, as YAML
    rayinfer example-repository DIR                  # write the example model repository
    rayinfer ray-env                                 # exports for `ray start` on a cluster to join
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rayinfer.cluster.rollout_cli import add_rollout_parser, run_rollout
from rayinfer.cluster.settings import RAY_ENVIRONMENT, ServerSettings
from rayinfer.cluster.settings_values import (
    auto_complete,
    connection_limit_values,
    grpc_front,
    http_front,
    metrics_endpoint,
    openai_options,
    replica_log_level,
    repository_folder,
    repository_source,
    response_cache_bytes,
    startup_log_settings,
    tls_settings,
)
from rayinfer.cluster.setting_texts import setting_help
from rayinfer.cluster.processes import descendants, stop_processes
from rayinfer.cluster.tritonserver_flags import OneLineErrorParser, add_unsupported_flags
from rayinfer.deployments.names import parse_bool
from rayinfer.protocol import log_settings
from rayinfer.protocol.errors import ModelConfigError
from rayinfer.repository.ensemble import member_names
from rayinfer.repository.scanner import ModelEntry

logger = logging.getLogger("rayinfer")


def _bool(text: str) -> bool:
    try:
        return parse_bool(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _log_verbose(text: str) -> int:
    """tritonserver's --log-verbose value: a level, or true (1) / false (0)."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return int(lowered == "true")
    try:
        return int(lowered)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or true/false, got '{text}'") from None


def describe_settings_flags(parser: argparse.ArgumentParser) -> None:
    """Give every flag of a :class:`ServerSettings` field that field's description, default and
    variable as its ``--help`` text: one text, which docs/command-line.md lists too."""
    for action in parser._actions:
        if action.dest in ServerSettings.model_fields:
            action.help = setting_help(action.dest).replace("%", "%%")  # argparse formats help with %
            if action.type is _bool:
                action.metavar = "true|false"


def build_parser() -> argparse.ArgumentParser:
    """The ``rayinfer`` parser; errors are one line, exit status 2 (see ``tritonserver_flags``)."""
    parser = OneLineErrorParser(prog="rayinfer", description="Triton-compatible inference on Ray Serve")
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("serve", "config"):
        sub = commands.add_parser(name, help="start the server" if name == "serve" else "print the Serve config",
                                  usage=f"rayinfer {name} --model-repository DIR [flags]")
        sub.add_argument("--model-repository", "--model-store", required=True, metavar="DIR")
        sub.add_argument("--http-address")
        sub.add_argument("--http-port", type=int)
        sub.add_argument("--grpc-port", type=int)
        sub.add_argument("--grpc-address")
        sub.add_argument("--allow-grpc", type=_bool, nargs="?", const=True)
        sub.add_argument("--serve-grpc-port", type=int)
        sub.add_argument("--serve-http-port", type=int)
        sub.add_argument("--metrics-port", type=int)
        sub.add_argument("--metrics-address")
        sub.add_argument("--allow-metrics", type=_bool, nargs="?", const=True)
        sub.add_argument("--allow-cpu-metrics", type=_bool, nargs="?", const=True)
        sub.add_argument("--allow-gpu-metrics", type=_bool, nargs="?", const=True)
        sub.add_argument("--metrics-interval-ms", type=int)
        sub.add_argument("--model-control-mode", choices=["none", "poll", "explicit"])
        sub.add_argument("--load-model", action="append")
        sub.add_argument("--repository-poll-secs", type=float)
        sub.add_argument("--id")
        sub.add_argument("--strict-readiness", type=_bool, nargs="?", const=True)
        sub.add_argument("--disable-auto-complete-config", action="store_true", default=None)
        sub.add_argument("--strict-model-config", type=_bool, nargs="?", const=True)
        sub.add_argument("--exit-on-error", type=_bool, nargs="?", const=True)
        sub.add_argument("--http-thread-count", type=int)
        sub.add_argument("--backend-directory",
                         help="tritonserver's backend folder: accepted and ignored (rayinfer's backends are built in).")
        sub.add_argument("--log-verbose", type=_log_verbose)
        sub.add_argument("--log-info", type=_bool, nargs="?", const=True)
        sub.add_argument("--log-warning", type=_bool, nargs="?", const=True)
        sub.add_argument("--log-error", type=_bool, nargs="?", const=True)
        sub.add_argument("--log-format", choices=("default", "ISO8601"))
        sub.add_argument("--log-file")
        sub.add_argument("--ray-address")
        sub.add_argument("--num-cpus", type=int)
        sub.add_argument("--num-gpus", type=float)
        sub.add_argument("--gpu-fallback", choices=("none", "cpu"))
        sub.add_argument("--replica-ray-metrics", type=_bool, nargs="?", const=True)
        sub.add_argument("--gpu-fraction-per-model", type=float)
        sub.add_argument("--cache-config", action="append")
        sub.add_argument("--metrics-config", action="append")
        sub.add_argument("--trace-config", action="append")
        sub.add_argument("--http-restricted-api", action="append")
        sub.add_argument("--grpc-restricted-protocol", action="append")
        sub.add_argument("--http-max-input-size", type=int)
        sub.add_argument("--max-inflight-requests", type=int)
        sub.add_argument("--openai-api", type=_bool, nargs="?", const=True)
        sub.add_argument("--openai-default-max-tokens", type=int)
        sub.add_argument("--openai-max-choices", type=int)
        sub.add_argument("--openai-max-embedding-inputs", type=int)
        for kind in ("grpc", "http"):
            sub.add_argument(f"--{kind}-use-ssl", type=_bool, nargs="?", const=True)
            sub.add_argument(f"--{kind}-use-ssl-mutual", type=_bool, nargs="?", const=True)
            sub.add_argument(f"--{kind}-server-cert")
            sub.add_argument(f"--{kind}-server-key")
            sub.add_argument(f"--{kind}-root-cert")
        for flag, value_type in _CONNECTION_FLAGS:
            sub.add_argument(flag, type=value_type)
        sub.add_argument("--direct-connections", type=_bool, nargs="?", const=True)
        sub.add_argument("--front-on-head", type=_bool, nargs="?", const=True)
        sub.add_argument("--front-on-every-node", type=_bool, nargs="?", const=True)
        sub.add_argument("--gpu-wait-secs", type=float)
        sub.add_argument("--resource-wait-secs", type=float)
        sub.add_argument("--model-hosting", choices=["dedicated", "pool"])
        sub.add_argument("--pool-replicas", type=int)
        sub.add_argument("--pool-max-models", type=int)
        sub.add_argument("--pool-load-timeout-secs", type=float)
        sub.add_argument("--pool-scale-up-rpm", type=float)
        sub.add_argument("--ray-metrics-port", type=int)
        sub.add_argument("--dashboard-port", type=int)
        sub.add_argument("--dashboard-address")
        sub.add_argument("--replica-num-cpus", type=float)
        sub.add_argument("--startup-timeout-s", type=float)
        describe_settings_flags(sub)
        if name == "config":
            sub.add_argument("--relative-paths", action="store_true",
                             help="write the model repository relative to the current directory")
        add_unsupported_flags(sub)
    commands.add_parser("ray-env", help="print the Ray settings rayinfer needs, as shell exports")
    add_rollout_parser(commands)
    example = commands.add_parser("example-repository", help="write the example model repository")
    example.add_argument("directory", type=Path)
    example.add_argument("--no-extras", action="store_true",
                         help="only the models that need no extra (not the FIL, OpenVINO and TensorFlow ones)")
    return parser


# Limits on clients' connections to model replicas (ServerSettings has each one's description).
_CONNECTION_FLAGS = (
    ("--http-request-timeout", float),
    ("--http-keepalive-timeout", float),
    ("--client-send-timeout", float),
    ("--connection-buffer-bytes", int),
    ("--http-max-pipelined-requests", int),
    ("--grpc-max-concurrent-streams", int),
    ("--grpc-max-header-list-size", int),
    ("--grpc-max-reset-streams", int),
    ("--grpc-max-control-frames", int),
    ("--grpc-stream-window", int),
    ("--grpc-connection-window", int),
    ("--grpc-replica-buffer", int),
    ("--grpc-max-message-size", int),
    ("--stream-idle-timeout", float),
    ("--max-queued-responses", int),
    ("--replica-max-connections", int),
    ("--front-max-connections", int),
)


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """The settings the flags give, over RAYINFER_* variables and the defaults."""
    fields = set(ServerSettings.model_fields)
    values = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    return ServerSettings(**values)


def _settings_error(exc: ValidationError) -> str:
    """A settings error in one line, naming each bad setting by its flag."""
    return "; ".join(
        (f"--{str(error['loc'][0]).replace('_', '-')}: " if error["loc"] else "") + error["msg"]
        for error in exc.errors()
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "example-repository":
        from rayinfer.cluster.example_backends import write_backend_examples
        from rayinfer.cluster.example_repository import write_example_repository

        for path in write_example_repository(args.directory):
            print(path)
        written, skipped = ([], []) if args.no_extras else write_backend_examples(args.directory)
        for path in written:
            print(path)
        for reason in skipped:
            print(f"skipped {reason}", file=sys.stderr)
        return 0
    if args.command == "rollout":
        return run_rollout(args)
    if args.command == "ray-env":
        print("export " + " ".join(f"{key}={value}" for key, value in RAY_ENVIRONMENT.items()))
        return 0
    from rayinfer.deployments.serve_internals import ray_version_problem

    problem = ray_version_problem()
    if problem is not None:
        parser.error(problem)
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        parser.error(_settings_error(exc))
    try:
        handler = log_settings.cli_handler(startup_log_settings(settings))
    except OSError as exc:
        parser.error(f"--log-file {settings.log_file}: {exc.strerror}")
    logging.basicConfig(level=logging.DEBUG if settings.log_verbose else logging.INFO, handlers=[handler])
    if args.backend_directory is not None:
        logger.info("--backend-directory %s ignored: rayinfer's backends are built in", args.backend_directory)
    for key, value in RAY_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
    try:
        if args.command == "config":
            print(serve_config_text(settings, relative_paths=args.relative_paths), end="")
            return 0
        return serve(settings)
    except ModelConfigError as exc:  # an s3:// repository that cannot be read, for one
        print(f"error: {exc.message}", file=sys.stderr, flush=True)
        return 1


def serve_config_text(settings: ServerSettings, *, relative_paths: bool = False) -> str:
    """What ``rayinfer config`` prints: the Serve config as YAML, checked against Serve's schema."""
    import yaml

    from rayinfer.cluster.serve_config import render_serve_config
    from rayinfer.deployments.launcher import validate_serve_config

    try:
        doc = render_serve_config(settings, relative_paths=relative_paths)
    except ValueError as exc:  # what a Serve config cannot express
        raise SystemExit(f"error: {exc}") from None
    validate_serve_config(doc)
    return yaml.safe_dump(doc, sort_keys=False)


def serve(settings: ServerSettings) -> int:
    """Start (or join) Ray, deploy the repository, and run until SIGINT or SIGTERM."""
    import ray

    from rayinfer.cluster.serve_config import served_versions
    from rayinfer.deployments import launcher
    from rayinfer.repository.scanner import scan_repository

    entries = scan_repository(repository_folder(settings))
    address = settings.ray_address or os.environ.get("RAY_ADDRESS")
    stop = threading.Event()
    # While the models load, SIGINT or SIGTERM interrupts the start (and stops what started);
    # once serving, it ends the wait below.
    starting = True

    def on_signal(*_: object) -> None:
        nonlocal starting
        stop.set()
        if starting:
            starting = False
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    from rayinfer.deployments.serve_internals import stop_orphaned_serve_haproxy

    stop_orphaned_serve_haproxy()  # a Ray cluster stopped with --force left them holding Serve's ports
    if address:
        ray.init(address=address)
    else:
        ray.init(**ray_init_options(settings))
    loaded = startup_entries(settings, entries)
    versions = served_versions(loaded)
    try:
        front = grpc_front(settings)
        launcher.start_serve(settings.http_address, settings.serve_http_port, front[3] if front else None)
        failures = launcher.deploy_repository(
            repository_source(settings),
            versions,
            server_id=settings.id,
            strict_readiness=settings.strict_readiness,
            auto_complete=auto_complete(settings),
            replica_num_cpus=settings.replica_num_cpus,
            timeout_s=settings.startup_timeout_s,
            gpu_fallback=settings.gpu_fallback == "cpu",
            gpu_wait_s=settings.gpu_wait_secs,
            resource_wait_s=settings.resource_wait_secs,
            model_hosting=settings.model_hosting,
            pool_replicas=settings.pool_replicas,
            pool_max_models=settings.pool_max_models,
            pool_load_timeout_s=settings.pool_load_timeout_secs,
            pool_scale_up_rpm=settings.pool_scale_up_rpm,
            gpu_fraction=settings.gpu_fraction_per_model,
            replica_ray_metrics=settings.replica_ray_metrics,
            cache_size_bytes=response_cache_bytes(settings),
            trace_config=tuple(settings.trace_config),
            max_input_size=settings.http_max_input_size,
            connection_limits=connection_limit_values(settings),
            tls=tls_settings(settings),
            metrics=metrics_endpoint(settings),
            control_mode=settings.model_control_mode,
            poll_secs=settings.repository_poll_secs,
            grpc_front=front,
            http_front=http_front(settings),
            front_threads=settings.http_thread_count,
            max_inflight=settings.max_inflight_requests,
            openai=openai_options(settings),
            direct_connections=settings.direct_connections,
            http_restricted=settings.http_restricted_api,
            grpc_restricted=settings.grpc_restricted_protocol,
            front_on_head=settings.front_on_head,
            front_on_every_node=settings.front_on_every_node,
            log_level=replica_log_level(settings),
            log_settings=startup_log_settings(settings),
            # Models asked for whose config cannot be read count as failed loads (readiness).
            load_errors={entry.name: entry.error for entry in loaded if entry.error is not None},
        )
        _print_model_table(entries, failures, {entry.name for entry in loaded})
        fatal = fatal_startup_failures(settings, loaded, failures)
        if fatal:
            print(f"error: --exit-on-error: {len(fatal)} model(s) failed to load at start "
                  f"({', '.join(sorted(fatal))}); exiting", file=sys.stderr, flush=True)
            return 1
        starting = False
        if front is not None:
            print(f"Started GRPCInferenceService at {front[0]}:{front[1]}", flush=True)
        print(f"Started HTTPService at {settings.http_address}:{settings.http_port}", flush=True)
        metrics = metrics_endpoint(settings)
        if metrics is not None:
            print(f"Started Metrics Service at {metrics.address}:{metrics.port}", flush=True)
        if settings.dashboard_port is not None and not address:
            print(f"Ray dashboard at http://{settings.dashboard_address}:{settings.dashboard_port}", flush=True)
        stop.wait()
    except KeyboardInterrupt:
        print("Interrupted while loading the models", file=sys.stderr, flush=True)
        return 130
    finally:
        starting = False
        print("Stopping rayinfer...", flush=True)
        try:
            # On a cluster we joined, remove only our applications; Serve may host others.
            binds = [endpoint[:2] for endpoint in (http_front(settings), grpc_front(settings)) if endpoint is not None]
            launcher.stop([entry.name for entry in entries], whole_serve=not address, fronts=binds)
        finally:
            ours = [] if address else descendants(os.getpid())  # the Ray node this process started
            ray.shutdown()
            stop_processes(ours)
    return 0


def ray_init_options(settings: ServerSettings) -> dict[str, Any]:
    """``ray.init``'s arguments for the Ray node ``rayinfer serve`` starts itself. The dashboard
    binds --dashboard-address (127.0.0.1 by default), never --http-address: its Jobs API runs
    any code it is sent."""
    return {
        "num_cpus": settings.num_cpus,
        "num_gpus": settings.num_gpus,
        "include_dashboard": settings.dashboard_port is not None,
        "dashboard_host": settings.dashboard_address,
        "dashboard_port": settings.dashboard_port,
        "_node_ip_address": "127.0.0.1",
        "_metrics_export_port": settings.ray_metrics_port,
        "logging_level": logging.WARNING,
    }


def startup_entries(settings: ServerSettings, entries: list[ModelEntry]) -> list[ModelEntry]:
    """The models to load at start: all of them, or in explicit mode those named by --load-model."""
    if settings.model_control_mode != "explicit" or "*" in settings.load_model:
        return entries
    known = {entry.name for entry in entries}
    unknown = [name for name in settings.load_model if name not in known]
    if unknown:
        raise SystemExit(f"error: --load-model {unknown[0]}: no such model in {settings.model_repository}")
    by_name = {entry.name: entry for entry in entries}
    wanted: list[str] = []
    queue = list(settings.load_model)
    while queue:  # an ensemble's members load with it, as in Triton
        name = queue.pop(0)
        if name in wanted or name not in by_name:
            continue
        wanted.append(name)
        config = by_name[name].config
        queue.extend(member_names(config) if config is not None else [])
    return [entry for entry in entries if entry.name in wanted]


def fatal_startup_failures(
    settings: ServerSettings, entries: list[ModelEntry], failures: dict[str, str]
) -> dict[str, str]:
    """{model: reason} for the models that make ``rayinfer serve`` exit: with --exit-on-error,
    every model of ``entries`` (those asked for at start) whose config could not be read, and every
    model in ``failures`` (those whose replicas failed to start); without it, none."""
    if not settings.exit_on_error:
        return {}
    fatal = {entry.name: entry.error for entry in entries if entry.error is not None}
    fatal.update(failures)
    return fatal


def _print_model_table(entries: list, failures: dict[str, str], loaded: set[str]) -> None:
    rows = []
    for entry in entries:
        if entry.error is not None:
            rows.append((entry.name, "-", f"UNAVAILABLE: {entry.error}"))
        elif entry.name not in loaded:
            rows.append((entry.name, ",".join(map(str, entry.versions)), "UNAVAILABLE: unloaded"))
        elif entry.name in failures:
            rows.append((entry.name, ",".join(map(str, entry.versions)), f"UNAVAILABLE: {failures[entry.name]}"))
        else:
            rows.append((entry.name, ",".join(map(str, entry.versions)), "READY"))
    width = max([len(r[0]) for r in rows] + [5])
    print(f"{'Model':<{width}}  Version  Status", flush=True)
    for name, versions, state in rows:
        print(f"{name:<{width}}  {versions:<7}  {state}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
