"""ray-configs/kuberay-rayservice.yaml: a RayService whose serveConfigV2 is what ``rayinfer
config`` renders, with the fields the RayService CRD requires and rayinfer's Ray settings on
every node. No Kubernetes here: the manifest is checked field by field, and serveConfigV2 with
Serve's own schema (what ``serve deploy`` validates)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import ray
import yaml
from ray.serve.schema import ServeDeploySchema

from rayinfer.cluster.cli import main
from rayinfer.cluster.example_repository import write_example_repository
from rayinfer.cluster.settings import RAY_ENVIRONMENT

CONFIGS = Path(__file__).resolve().parents[3] / "ray-configs"
MANIFEST = yaml.safe_load((CONFIGS / "kuberay-rayservice.yaml").read_text())
FRONT_SERVICE = yaml.safe_load((CONFIGS / "kuberay-front-service.yaml").read_text())
IMAGE_REPOSITORY = "/home/ray/models"
# What ray-configs/regenerate-kuberay.sh renders.
CONFIG_FLAGS = ["--http-address", "0.0.0.0", "--metrics-address", "0.0.0.0", "--front-on-head", "--front-on-every-node"]


def groups() -> list[dict]:
    cluster = MANIFEST["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


def containers() -> list[dict]:
    return [c for group in groups() for c in group["template"]["spec"]["containers"]]


def serve_config() -> dict:
    return yaml.safe_load(MANIFEST["spec"]["serveConfigV2"])


def test_serve_config_v2_is_what_rayinfer_config_renders(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cli_environment: None
) -> None:
    write_example_repository(tmp_path / "models")
    assert main(["config", "--model-repository", str(tmp_path / "models"), *CONFIG_FLAGS]) == 0
    rendered = capsys.readouterr().out.replace(str(tmp_path / "models"), IMAGE_REPOSITORY)
    assert MANIFEST["spec"]["serveConfigV2"] == rendered, (
        "serveConfigV2 in ray-configs/kuberay-rayservice.yaml is out of date: run ray-configs/regenerate-kuberay.sh"
    )


def test_serve_config_v2_passes_serves_schema() -> None:
    config = ServeDeploySchema.model_validate(serve_config())
    assert {app.name for app in config.applications} >= {"rayinfer", "mlp", "nlp_ensemble", "simple_identity"}
    server = serve_config()["applications"][0]["args"]
    assert server["model_repository"] == IMAGE_REPOSITORY and server["front_on_head"] is True
    assert server["front_on_every_node"] is True
    assert server["http_address"] == server["grpc_address"] == server["metrics_address"] == "0.0.0.0"


def test_the_rayservice_crds_required_fields_are_there() -> None:
    """The fields KubeRay's RayService CRD (ray.io/v1) requires, and the values it checks."""
    assert MANIFEST["apiVersion"] == "ray.io/v1" and MANIFEST["kind"] == "RayService"
    assert MANIFEST["metadata"]["name"]
    assert isinstance(MANIFEST["spec"]["serveConfigV2"], str)  # a YAML document in a string
    cluster = MANIFEST["spec"]["rayClusterConfig"]
    assert isinstance(cluster["headGroupSpec"]["rayStartParams"], dict)
    names = [group["groupName"] for group in cluster["workerGroupSpecs"]]
    assert len(set(names)) == len(names) == 2
    for group in cluster["workerGroupSpecs"]:
        assert isinstance(group["rayStartParams"], dict)
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    for container in containers():
        assert container["name"] and container["image"]
        for port in container["ports"]:
            assert isinstance(port["containerPort"], int) and re.fullmatch(r"[a-z0-9-]{1,15}", port["name"])
        for variable in container["env"]:
            assert set(variable) == {"name", "value"} and isinstance(variable["value"], str)


def test_every_node_starts_ray_with_rayinfers_settings_and_version() -> None:
    for container in containers():
        assert {v["name"]: v["value"] for v in container["env"]} == RAY_ENVIRONMENT
    assert MANIFEST["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__
    base = re.search(r"^ARG RAY_IMAGE=rayproject/ray:(\S+?)-", (CONFIGS / "Dockerfile").read_text(), re.M)
    assert base is not None and base.group(1) == ray.__version__
    assert len({c["image"] for c in containers()}) == 1


def test_the_head_exposes_the_fronts_ports_and_every_node_serves_ray_serve() -> None:
    """KubeRay's head service takes the head container's ports; its readiness probes and serve
    service use the port named ``serve`` (Serve's own HTTP ingress)."""
    config = serve_config()
    server = config["applications"][0]["args"]
    head, *workers = containers()
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert (ports["triton-http"], ports["triton-grpc"], ports["triton-metrics"]) == (
        server["http_port"], server["grpc_port"], server["metrics_port"])
    assert ports["dashboard"] == 8265  # KubeRay deploys serveConfigV2 through it
    assert MANIFEST["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    for container in (head, *workers):
        assert {p["name"]: p["containerPort"] for p in container["ports"]}["serve"] == config["http_options"]["port"]
    assert config["http_options"]["host"] == "0.0.0.0"


def test_gpu_workers_are_autoscaled_from_zero() -> None:
    cluster = MANIFEST["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    gpu = next(g for g in cluster["workerGroupSpecs"] if g["groupName"] == "gpu-workers")
    limits = gpu["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1" and gpu["minReplicas"] == 0 < gpu["maxReplicas"]
    assert "nvidia.com/gpu" not in cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"]


def test_the_front_service_reaches_each_serving_pods_front() -> None:
    """ray-configs/kuberay-front-service.yaml: a Service over the pods KubeRay marks as serving
    (``ray.io/serve``) among the RayService's (a label every pod template carries), on the
    front's HTTP and gRPC ports, which every container declares under the names it targets."""
    assert FRONT_SERVICE["apiVersion"] == "v1" and FRONT_SERVICE["kind"] == "Service"
    selector = dict(FRONT_SERVICE["spec"]["selector"])
    assert selector.pop("ray.io/serve") == "true"
    for group in groups():
        assert selector.items() <= group["template"]["metadata"]["labels"].items()
    server = serve_config()["applications"][0]["args"]
    ports = {p["name"]: p for p in FRONT_SERVICE["spec"]["ports"]}
    assert (ports["triton-http"]["port"], ports["triton-grpc"]["port"]) == (server["http_port"], server["grpc_port"])
    for container in containers():
        declared = {p["name"]: p["containerPort"] for p in container["ports"]}
        for port in ports.values():
            assert declared[port["targetPort"]] == port["port"]
