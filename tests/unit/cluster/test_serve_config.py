"""The Serve config rendered for a repository, and settings built from CLI flags."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from rayinfer.adapters.base import backend_uses_gpus
from rayinfer.cluster.cli import build_parser, settings_from_args
from rayinfer.cluster.example_repository import write_example_repository, write_python_model
from rayinfer.cluster.serve_config import render_serve_config, served_versions
from rayinfer.cluster.settings import ServerSettings
from rayinfer.protocol.metrics import MetricsOptions
from rayinfer.repository.scanner import scan_repository


@pytest.fixture(scope="module")
def example_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    write_example_repository(root)
    return root


pytestmark = pytest.mark.usefixtures("cli_environment")


def test_settings_from_args(tmp_path: Path) -> None:
    args = build_parser().parse_args([
        "config", "--model-repository", str(tmp_path), "--http-port", "9000", "--id", "mine",
        "--strict-readiness", "false", "--disable-auto-complete-config", "--replica-num-cpus", "0.25",
        "--gpu-fraction-per-model", "0.5",
    ])
    settings = settings_from_args(args)
    assert settings.model_repository == tmp_path
    assert settings.http_port == 9000 and settings.id == "mine"
    assert settings.strict_readiness is False
    assert settings.disable_auto_complete_config is True
    assert settings.replica_num_cpus == 0.25
    assert settings.gpu_fraction_per_model == 0.5


def test_settings_defaults(tmp_path: Path) -> None:
    settings = settings_from_args(build_parser().parse_args(["serve", "--model-store", str(tmp_path)]))
    assert settings.model_repository == tmp_path
    assert (settings.http_address, settings.http_port, settings.id) == ("127.0.0.1", 8000, "triton")
    assert settings.strict_readiness is True and settings.disable_auto_complete_config is False
    assert settings.ray_address is None


def test_bad_flag_values_are_rejected(tmp_path: Path) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model-repository", str(tmp_path), "--strict-readiness", "maybe"])
    with pytest.raises(SystemExit):
        parser.parse_args(["serve"])  # the repository is required
    with pytest.raises(ValidationError):
        ServerSettings(model_repository=tmp_path, no_such_setting=1)  # type: ignore[call-arg]
    for fraction in (0, 1.5):  # a share of one GPU
        with pytest.raises(ValidationError, match="gpu_fraction_per_model"):
            ServerSettings(model_repository=tmp_path, gpu_fraction_per_model=fraction)


def test_render_serve_config(example_repository: Path) -> None:
    settings = settings_from_args(build_parser().parse_args(
        ["config", "--model-repository", str(example_repository), "--http-port", "8123"]))
    doc = render_serve_config(settings)
    # Serve's own HTTP ingress sits behind the front, which the /v2 app starts on --http-port.
    assert doc["http_options"] == {"host": "127.0.0.1", "port": 9000}
    apps = {app["name"]: app for app in doc["applications"]}
    front_args = {k: apps["rayinfer"]["args"][k] for k in ("http_address", "http_port", "serve_http_port")}
    assert front_args == {"http_address": "127.0.0.1", "http_port": 8123, "serve_http_port": 9000}
    assert sorted(apps) == ["mlp", "nlp_embedding", "nlp_encoder", "nlp_ensemble", "nlp_head", "nlp_tokenizer", "openai",
                            "rayinfer", "simple",
                            "simple_dyna_sequence", "simple_identity", "simple_sequence", "simple_string",
                            "simple_string_dyna_sequence", "tiny_llm"]
    server = apps["rayinfer"]
    assert server["route_prefix"] == "/v2"
    assert apps["openai"]["route_prefix"] == "/v1"
    assert apps["openai"]["import_path"] == "rayinfer.deployments.app:build_openai_app"
    assert server["args"]["model_repository"] == str(example_repository.resolve())
    assert doc["applications"][0] is server  # the /v2 app comes first
    for name in ("mlp", "simple", "simple_identity", "simple_string"):
        app = apps[name]
        assert app["route_prefix"] == f"/v2/models/{name}"
        assert app["import_path"] == "rayinfer.deployments.app:build_model_app"
        assert app["args"]["model"] == name
        assert app["args"]["version"] == 1 and app["args"]["is_default"] is True
        assert app["args"]["auto_complete"] is True
    # Route prefixes must be unique or Serve rejects the config.
    prefixes = [app["route_prefix"] for app in doc["applications"]]
    assert len(prefixes) == len(set(prefixes))


def test_metrics_flags_reach_the_server_app(example_repository: Path) -> None:
    """tritonserver's --allow-cpu-metrics, --allow-gpu-metrics and --metrics-interval-ms."""
    from rayinfer.deployments.app import build_server_app

    settings = settings_from_args(build_parser().parse_args([
        "config", "--model-repository", str(example_repository), "--allow-cpu-metrics", "false",
        "--allow-gpu-metrics=false", "--metrics-interval-ms", "500", "--metrics-port", "8102",
    ]))
    args = render_serve_config(settings)["applications"][0]["args"]
    assert {k: args[k] for k in ("metrics_port", "metrics_interval_ms", "allow_cpu_metrics", "allow_gpu_metrics")} == {
        "metrics_port": 8102, "metrics_interval_ms": 500, "allow_cpu_metrics": False, "allow_gpu_metrics": False,
    }
    bound = build_server_app(args)._bound_deployment.init_args
    assert MetricsOptions("127.0.0.1", 8102, 500, cpu=False, gpu=False) in bound
    defaults = render_serve_config(ServerSettings(model_repository=example_repository))["applications"][0]["args"]
    assert (defaults["metrics_interval_ms"], defaults["allow_cpu_metrics"], defaults["allow_gpu_metrics"]) == (2000, True, True)
    assert "metrics_port" not in render_serve_config(
        ServerSettings(model_repository=example_repository, allow_metrics=False))["applications"][0]["args"]
    with pytest.raises(ValidationError):
        ServerSettings(model_repository=example_repository, metrics_interval_ms=0)
    # Port 0 means no metrics port, from the CLI and from a Serve config alike.
    assert "metrics_port" not in render_serve_config(
        ServerSettings(model_repository=example_repository, metrics_port=0))["applications"][0]["args"]
    # `serve run ... allow_gpu_metrics=false` passes strings.
    from_strings = build_server_app({**args, "allow_cpu_metrics": "true", "allow_gpu_metrics": "false"})
    assert MetricsOptions("127.0.0.1", 8102, 500, cpu=True, gpu=False) in from_strings._bound_deployment.init_args
    with pytest.raises(ValueError, match="expected a boolean"):
        build_server_app({**args, "allow_gpu_metrics": "maybe"})


def test_log_flags_become_the_logging_extensions_settings_at_start(example_repository: Path) -> None:
    """tritonserver's --log-info, --log-warning, --log-error, --log-format, --log-file and
    --log-verbose reach the /v2 app, which starts the logging extension with them."""
    from rayinfer.deployments.app import build_server_app
    from rayinfer.deployments.replica_options import ModelControl

    settings = settings_from_args(build_parser().parse_args([
        "config", "--model-repository", str(example_repository), "--log-info", "false", "--log-warning=false",
        "--log-format", "ISO8601", "--log-file", "/var/log/rayinfer.log", "--log-verbose", "2",
    ]))
    args = render_serve_config(settings)["applications"][0]["args"]
    expected = {"log_file": "/var/log/rayinfer.log", "log_info": False, "log_warning": False, "log_error": True,
                "log_verbose_level": 2, "log_format": "ISO8601"}
    assert args["log_settings"] == expected
    control = next(a for a in build_server_app(args)._bound_deployment.init_args if isinstance(a, ModelControl))
    assert dict(control.log_settings) == expected
    # Model replicas follow them from their first line (until the /v2 replica's arrive).
    from rayinfer.deployments.app import build_model_app

    model_args = render_serve_config(settings)["applications"][1]["args"]
    assert model_args["log_settings"] == expected
    assert build_model_app(model_args)._bound_deployment.init_args[-3] == expected
    with pytest.raises(SystemExit):
        build_parser().parse_args(["config", "--model-repository", str(example_repository), "--log-format", "json"])


def test_broken_models_get_no_app_and_old_versions_get_version_routes(tmp_path: Path) -> None:
    write_example_repository(tmp_path)
    (tmp_path / "simple" / "config.pbtxt").write_text(
        (tmp_path / "simple" / "config.pbtxt").read_text() + "version_policy { all { } }\n")
    (tmp_path / "simple" / "2").mkdir()
    (tmp_path / "simple" / "1" / "model.onnx").replace(tmp_path / "simple" / "2" / "model.onnx")
    (tmp_path / "simple" / "1" / "model.onnx").write_bytes(b"")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.pbtxt").write_text("{{{")
    entries = scan_repository(tmp_path)
    assert ("simple", 1, False) in served_versions(entries)
    assert ("simple", 2, True) in served_versions(entries)
    doc = render_serve_config(ServerSettings(model_repository=tmp_path), entries)
    routes = {app["name"]: app["route_prefix"] for app in doc["applications"]}
    assert "broken" not in routes
    assert routes["simple"] == "/v2/models/simple"
    assert routes["simple@v1"] == "/v2/models/simple/versions/1"


def test_every_rendered_application_builds_from_its_import_path(example_repository: Path) -> None:
    """What `serve deploy` does with the config: import each builder and call it with the args."""
    import importlib

    from ray.serve import Application

    settings = ServerSettings(model_repository=example_repository, model_control_mode="poll")
    for app in render_serve_config(settings)["applications"]:
        module, _, attr = app["import_path"].partition(":")
        built = getattr(importlib.import_module(module), attr)(app["args"])
        assert isinstance(built, Application), app["name"]


def test_replica_ports_lie_outside_the_ephemeral_range() -> None:
    """Serve's replica servers get ports no socket bound to port 0 (or a client's socket) can hold."""
    from rayinfer.cluster.settings import RAY_ENVIRONMENT

    def ports(protocol: str) -> range:
        low, high = (int(RAY_ENVIRONMENT[f"RAY_SERVE_DIRECT_INGRESS_{end}_{protocol}_PORT"]) for end in ("MIN", "MAX"))
        return range(low, high)

    http, grpc = ports("HTTP"), ports("GRPC")
    assert len(http) >= 1000 and len(grpc) >= 1000 and not set(http) & set(grpc)
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert max(http[-1], grpc[-1]) < low or min(http[0], grpc[0]) > high


def test_instance_groups_become_deployment_resources(tmp_path: Path) -> None:
    write_example_repository(tmp_path)
    simple = tmp_path / "simple" / "config.pbtxt"
    simple.write_text(simple.read_text() + "instance_group [ { count: 2 kind: KIND_GPU gpus: [ 0, 1 ] } ]\n")
    mlp = tmp_path / "mlp" / "config.pbtxt"
    mlp.write_text(mlp.read_text().replace("instance_group [ { count: 1 kind: KIND_CPU } ]",
                                           "instance_group [ { kind: KIND_CPU }, { kind: KIND_GPU } ]"))

    def deployments(**settings) -> dict:
        doc = render_serve_config(ServerSettings(model_repository=tmp_path, replica_num_cpus=0.25, **settings))
        apps = {app["name"]: app.get("deployments") for app in doc["applications"] if app["name"] != "rayinfer"}
        for deployment in (d for app in apps.values() for d in app or ()):
            # Ray's own metrics are off in every model replica (see the test below).
            assert deployment["ray_actor_options"].pop("runtime_env") == RAY_METRICS_OFF
        return apps

    rendered = deployments()
    assert rendered["simple"] == [{"name": "simple_v1", "num_replicas": 4,
                                   "ray_actor_options": {"num_cpus": 0.25, "num_gpus": 0.5}}]
    assert rendered["mlp"] is None  # mixed kinds: the application reports the error when deployed
    shared = deployments(gpu_fraction_per_model=0.5)
    assert shared["simple"][0]["ray_actor_options"] == {"num_cpus": 0.25, "num_gpus": 0.25}
    # The applications get it too (serve deploy builds them from these args, strings included).
    apps = render_serve_config(ServerSettings(model_repository=tmp_path, gpu_fraction_per_model=0.5))["applications"]
    assert all(app["args"]["gpu_fraction_per_model"] == 0.5 for app in apps if app["name"] != "openai")
    from rayinfer.deployments.app import build_model_app

    simple_app = build_model_app({"model_repository": str(tmp_path), "model": "simple", "version": 1,
                                  "gpu_fraction_per_model": "0.5"})
    assert simple_app._bound_deployment.ray_actor_options == {"num_cpus": 0.1, "num_gpus": 0.25,
                                                              "runtime_env": RAY_METRICS_OFF}
    with pytest.raises(ValueError, match="gpu_fraction_per_model must be above 0 and at most 1, not 2.0"):
        build_model_app({"model_repository": str(tmp_path), "model": "simple", "version": 1,
                         "gpu_fraction_per_model": 2})
    fallback = deployments(gpu_fallback="cpu")
    # as KIND_CPU groups of the same count
    assert fallback["simple"] == [{"name": "simple_v1", "num_replicas": 2, "ray_actor_options": {"num_cpus": 0.25}}]
    apps = render_serve_config(ServerSettings(model_repository=tmp_path, gpu_fallback="cpu"))["applications"]
    assert all(app["args"]["gpu_fallback"] for app in apps if app["name"] not in ("rayinfer", "openai"))
    # KIND_AUTO (no instance_group) counts as GPU only when the settings give the cluster GPUs
    # and the backend, as installed, can use them (a Python model can; onnxruntime's CPU build
    # cannot).
    write_python_model(tmp_path, "py_auto", 'backend: "python"\nmax_batch_size: 0\n'
                       'input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
                       'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n', "")
    assert deployments()["simple_string"][0]["ray_actor_options"] == {"num_cpus": 0.25}
    assert deployments()["py_auto"][0]["ray_actor_options"] == {"num_cpus": 0.25}
    on_gpus = deployments(num_gpus=1)
    assert on_gpus["py_auto"][0]["ray_actor_options"] == {"num_cpus": 0.25, "num_gpus": 1.0}
    assert on_gpus["simple_string"][0]["ray_actor_options"] == (
        {"num_cpus": 0.25, "num_gpus": 1.0} if backend_uses_gpus("onnxruntime") else {"num_cpus": 0.25})


RAY_METRICS_OFF = {"env_vars": {"RAY_enable_metrics_collection": "0"}}


def test_model_replicas_report_rays_own_metrics_only_when_asked(tmp_path: Path) -> None:
    """Ray keeps the metric series of a process after it exits, so model replicas (new ones on
    every reload) run with Ray's metrics off; --replica-ray-metrics turns them on, in the
    replicas' options and in the args ``serve deploy`` builds the applications from."""
    from rayinfer.deployments.app import build_model_app, build_server_app
    from rayinfer.deployments.replica_options import with_callers_runtime_env

    write_example_repository(tmp_path)
    for flag, env in ((False, {"runtime_env": RAY_METRICS_OFF}), (True, {})):
        doc = render_serve_config(ServerSettings(model_repository=tmp_path, replica_ray_metrics=flag))
        models = [app for app in doc["applications"] if app["name"] != "rayinfer"]
        assert all(app["deployments"][0]["ray_actor_options"] == {"num_cpus": 0.1, **env} for app in models
                   if app.get("deployments"))
        assert all(app["args"].get("replica_ray_metrics", False) is flag for app in doc["applications"]
                   if app["name"] != "openai")
        args = {"model_repository": str(tmp_path), "model": "simple", "version": 1, "replica_ray_metrics": str(flag)}
        assert build_model_app(args)._bound_deployment.ray_actor_options == {"num_cpus": 0.1, **env}
        server = next(app for app in doc["applications"] if app["name"] == "rayinfer")
        control = build_server_app(server["args"])._bound_deployment.init_args[4]
        assert control.replica_ray_metrics is flag
    # Deployed from a process with a runtime_env of its own (a `serve deploy` application's, a
    # job's), the replicas keep it: Serve would give them only its working_dir once they set one.
    assert with_callers_runtime_env({"env_vars": dict(RAY_METRICS_OFF["env_vars"])}, None) == RAY_METRICS_OFF
    caller = {"pip": ["numpy"], "working_dir": "gcs://_ray_pkg_1.zip", "env_vars": {"A": "1",
                                                                                   "RAY_enable_metrics_collection": "1"}}
    assert with_callers_runtime_env(RAY_METRICS_OFF, caller) == {
        "pip": ["numpy"], "working_dir": "gcs://_ray_pkg_1.zip", "env_vars": {"A": "1", "RAY_enable_metrics_collection": "0"}}
    assert caller["env_vars"]["RAY_enable_metrics_collection"] == "1"  # not changed
    # The flag, as `rayinfer serve` and `config` take it.
    for command in ("serve", "config"):
        for given, value in ((["--replica-ray-metrics"], True), (["--replica-ray-metrics", "false"], False), ([], False)):
            args = build_parser().parse_args([command, "--model-repository", str(tmp_path), *given])
            assert settings_from_args(args).replica_ray_metrics is value


def test_autoscaling_parameters_become_the_deployments_autoscaling_config(tmp_path: Path) -> None:
    write_example_repository(tmp_path)
    simple = tmp_path / "simple" / "config.pbtxt"
    simple.write_text(simple.read_text() + "instance_group [ { count: 2 kind: KIND_CPU } ]\n"
                      'parameters { key: "autoscaling_max_replicas" value: { string_value: "3" } }\n')
    doc = render_serve_config(ServerSettings(model_repository=tmp_path, replica_num_cpus=0.25))
    (deployment,) = next(app["deployments"] for app in doc["applications"] if app["name"] == "simple")
    assert "num_replicas" not in deployment
    scaling = deployment["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["initial_replicas"], scaling["max_replicas"]) == (1, 2, 3)
    assert scaling["policy"] == {"policy_function": "rayinfer.deployments.autoscaling:front_traffic_policy"}


def test_front_on_head_places_the_v2_replica_on_the_head_node(example_repository: Path) -> None:
    from rayinfer.deployments.app import HEAD_NODE_RESOURCE, build_server_app

    def server_args(**settings) -> dict:
        return render_serve_config(ServerSettings(model_repository=example_repository, **settings))["applications"][0]["args"]

    assert "front_on_head" not in server_args()
    args = server_args(front_on_head=True)
    assert args["front_on_head"] is True
    assert "front_on_every_node" not in args
    assert server_args(front_on_every_node=True)["front_on_every_node"] is True
    options = build_server_app(args)._bound_deployment.ray_actor_options
    assert options["resources"] == {HEAD_NODE_RESOURCE: 0.001} and options["num_cpus"] == 0.1
    assert "resources" not in build_server_app(server_args())._bound_deployment.ray_actor_options


def test_restricted_groups_reach_every_model_replica(example_repository: Path) -> None:
    """--http-restricted-api and --grpc-restricted-protocol reach the model applications (whose
    listeners check them too) and the /v2 app's model control (models loaded later)."""
    from rayinfer.deployments.app import build_model_app, build_server_app
    from rayinfer.deployments.replica_options import with_callers_runtime_env
    from rayinfer.deployments.replica_options import ModelControl

    settings = settings_from_args(build_parser().parse_args([
        "config", "--model-repository", str(example_repository), "--http-restricted-api", "inference:key=v",
        "--grpc-restricted-protocol", "inference,health:key=v",
    ]))
    config = render_serve_config(settings)
    model_args = config["applications"][1]["args"]
    assert (model_args["http_restricted_api"], model_args["grpc_restricted_protocol"]) == (
        ["inference:key=v"], ["inference,health:key=v"])
    assert build_model_app(model_args)._bound_deployment.init_args[-2] == {
        "http": ["inference:key=v"], "grpc": ["inference,health:key=v"]}
    server_args = config["applications"][0]["args"]
    control = next(a for a in build_server_app(server_args)._bound_deployment.init_args if isinstance(a, ModelControl))
    assert (control.http_restricted, control.grpc_restricted) == (("inference:key=v",), ("inference,health:key=v",))
    plain = render_serve_config(settings_from_args(build_parser().parse_args(
        ["config", "--model-repository", str(example_repository)])))
    assert "http_restricted_api" not in plain["applications"][1]["args"]


def test_a_serve_config_refuses_the_model_pool_saying_where_it_works(example_repository: Path) -> None:
    """A Serve config lists an application per model version: the pool is rayinfer serve's."""
    settings = settings_from_args(build_parser().parse_args(
        ["config", "--model-repository", str(example_repository), "--model-hosting", "pool"]))
    assert settings.model_hosting == "pool" and settings.pool_replicas == 1
    with pytest.raises(ValueError, match="--model-hosting pool is for rayinfer serve"):
        render_serve_config(settings)
