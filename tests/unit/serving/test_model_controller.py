"""ModelController without Ray Serve: a deployer that records what it is asked to do."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from onnx import TensorProto

from rayinfer.cluster.example_repository import SIMPLE_CONFIG, add_sub_model, write_model
from rayinfer.protocol.errors import InternalError, InvalidArgError
from rayinfer.repository.scanner import scan_repository
from rayinfer.serving.model_control import ModelController


class _Deployer:
    """Serves what it is told to; ``fail`` and ``trial_error`` make deploys and trials fail."""

    def __init__(self) -> None:
        self.served: dict[str, list[tuple[str, int, bool]]] = {}
        self.roots: dict[str, str] = {}
        self.trials: list[str] = []
        self.fail: str | None = None
        self.trial_error: Exception | None = None

    def serving(self, model: str) -> bool:
        return model in self.served

    def trial_load(self, root: str, versions: list[tuple[str, int, bool]], override: str | None) -> None:
        self.trials.append(versions[0][0])
        if self.trial_error is not None:
            raise self.trial_error

    def deploy(self, root: str, model: str, versions: list[tuple[str, int, bool]], override: str | None) -> str | None:
        if self.fail is not None:
            self.served.pop(model, None)
            return self.fail
        self.served[model] = versions
        self.roots[model] = root
        return None

    def remove(self, model: str) -> None:
        self.served.pop(model, None)


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    write_model(root, "simple", SIMPLE_CONFIG, add_sub_model(TensorProto.INT32))
    (root / "simple" / "3").mkdir()
    (root / "simple" / "3" / "model.onnx").write_bytes((root / "simple" / "1" / "model.onnx").read_bytes())
    return root


@pytest.fixture
def control(repository: Path) -> tuple[ModelController, _Deployer]:
    deployer = _Deployer()
    return ModelController(repository, deployer, "explicit"), deployer


def test_load_deploys_the_versions_the_policy_selects(control) -> None:
    controller, deployer = control
    controller.load("simple", {})
    assert deployer.served["simple"] == [("simple", 3, True)]  # latest 1 by default
    assert deployer.trials == []  # nothing was serving: no trial
    controller.load("simple", {"config": '{"version_policy": {"all": {}}}'})
    assert deployer.served["simple"] == [("simple", 1, False), ("simple", 3, True)]
    assert deployer.trials == ["simple"]  # a serving model's new version is tried first


def test_a_failed_trial_keeps_the_serving_version(control) -> None:
    controller, deployer = control
    controller.load("simple", {})
    deployer.trial_error = RuntimeError("model.onnx is corrupt")
    with pytest.raises(InvalidArgError, match="failed to load .simple.: .*model.onnx is corrupt"):
        controller.load("simple", {"config": '{"max_batch_size": 2}'})
    assert deployer.served["simple"] == [("simple", 3, True)]
    assert "simple" not in controller.load_errors  # it still serves


def test_a_failed_deploy_is_the_models_load_error(control) -> None:
    controller, deployer = control
    deployer.fail = "replica died"
    with pytest.raises(InvalidArgError, match="replica died"):
        controller.load("simple", {})
    assert controller.load_errors == {"simple": "replica died"}
    deployer.fail = None
    controller.load("simple", {})
    assert controller.load_errors == {}


@pytest.mark.parametrize("model, parameters, error, message", [
    ("nope", {}, InternalError, "failed to load 'nope', failed to poll from model repository"),
    ("../simple", {}, InvalidArgError,
     "invalid model name '../simple', model name must not contain path traversal characters"),
    ("a/b", {}, InvalidArgError, "invalid model name 'a/b', model name must not contain path traversal characters"),
    ("", {}, InvalidArgError, "model name must not be empty"),
    ("  ", {}, InvalidArgError, "model name must not contain only whitespace characters"),
    ("nope", {"config": "{}"}, InternalError, "failed to load 'nope', failed to poll from model repository"),
    ("simple", {"config": 3}, InvalidArgError, "parameter 'config' must be a JSON string"),
    ("simple", {"file:1/model.onnx": "AAAA"}, InvalidArgError, "'file:' parameters need the 'config' parameter"),
    ("simple", {"config": "{oops"}, InvalidArgError, "failed to load 'simple'"),
])
def test_bad_loads_are_refused_with_the_reason(control, model, parameters, error, message) -> None:
    controller, deployer = control
    with pytest.raises(error, match=message):
        controller.load(model, parameters)
    assert deployer.served == {}


def test_files_are_served_from_a_temporary_directory_removed_on_unload(control, repository: Path) -> None:
    controller, deployer = control
    model = base64.b64encode((repository / "simple" / "1" / "model.onnx").read_bytes()).decode()
    config = '{"backend": "onnxruntime", "max_batch_size": 2}'
    controller.load("simple", {"config": config, "file:5/model.onnx": model})
    root = Path(deployer.roots["simple"])
    assert root != repository and (root / "simple" / "5" / "model.onnx").exists()
    assert deployer.served["simple"] == [("simple", 5, True)]
    assert controller.entry("simple", None).versions == [5]  # type: ignore[arg-type]  # read from its source
    controller.unload("simple")
    assert not root.exists() and "simple" not in deployer.served
    controller.unload("simple")  # unloading what is not loaded is not an error, as in Triton


def test_files_load_a_model_the_repository_does_not_have(control, repository: Path) -> None:
    controller, deployer = control
    model = base64.b64encode((repository / "simple" / "1" / "model.onnx").read_bytes()).decode()
    controller.load("brand_new", {"config": '{"backend": "onnxruntime", "max_batch_size": 2}', "file:1/model.onnx": model})
    assert deployer.served["brand_new"] == [("brand_new", 1, True)]
    # Listed after the repository's own models, read from its files.
    entries = controller.entries(scan_repository(repository))
    assert [e.name for e in entries] == ["simple", "brand_new"] and entries[1].versions == [1]
    controller.unload("brand_new")
    assert [e.name for e in controller.entries([])] == []


def test_a_load_from_the_repository_again_removes_the_old_files(control, repository: Path) -> None:
    controller, deployer = control
    model = base64.b64encode((repository / "simple" / "1" / "model.onnx").read_bytes()).decode()
    controller.load("simple", {"config": '{"backend": "onnxruntime", "max_batch_size": 2}', "file:1/model.onnx": model})
    root = Path(deployer.roots["simple"])
    controller.load("simple", {})
    assert deployer.roots["simple"] == str(repository) and not root.exists()


def test_close_removes_every_temporary_directory(control, repository: Path) -> None:
    controller, deployer = control
    model = base64.b64encode((repository / "simple" / "1" / "model.onnx").read_bytes()).decode()
    controller.load("simple", {"config": '{"backend": "onnxruntime"}', "file:1/model.onnx": model})
    root = Path(deployer.roots["simple"])
    controller.close()
    assert not root.exists()


def _ensemble(root: Path, name: str, members: list[str]) -> None:
    steps = ", ".join(f'{{ model_name: "{m}" model_version: -1 input_map {{ key: "INPUT0" value: "A" }} '
                      f'input_map {{ key: "INPUT1" value: "A" }} output_map {{ key: "OUTPUT0" value: "S{i}" }} }}'
                      for i, m in enumerate(members))
    outputs = ", ".join(f'{{ name: "S{i}" data_type: TYPE_INT32 dims: [ 16 ] }}' for i in range(len(members)))
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(
        f'name: "{name}" platform: "ensemble" max_batch_size: 8\n'
        f'input [ {{ name: "A" data_type: TYPE_INT32 dims: [ 16 ] }} ]\noutput [ {outputs} ]\n'
        f'ensemble_scheduling {{ step [ {steps} ] }}\n')


def test_loading_an_ensemble_loads_its_members_first(control, repository: Path) -> None:
    controller, deployer = control
    _ensemble(repository, "inner", ["simple"])
    _ensemble(repository, "outer", ["inner", "simple"])
    controller.load("outer", {})
    assert list(deployer.served) == ["simple", "inner", "outer"]
    _ensemble(repository, "lost", ["simple", "nowhere"])
    with pytest.raises(InvalidArgError, match="ensemble 'lost': step 1 names model 'nowhere', which is not in"):
        controller.load("lost", {})
    assert "lost" not in deployer.served and "nowhere" in controller.load_errors["lost"]


def test_a_members_failure_fails_the_ensemble_naming_the_member(control, repository: Path) -> None:
    controller, deployer = control
    _ensemble(repository, "ens", ["simple"])
    deployer.fail = "replica died"
    with pytest.raises(InvalidArgError, match="ensemble 'ens' depends on 'simple', which failed to load: "
                                               "failed to load 'simple': replica died"):
        controller.load("ens", {})


def test_unload_dependents_keeps_members_other_ensembles_use(control, repository: Path) -> None:
    controller, _ = control
    write_model(repository, "other", SIMPLE_CONFIG.replace('"simple"', '"other"'), add_sub_model(TensorProto.INT32))
    _ensemble(repository, "inner", ["other"])
    _ensemble(repository, "outer", ["inner", "simple"])
    _ensemble(repository, "neighbour", ["simple"])
    assert controller.dependents_to_unload("outer", ["outer", "inner", "other", "simple", "neighbour"]) == ["inner", "other"]
    assert controller.dependents_to_unload("outer", ["outer", "inner", "other", "simple"]) == ["inner", "simple", "other"]


def test_an_s3_repository_is_read_as_it_is_at_each_load(s3_endpoint: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Explicit mode on an s3:// repository (a real S3-compatible server): each load brings the
    copy up to date first, and replicas are given the URL, not this node's copy."""
    from rayinfer.repository.object_store import MOUNT_DIRECTORY_VARIABLE, local_repository
    from s3_server import CREDENTIALS, client, upload_folder

    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(MOUNT_DIRECTORY_VARIABLE, str(tmp_path / "copy"))
    s3 = client(s3_endpoint)
    s3.create_bucket(Bucket="controller")
    write_model(tmp_path / "source", "simple", SIMPLE_CONFIG, add_sub_model(TensorProto.INT32))
    upload_folder(s3, "controller", "models", tmp_path / "source")
    url = f"s3://{s3_endpoint}/controller/models"
    deployer = _Deployer()
    controller = ModelController(local_repository(url), deployer, "explicit", url)

    controller.load("simple", {})
    assert deployer.served["simple"] == [("simple", 1, True)] and deployer.roots["simple"] == url
    # Added to the bucket after the start: a load finds it.
    write_model(tmp_path / "later", "added", SIMPLE_CONFIG.replace('name: "simple"', 'name: "added"'),
                add_sub_model(TensorProto.INT32))
    upload_folder(s3, "controller", "models", tmp_path / "later")
    controller.load("added", {})
    assert deployer.served["added"] == [("added", 1, True)]
    # A new version of a served model: loaded on trial, then served.
    s3.put_object(Bucket="controller", Key="models/simple/2/model.onnx",
                  Body=(tmp_path / "source" / "simple" / "1" / "model.onnx").read_bytes())
    controller.load("simple", {})
    assert deployer.trials == ["simple"] and deployer.served["simple"] == [("simple", 2, True)]
    # Gone from the bucket: Triton's message.
    for item in s3.list_objects_v2(Bucket="controller", Prefix="models/added/")["Contents"]:
        s3.delete_object(Bucket="controller", Key=item["Key"])
    with pytest.raises(InternalError, match="failed to load 'added', failed to poll from model repository"):
        controller.load("added", {})
