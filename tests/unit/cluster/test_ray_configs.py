"""The cluster launcher configs in ray-configs/ pass Ray's own validation (what `ray up` runs
before it starts a node) and start every node the way rayinfer needs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CONFIGS = Path(__file__).resolve().parents[3] / "ray-configs"
CLUSTERS = sorted(CONFIGS.glob("cluster-*.yaml"))


def test_there_is_a_config_per_provider() -> None:
    assert [p.name for p in CLUSTERS] == ["cluster-aws.yaml", "cluster-gcp.yaml", "cluster-local.yaml"]


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.stem)
def test_ray_validates_the_cluster_config(path: Path) -> None:
    config = yaml.safe_load(path.read_text())
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)  # raises with the offending field
    # Every node gets the project and starts Ray with rayinfer's Ray settings.
    assert prepared["file_mounts"] == {"~/rayinfer": "."}
    assert any("pip install" in c and "$HOME/rayinfer" in c for c in prepared["setup_commands"])
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert any('eval "$(~/venv/bin/rayinfer ray-env)"' in c and "ray start" in c for c in prepared[key]), key
    assert any("--dashboard-host=127.0.0.1" in c for c in prepared["head_start_ray_commands"])


@pytest.mark.parametrize("name", ["cluster-aws.yaml", "cluster-gcp.yaml"])
def test_cloud_clusters_have_a_cpu_head_and_autoscaled_gpu_workers(name: str) -> None:
    prepared = prepare_config(yaml.safe_load((CONFIGS / name).read_text()))
    head, worker = prepared["available_node_types"]["head"], prepared["available_node_types"]["gpu_worker"]
    assert prepared["head_node_type"] == "head" and "GPU" not in head["resources"]
    assert worker["resources"]["GPU"] == 1 and worker["min_workers"] == 0 < worker["max_workers"]
    assert any('rayinfer[gpu]' in c for c in prepared["setup_commands"])  # the GPU extra
