"""Serve's controller reuses one replica actor class per replica name (rayinfer.deployments.serve_internals)."""

from __future__ import annotations

import importlib

import pytest

from rayinfer.cluster.settings import RAY_ENVIRONMENT
from rayinfer.deployments.serve_internals import reuse_replica_classes


class Model:
    """The user class a deployment's replicas run (the test needs only its name)."""


@pytest.fixture
def deployment_info(monkeypatch: pytest.MonkeyPatch):
    """Serve's DeploymentInfo, its replica-class getter restored after the test."""
    from ray.serve._private.deployment_info import DeploymentInfo

    monkeypatch.setattr(DeploymentInfo, "actor_def", DeploymentInfo.__dict__["actor_def"])

    def make(actor_name: str, num_replicas: int = 1) -> DeploymentInfo:
        from ray.serve._private.config import DeploymentConfig, ReplicaConfig

        return DeploymentInfo(deployment_config=DeploymentConfig(num_replicas=num_replicas),
                              replica_config=ReplicaConfig.create(Model), start_time_ms=0, deployer_job_id="01000000",
                              actor_name=actor_name)

    return make


def function_id(actor_class):
    """The id Ray keeps the class under in GCS and in each process that loads it."""
    return actor_class.__ray_metadata__.actor_creation_function_descriptor.function_id


def test_each_deployment_builds_its_own_class_without_the_callback(deployment_info):
    first, second = deployment_info("ServeReplica:m:m_1"), deployment_info("ServeReplica:m:m_1")
    assert first.actor_def is not second.actor_def
    assert function_id(first.actor_def) != function_id(second.actor_def)


def test_later_deployments_of_a_replica_name_reuse_its_class(deployment_info):
    reuse_replica_classes()
    reuse_replica_classes()  # Serve's controller calls it once per start; a second call changes nothing
    first = deployment_info("ServeReplica:m:m_1")
    reloaded = deployment_info("ServeReplica:m:m_1", num_replicas=3)
    other = deployment_info("ServeReplica:m:m_2")
    assert reloaded.actor_def is first.actor_def
    assert function_id(reloaded.actor_def) == function_id(first.actor_def)
    assert other.actor_def is not first.actor_def
    assert other.actor_def.__ray_metadata__.class_name == "ServeReplica:m:m_2"


def test_ray_environment_names_the_controller_callback():
    module_name, _, attr = RAY_ENVIRONMENT["RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH"].partition(":")
    assert getattr(importlib.import_module(module_name), attr) is reuse_replica_classes


def test_another_ray_version_is_refused_with_what_to_install(monkeypatch, capsys):
    import ray

    from rayinfer.cluster.cli import main
    from rayinfer.deployments.app import build_server_app
    from rayinfer.deployments.serve_internals import RAY_VERSION, ray_version_problem

    assert ray_version_problem() is None
    monkeypatch.setattr(ray, "__version__", "2.99.0")
    problem = ray_version_problem()
    assert problem is not None and "found 2.99.0" in problem and f"pip install 'ray[serve]=={RAY_VERSION}'" in problem
    with pytest.raises(SystemExit) as exited:
        main(["config", "--model-repository", "."])
    assert exited.value.code == 2 and "rayinfer needs Ray" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="rayinfer needs Ray"):
        build_server_app({"model_repository": "."})
