"""tritonserver's flags on ``rayinfer serve`` / ``config``: parsed, turned into settings, and what they do."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from rayinfer.cluster import cli
from rayinfer.cluster.cli import build_parser, fatal_startup_failures, main, settings_from_args
from rayinfer.cluster.serve_config import render_serve_config
from rayinfer.cluster.settings import ServerSettings
from rayinfer.cluster.settings_values import auto_complete, replica_log_level
from rayinfer.cluster.tritonserver_flags import REFUSED_FLAGS, TRITONSERVER_FLAGS, UNSUPPORTED_FLAGS
from rayinfer.repository.scanner import ModelEntry

SIMPLE_CONFIG = """name: "simple"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]
"""


pytestmark = pytest.mark.usefixtures("cli_environment")


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    """One model with a config and an (empty) version folder: enough to render, nothing to load."""
    (tmp_path / "simple" / "1").mkdir(parents=True)
    (tmp_path / "simple" / "config.pbtxt").write_text(SIMPLE_CONFIG)
    return tmp_path


def settings_of(repository: Path, *flags: str, command: str = "serve") -> ServerSettings:
    return settings_from_args(build_parser().parse_args([command, "--model-repository", str(repository), *flags]))


def all_args(settings: ServerSettings) -> list[dict]:
    """The args of the /v2 app and the model apps (the OpenAI app's are tested on their own)."""
    return [app["args"] for app in render_serve_config(settings)["applications"] if app["name"] != "openai"]


def test_openai_flags_reach_the_openai_app(repository: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def openai_app(settings: ServerSettings) -> dict | None:
        apps = {app["name"]: app for app in render_serve_config(settings)["applications"]}
        return apps.get("openai")

    app = openai_app(settings_of(repository))
    assert app is not None and app["route_prefix"] == "/v1"
    assert app["args"]["default_max_tokens"] == 16 and app["args"]["max_choices"] == 16
    assert app["args"]["max_embedding_inputs"] == 256 and "http_restricted_api" not in app["args"]
    app = openai_app(settings_of(repository, "--openai-default-max-tokens", "64", "--openai-max-choices=2",
                                 "--openai-max-embedding-inputs", "8", "--http-restricted-api", "inference:k=v"))
    assert app is not None
    assert (app["args"]["default_max_tokens"], app["args"]["max_choices"], app["args"]["max_embedding_inputs"]) == (
        64, 2, 8)
    assert app["args"]["http_restricted_api"] == ["inference:k=v"]
    assert openai_app(settings_of(repository, "--openai-api=false")) is None
    line = exit_line(capsys, ["config", "--model-repository", str(repository), "--openai-max-choices", "0"])
    assert line.startswith("rayinfer: error: ") and "openai" in line.replace("-", "_")


@pytest.mark.parametrize(("flags", "expected"), [
    ((), True),
    (("--strict-model-config=false",), True),
    (("--strict-model-config", "0"), True),
    (("--strict-model-config=true",), False),
    (("--strict-model-config", "1"), False),
    (("--strict-model-config",), False),
    (("--disable-auto-complete-config",), False),
])
def test_strict_model_config_is_the_opposite_of_auto_complete(repository: Path, flags: tuple, expected: bool) -> None:
    settings = settings_of(repository, *flags)
    assert auto_complete(settings) is expected
    assert {args["auto_complete"] for args in all_args(settings)} == {expected}


def test_disable_auto_complete_config_wins_over_strict_model_config_false(
    repository: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As in tritonserver: the newer flag wins, with a warning."""
    with caplog.at_level(logging.WARNING):
        settings = settings_of(repository, "--strict-model-config", "false", "--disable-auto-complete-config")
    assert auto_complete(settings) is False
    assert "--strict-model-config false is overridden" in caplog.text


@pytest.mark.parametrize(("flags", "verbose", "level"), [
    ((), 0, "WARNING"),
    (("--log-verbose", "1"), 1, "DEBUG"),
    (("--log-verbose=2",), 2, "DEBUG"),
    (("--log-verbose=0",), 0, "WARNING"),
    (("--log-verbose", "true"), 1, "DEBUG"),
    (("--log-verbose=false",), 0, "WARNING"),
])
def test_log_verbose_sets_every_replicas_log_level(repository: Path, flags: tuple, verbose: int, level: str) -> None:
    settings = settings_of(repository, *flags, command="config")
    assert settings.log_verbose == verbose
    assert replica_log_level(settings) == level
    args = all_args(settings)
    assert len(args) == 2  # the /v2 app and the model's
    assert [a["log_level"] for a in args] == [level, level]


@pytest.mark.parametrize(("flags", "expected"), [
    ((), False),  # rayinfer's default; tritonserver's is true
    (("--exit-on-error=true",), True),
    (("--exit-on-error", "1"), True),
    (("--exit-on-error",), True),
    (("--exit-on-error", "false"), False),
    (("--exit-on-error=0",), False),
])
def test_exit_on_error_flag(repository: Path, flags: tuple, expected: bool) -> None:
    assert settings_of(repository, *flags).exit_on_error is expected


def test_exit_on_error_decision(tmp_path: Path) -> None:
    """Unreadable configs and models whose replicas failed both count, and only with --exit-on-error."""
    good = ModelEntry("good", tmp_path / "good", versions=[1])
    broken = ModelEntry("broken", tmp_path / "broken", error="config.pbtxt: syntax error")
    failed = {"good": "replica died"}
    on = ServerSettings(model_repository=tmp_path, exit_on_error=True)
    off = ServerSettings(model_repository=tmp_path)
    assert fatal_startup_failures(on, [good, broken], failed) == {
        "broken": "config.pbtxt: syntax error", "good": "replica died"}
    assert fatal_startup_failures(on, [good, broken], {}) == {"broken": "config.pbtxt: syntax error"}
    assert fatal_startup_failures(on, [good], {}) == {}
    assert fatal_startup_failures(off, [good, broken], failed) == {}


def test_serve_passes_the_flags_to_the_launcher_and_exits_on_error(
    repository: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """serve() with Ray and the launcher stood in for: what reaches deploy_repository, and the exit."""
    import ray

    from rayinfer.deployments import launcher

    calls: dict[str, object] = {}
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.setdefault("ray.init", kwargs))
    monkeypatch.setattr(ray, "shutdown", lambda: calls.setdefault("ray.shutdown", True))
    monkeypatch.setattr(cli.signal, "signal", lambda *args: None)
    # The embedded Ray node's processes, which serve() stops after ray.shutdown(): stood in too
    # (this process's own children, the session server among them, are not the test's to stop).
    monkeypatch.setattr(cli, "descendants", lambda pid: [(pid, "node")])
    monkeypatch.setattr(cli, "stop_processes", lambda processes: calls.setdefault("stop_processes", processes))
    monkeypatch.setattr(launcher, "start_serve", lambda *args: None)
    monkeypatch.setattr(launcher, "stop", lambda names, whole_serve, fronts: calls.setdefault("stop", (names, whole_serve,
                                                                                                    fronts)))

    def deploy_repository(model_repository: str, versions: list, **kwargs: object) -> dict[str, str]:
        calls["deploy"] = kwargs
        return {"simple": "replica died"}

    monkeypatch.setattr(launcher, "deploy_repository", deploy_repository)
    settings = settings_of(repository, "--exit-on-error=true", "--log-verbose=1", "--http-thread-count", "3",
                           "--strict-model-config=false", "--max-inflight-requests=16")
    assert cli.serve(settings) == 1
    deployed = calls["deploy"]
    assert isinstance(deployed, dict)
    assert (deployed["log_level"], deployed["front_threads"], deployed["auto_complete"]) == ("DEBUG", 3, True)
    assert deployed["max_inflight"] == 16
    # The front is stopped by its ports, in case its /v2 replica went without stopping it.
    assert calls["stop"] == (["simple"], True, [("127.0.0.1", 8000), ("127.0.0.1", 8001)])
    assert calls["ray.shutdown"] is True
    assert calls["stop_processes"] == [(os.getpid(), "node")]
    err = capsys.readouterr().err
    assert "--exit-on-error" in err and "simple" in err


def test_http_thread_count_sets_the_front_threads(repository: Path) -> None:
    settings = settings_of(repository, "--http-thread-count=3", command="config")
    assert settings.http_thread_count == 3
    server, model = all_args(settings)
    assert server["front_threads"] == 3
    assert "front_threads" not in model
    assert all_args(settings_of(repository))[0]["front_threads"] is None  # the front's own default


def test_max_inflight_requests_reaches_the_front(repository: Path) -> None:
    server, model = all_args(settings_of(repository, "--max-inflight-requests", "32", command="config"))
    assert server["max_inflight_requests"] == 32 and "max_inflight_requests" not in model
    assert all_args(settings_of(repository))[0]["max_inflight_requests"] == 1024
    with pytest.raises(SystemExit):
        main(["config", "--model-repository", str(repository), "--max-inflight-requests", "0"])


def test_direct_connections_reach_the_front(repository: Path) -> None:
    from rayinfer.deployments.app import build_server_app

    assert all_args(settings_of(repository))[0]["direct_connections"] is True
    server, model = all_args(settings_of(repository, "--direct-connections", "false", command="config"))
    assert server["direct_connections"] is False and "direct_connections" not in model
    bound = build_server_app(server)._bound_deployment.init_args  # the Serve config's entry point
    assert bound[-3] is False  # direct_connections (then front_on_every_node, tls)


def test_tls_flags_reach_the_front(repository: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """tritonserver's gRPC TLS flags (and the same for HTTP) go to the front's HAProxy; missing
    or unreadable files are refused at start, naming the flag."""
    from rayinfer.deployments.app import build_server_app

    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_text("PEM")
    server, _ = all_args(settings_of(
        repository, "--grpc-use-ssl-mutual=true", f"--grpc-server-cert={tmp_path / 'cert.pem'}",
        f"--grpc-server-key={tmp_path / 'key.pem'}", f"--grpc-root-cert={tmp_path / 'ca.pem'}", command="config"))
    assert server["tls"] == {"grpc": {"cert": str(tmp_path / "cert.pem"), "key": str(tmp_path / "key.pem"),
                                      "root_cert": str(tmp_path / "ca.pem"), "mutual": True}}
    assert build_server_app(server)._bound_deployment.init_args[-1] == server["tls"]
    assert "tls" not in all_args(settings_of(repository))[0]
    line = exit_line(capsys, ["config", "--model-repository", str(repository), "--http-use-ssl"])
    assert "--http-use-ssl needs --http-server-cert" in line
    line = exit_line(capsys, ["config", "--model-repository", str(repository), "--grpc-use-ssl",
                              f"--grpc-server-cert={tmp_path / 'cert.pem'}", f"--grpc-server-key={tmp_path / 'none.pem'}"])
    assert f"--grpc-server-key: cannot read {tmp_path / 'none.pem'}" in line


def test_backend_directory_is_accepted_and_ignored(
    repository: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.INFO, logger="rayinfer")
    rc = main(["config", "--model-repository", str(repository), "--backend-directory", "/opt/tritonserver/backends"])
    assert rc == 0
    assert "--backend-directory /opt/tritonserver/backends ignored" in caplog.text
    assert "applications:" in capsys.readouterr().out
    without = render_serve_config(settings_of(repository))
    assert render_serve_config(settings_of(repository, "--backend-directory=/x")) == without


def exit_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI expecting a command-line error; the single stderr line it printed."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "usage:" not in captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.mark.parametrize("flag", UNSUPPORTED_FLAGS)
def test_unsupported_tritonserver_flags_answer_in_one_line(
    repository: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    expected = f"rayinfer: error: tritonserver flag --{flag} is not supported by rayinfer serve: {REFUSED_FLAGS[flag]}"
    assert exit_line(capsys, ["serve", "--model-repository", str(repository), f"--{flag}=1"]) == expected
    assert exit_line(capsys, ["serve", f"--{flag}", "1", "--model-repository", str(repository)]) == expected


def test_the_common_tritonserver_flags_are_known() -> None:
    """The flags users' manifests carry most are either taken or refused by name."""
    for flag in ("model-load-thread-count", "backend-config", "pinned-memory-pool-byte-size",
                 "cuda-memory-pool-byte-size", "trace-file", "rate-limit", "response-cache-byte-size",
                 "allow-sagemaker", "allow-vertex-ai", "model-namespacing", "buffer-manager-thread-count",
                 "min-supported-compute-capability", "grpc-keepalive-time", "reuse-http-port", "reuse-grpc-port",
                 "allow-http", "exit-timeout-secs"):
        assert flag in UNSUPPORTED_FLAGS


def test_every_tritonserver_flag_is_taken_or_refused_with_what_to_use_instead() -> None:
    serve = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]
    taken = {option[2:] for action in serve._actions for option in action.option_strings
             if option[2:] not in REFUSED_FLAGS}
    assert len(TRITONSERVER_FLAGS) == 87
    for flag in TRITONSERVER_FLAGS:
        assert flag in taken or flag in REFUSED_FLAGS, flag
        assert not (flag in taken and flag in REFUSED_FLAGS), flag
    assert all(len(reason.split()) >= 2 for reason in REFUSED_FLAGS.values())


def test_unsupported_flag_on_config_names_the_command(repository: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = exit_line(capsys, ["config", "--model-repository", str(repository), "--exit-timeout-secs", "30"])
    assert line == ("rayinfer: error: tritonserver flag --exit-timeout-secs is not supported by rayinfer config: no "
                    "counterpart: on SIGINT or SIGTERM rayinfer stops once Serve has stopped the replicas")


@pytest.mark.parametrize(("argv", "message"), [
    (["serve", "--model-repository", "{repo}", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["serve"], "the following arguments are required: --model-repository"),
    (["serve", "--model-repository", "{repo}", "--exit-on-error", "maybe"], "expected a boolean, got 'maybe'"),
    (["serve", "--model-repository", "{repo}", "--log-verbose", "lots"], "expected an integer or true/false"),
    (["serve", "--model-repository", "{repo}", "--http-thread-count", "two"], "invalid int value: 'two'"),
    (["serve", "--model-repository", "{repo}", "--http-thread-count", "0"], "--http-thread-count: Input should be"),
    (["serve", "--model-repository", "{repo}", "--model-control-mode", "sometimes"], "invalid choice: 'sometimes'"),
    (["serve", "--model-repository", "{repo}", "--log-file", "/no/such/dir/x.log"],
     "--log-file /no/such/dir/x.log: No such file or directory"),
    ([], "the following arguments are required: command"),
])
def test_other_command_line_errors_are_one_line(
    repository: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    line = exit_line(capsys, [arg.replace("{repo}", str(repository)) for arg in argv])
    assert line.startswith("rayinfer: error: ") and message in line


def test_num_cpus_is_a_whole_number(repository: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Ray passes min(cores, num_cpus) to the raylet as an integer flag: a float (2.0 on a machine
    # with more than 2 cores) made the raylet exit before it wrote a log.
    settings = settings_of(repository, "--num-cpus", "2")
    assert settings.num_cpus == 2 and type(settings.num_cpus) is int
    line = exit_line(capsys, ["serve", "--model-repository", str(repository), "--num-cpus", "2.5"])
    assert line.startswith("rayinfer: error: ") and "num-cpus" in line.replace("_", "-")


def test_cache_config_sizes_the_response_cache_of_every_model_app(repository: Path) -> None:
    settings = settings_of(repository, "--cache-config", "local,size=1048576")
    assert all(args["cache_size_bytes"] == 1048576 for args in all_args(settings))
    assert all(args["cache_size_bytes"] == 0 for args in all_args(settings_of(repository)))


@pytest.mark.parametrize("value", ["redis,host=x", "local,size=lots", "local"])
def test_a_cache_config_rayinfer_cannot_serve_is_one_line(repository: Path, capsys: pytest.CaptureFixture[str],
                                                         value: str) -> None:
    line = exit_line(capsys, ["serve", "--model-repository", str(repository), "--cache-config", value])
    assert line.startswith("rayinfer: error:") and value in line


def test_trace_config_reaches_the_server_app(repository: Path) -> None:
    flags = ("--trace-config", "triton,file=/tmp/t.json", "--trace-config", "level=TIMESTAMPS",
             "--trace-config", "rate=5")
    server_args = all_args(settings_of(repository, *flags))[0]
    assert server_args["trace_config"] == ["triton,file=/tmp/t.json", "level=TIMESTAMPS", "rate=5"]


@pytest.mark.parametrize("value", ["zipkin,url=x", "opentelemetry,colour=red", "level=LOUD", "rate=fast", "colour=red"])
def test_a_trace_config_rayinfer_cannot_serve_is_one_line(repository: Path, capsys: pytest.CaptureFixture[str],
                                                         value: str) -> None:
    line = exit_line(capsys, ["serve", "--model-repository", str(repository), "--trace-config", value])
    assert line.startswith("rayinfer: error:") and value in line
