"""The FIL, OpenVINO and TensorFlow backends through unmodified tritonclient, HTTP and gRPC:
answers against the framework run here, batching, auto-complete, statistics and metrics,
Triton's errors, and a model that fails to load while the others serve."""

from __future__ import annotations

import concurrent.futures
import urllib.request

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import LOAD_TIMEOUT_S, tensor
from rayinfer.cluster.example_backends import forest_data, mlp_reference, mlp_weights
from rayinfer.cluster.example_repository import mlp_model

xgboost = pytest.importorskip("xgboost", reason="needs the fil extra (xgboost)")
lightgbm = pytest.importorskip("lightgbm", reason="needs the fil extra (lightgbm)")
pytest.importorskip("openvino", reason="needs the openvino extra")
pytest.importorskip("tensorflow", reason="needs the tensorflow extra")

ROWS = forest_data(rows=6, seed=11)[0]
# (model, input, output, the input's feature count) of each backend's model loaded at start.
MODELS = [("fil_forest", "input__0", "output__0", 16), ("mlp_openvino", "INPUT0", "OUTPUT0", 256),
          ("tf_mlp", "INPUT0", "OUTPUT0", 8)]


def _json(module) -> dict:
    return {"as_json": True} if module is grpcclient else {}


def _config(module, client, model: str) -> dict:
    config = client.get_model_config(model, **_json(module))
    return config.get("config", config)


def _counts(module, client, model: str) -> tuple[int, int]:
    stats = client.get_inference_statistics(model, **_json(module))["model_stats"][0]
    return int(stats["inference_count"]), int(stats["execution_count"])


def test_fil_forest_answers_as_xgboost_does(proto, model_repository):
    module, client = proto
    booster = xgboost.Booster(model_file=str(model_repository / "fil_forest" / "1" / "xgboost.ubj"))
    p = booster.inplace_predict(ROWS)
    result = client.infer("fil_forest", [tensor(module, "input__0", ROWS, "FP32")])
    assert result.get_response(**_json(module))["model_version"] == "1"
    np.testing.assert_allclose(result.as_numpy("output__0"), np.stack([1 - p, p], axis=1), rtol=1e-5, atol=1e-7)


def test_fil_lightgbm_config_is_completed_and_answers_class_indices(proto, model_repository):
    module, client = proto
    config = _config(module, client, "fil_lightgbm")
    assert config["backend"] == "fil" and int(config["max_batch_size"]) == 4
    assert [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in config["input"]] == [
        ("input__0", "TYPE_FP32", [16])]
    assert [t["name"] for t in config["output"]] == ["output__0"]
    booster = lightgbm.Booster(model_file=str(model_repository / "fil_lightgbm" / "1" / "model.txt"))
    result = client.infer("fil_lightgbm", [tensor(module, "input__0", ROWS[:4], "FP32")])
    np.testing.assert_array_equal(result.as_numpy("output__0")[:, 0], (booster.predict(ROWS[:4]) > 0.5).astype(np.float32))


def test_openvino_mlp_answers_as_onnxruntime_does(proto):
    module, client = proto
    x = np.random.default_rng(4).standard_normal((3, 256)).astype(np.float32)
    expected = ort.InferenceSession(mlp_model().SerializeToString()).run(None, {"INPUT0": x})[0]
    result = client.infer("mlp_openvino", [tensor(module, "INPUT0", x, "FP32")])
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), expected, rtol=1e-4, atol=1e-4)
    assert _config(module, client, "mlp_openvino")["backend"] == "openvino"


def test_tensorflow_savedmodel_is_completed_from_its_signature_and_answers(proto):
    module, client = proto
    config = _config(module, client, "tf_mlp")
    assert (config["platform"], config["backend"]) == ("tensorflow_savedmodel", "tensorflow")
    assert [(t["name"], [int(d) for d in t["dims"]]) for t in config["input"]] == [("INPUT0", [8])]
    assert [(t["name"], [int(d) for d in t["dims"]]) for t in config["output"]] == [("OUTPUT0", [4])]
    meta = client.get_model_metadata("tf_mlp", **_json(module))
    assert meta["platform"] == "tensorflow_savedmodel"
    x = np.random.default_rng(6).standard_normal((2, 8)).astype(np.float32)
    result = client.infer("tf_mlp", [tensor(module, "INPUT0", x, "FP32")])
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), mlp_reference(mlp_weights(), x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model, input_name, output_name, features", MODELS)
def test_concurrent_requests_are_batched(proto, server, model, input_name, output_name, features):
    module, client = proto
    before = _counts(module, client, model)
    url = server["grpc_url"] if module is grpcclient else server["url"]

    def one(i: int) -> np.ndarray:  # a client per thread: tritonclient.http's pool is not thread-safe
        x = np.full((1, features), i / 10, dtype=np.float32)
        with module.InferenceServerClient(url) as own:
            return own.infer(model, [tensor(module, input_name, x, "FP32")]).as_numpy(output_name)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(16)))
    assert all(a.shape[0] == 1 for a in answers)
    solo = client.infer(model, [tensor(module, input_name, np.full((1, features), 0.3, np.float32), "FP32")])
    np.testing.assert_allclose(answers[3], solo.as_numpy(output_name), rtol=1e-5, atol=1e-6)
    inferences, executions = (a - b for a, b in zip(_counts(module, client, model), before))
    assert inferences == 17 and executions < 17  # 20 ms queue delay: concurrent requests share executions


@pytest.mark.parametrize("model, input_name, output_name, features", MODELS)
def test_wrong_name_datatype_and_shape_get_tritons_errors(proto, model, input_name, output_name, features):
    module, client = proto
    x = np.zeros((1, features), dtype=np.float32)
    with pytest.raises(InferenceServerException, match=f"unexpected inference input 'WRONG' for model '{model}'"):
        client.infer(model, [tensor(module, "WRONG", x, "FP32")])
    with pytest.raises(InferenceServerException, match=f"inference input '{input_name}' data-type is 'FP64'"):
        client.infer(model, [tensor(module, input_name, x.astype(np.float64), "FP64")])
    with pytest.raises(InferenceServerException, match=f"unexpected shape for input '{input_name}' for model '{model}'"):
        client.infer(model, [tensor(module, input_name, np.zeros((1, features + 1), np.float32), "FP32")])


def test_metrics_count_each_backends_inferences(server, proto):
    module, client = proto
    for model, input_name, _, features in MODELS:
        client.infer(model, [tensor(module, input_name, np.zeros((1, features), np.float32), "FP32")])
    text = urllib.request.urlopen(server["metrics_url"], timeout=10).read().decode()
    for model, *_ in MODELS:
        assert any(line.startswith(f'nv_inference_count{{model="{model}",version="1"}}') for line in text.splitlines()), model


def test_a_corrupt_forest_fails_to_load_naming_its_file_while_the_others_serve(server):
    client = httpclient.InferenceServerClient(server["url"], network_timeout=LOAD_TIMEOUT_S)
    with pytest.raises(InferenceServerException, match=r"fil_corrupt/1/xgboost.json"):
        client.load_model("fil_corrupt")
    assert not client.is_model_ready("fil_corrupt")
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["fil_corrupt"]["state"] == "UNAVAILABLE" and "xgboost.json" in index["fil_corrupt"]["reason"]
    result = client.infer("fil_forest", [tensor(httpclient, "input__0", ROWS[:1], "FP32")])
    assert result.as_numpy("output__0").shape == (1, 2)


def test_a_treelite_checkpoint_and_a_graphdef_load_on_demand(server, model_repository):
    http = httpclient.InferenceServerClient(server["url"], network_timeout=LOAD_TIMEOUT_S)
    grpc = grpcclient.InferenceServerClient(server["grpc_url"])
    reference = xgboost.Booster(model_file=str(model_repository / "fil_treelite" / "1" / "reference.json"))
    x = np.random.default_rng(8).standard_normal((2, 8)).astype(np.float32)

    def each(action: str, model: str) -> None:  # both at once: the server runs them together
        with httpclient.InferenceServerClient(server["url"], network_timeout=LOAD_TIMEOUT_S) as client:
            getattr(client, action)(model)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(each, ["load_model"] * 2, ["fil_treelite", "tf_graphdef"]))
    try:
        for module, client in ((httpclient, http), (grpcclient, grpc)):
            classes = client.infer("fil_treelite", [tensor(module, "input__0", ROWS, "FP32")]).as_numpy("output__0")
            np.testing.assert_array_equal(classes[:, 0], np.argmax(reference.inplace_predict(ROWS), axis=1))
            out = client.infer("tf_graphdef", [tensor(module, "INPUT0", x, "FP32")]).as_numpy("Identity")
            np.testing.assert_allclose(out, mlp_reference(mlp_weights(), x), rtol=1e-5, atol=1e-6)
    finally:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(each, ["unload_model"] * 2, ["fil_treelite", "tf_graphdef"]))
