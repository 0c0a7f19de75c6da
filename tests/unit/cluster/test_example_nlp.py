"""The example text-classification pipeline: its configs load, and text flows through the three
members (tokenizer -> encoder -> head) and through the ensemble in this process, without Ray."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from rayinfer.adapters.loader import load_runner
from rayinfer.adapters.model_runner import ModelRunner
from rayinfer.cluster.example_nlp import LABELS, vocabulary, write_nlp_pipeline
from rayinfer.protocol.types import InferInput, InferRequest, InferResponse
from rayinfer.repository.model_config import spec_from_config
from rayinfer.repository.ensemble import parse_ensemble
from rayinfer.repository.scanner import scan_model
from rayinfer.serving.ensemble import EnsembleExecutor
from rayinfer.serving.model_core import ModelCore

MEMBERS = ("nlp_tokenizer", "nlp_encoder", "nlp_head")
TEXTS = [b"I love this great movie", b"this was terrible and I hate it", "Caf\u00e9 zyzzyva, good!".encode()]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("nlp")
    write_nlp_pipeline(root)
    return root


@pytest.fixture(scope="module")
def runners(repository: Path) -> dict[str, ModelRunner]:
    return {name: load_runner(repository, name, 1)[0] for name in MEMBERS}


def infer(runner: ModelRunner, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    datatypes = {np.dtype(object): "BYTES", np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32",
                 np.dtype(np.uint32): "UINT32"}
    request = InferRequest(runner.spec.name, inputs=[
        InferInput(name, datatypes[array.dtype], tuple(array.shape), array) for name, array in inputs.items()])
    (response,) = runner.execute([runner.prepare(request)])
    assert isinstance(response, InferResponse), response
    return {output.name: output.data for output in response.outputs}


def text_tensor(texts: list[bytes]) -> np.ndarray:
    return np.array([[text] for text in texts], dtype=object)


def encoder_inputs(tokens: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tokenizer's outputs the encoder takes (not num_input_tokens, which goes to the client)."""
    return {name: tokens[name] for name in ("input_ids", "attention_mask")}


def test_nlp_pipeline_configs_scan_without_errors(repository: Path) -> None:
    for name in (*MEMBERS, "nlp_ensemble", "nlp_embedding"):
        entry = scan_model(repository / name)
        assert entry.error is None, entry.error
        assert entry.versions == [1]


def test_nlp_tokenizer_maps_unknown_words_and_pads(runners: dict[str, ModelRunner]) -> None:
    ids = {token: i for i, token in enumerate(vocabulary())}
    out = infer(runners["nlp_tokenizer"], {"raw_text": text_tensor([b"Zyzzyva GOOD \xff movie", b"bad " * 200])})
    input_ids, mask = out["input_ids"], out["attention_mask"]
    assert input_ids.shape == mask.shape == (2, 128) and input_ids.dtype == np.int64
    assert input_ids[0, :4].tolist() == [2, 1, ids["good"], ids["movie"]]  # [CLS], unknown, ...
    assert not input_ids[0, 4:].any()
    assert mask[0].tolist() == [1] * 4 + [0] * 124
    assert input_ids[1].tolist() == [2] + [ids["bad"]] * 127 and mask[1].all()  # truncated to 128
    assert out["num_input_tokens"].tolist() == [[4], [128]]  # the tokens the encoder sees, [CLS] included


def test_nlp_tokenizer_answers_each_request_of_a_batch(runners: dict[str, ModelRunner]) -> None:
    tokenizer = runners["nlp_tokenizer"]
    together = infer(tokenizer, {"raw_text": text_tensor(TEXTS)})["input_ids"]
    requests = [InferRequest("nlp_tokenizer", inputs=[InferInput("raw_text", "BYTES", (1, 1), text_tensor([t]))])
                for t in TEXTS]
    responses = tokenizer.execute([tokenizer.prepare(r) for r in requests])
    for row, response in enumerate(responses):
        assert isinstance(response, InferResponse), response
        np.testing.assert_array_equal(response.outputs[0].data, together[row:row + 1])


def test_nlp_members_chain_text_to_a_label(runners: dict[str, ModelRunner]) -> None:
    tokens = infer(runners["nlp_tokenizer"], {"raw_text": text_tensor(TEXTS)})
    embedding = infer(runners["nlp_encoder"], encoder_inputs(tokens))["embedding"]
    assert embedding.shape == (3, 64) and embedding.dtype == np.float32 and np.isfinite(embedding).all()
    out = infer(runners["nlp_head"], {"embedding": embedding})
    labels, confidence = out["sentiment_label"], out["confidence"]
    assert labels.shape == confidence.shape == (3, 1) and confidence.dtype == np.float32
    assert {label.decode() for label in labels.ravel()} <= set(LABELS)
    assert ((confidence > 0) & (confidence <= 1)).all()


def test_nlp_encoder_ignores_padding_and_batch_neighbours(runners: dict[str, ModelRunner]) -> None:
    tokens = infer(runners["nlp_tokenizer"], {"raw_text": text_tensor(TEXTS)})
    embedding = infer(runners["nlp_encoder"], encoder_inputs(tokens))["embedding"]
    junk = tokens["input_ids"].copy()
    junk[tokens["attention_mask"] == 0] = 7  # any id behind the mask
    changed = infer(runners["nlp_encoder"], {"input_ids": junk, "attention_mask": tokens["attention_mask"]})
    np.testing.assert_allclose(changed["embedding"], embedding, atol=1e-6)
    alone = infer(runners["nlp_encoder"], {name: array[1:2] for name, array in encoder_inputs(tokens).items()})
    np.testing.assert_allclose(alone["embedding"][0], embedding[1], atol=1e-5)


def test_nlp_generation_is_deterministic(repository: Path, tmp_path: Path) -> None:
    write_nlp_pipeline(tmp_path)
    for relative in ("nlp_encoder/1/model.onnx", "nlp_tokenizer/1/vocab.txt", "nlp_ensemble/config.pbtxt"):
        assert (tmp_path / relative).read_bytes() == (repository / relative).read_bytes(), relative
    with np.load(tmp_path / "nlp_head/1/head.npz") as again, np.load(repository / "nlp_head/1/head.npz") as first:
        assert again["weight"].shape == (64, 3)
        for key in ("weight", "bias", "labels"):
            np.testing.assert_array_equal(again[key], first[key])


def test_nlp_ensemble_runs_its_three_steps(repository: Path, runners: dict[str, ModelRunner]) -> None:
    cores = {name: ModelCore(runner, [1]) for name, runner in runners.items()}

    async def call_member(request: InferRequest) -> InferResponse:
        core = cores[request.model_name]
        return await core.infer(core.prepare(request))

    entry = scan_model(repository / "nlp_ensemble")
    assert entry.config is not None
    executor = EnsembleExecutor(spec_from_config(entry.config, repository / "nlp_ensemble" / "config.pbtxt"),
                                parse_ensemble(entry.config, repository / "nlp_ensemble"), 1, call_member)
    raw = text_tensor(TEXTS[:2])
    prepared = executor.prepare(InferRequest("nlp_ensemble", inputs=[InferInput("raw_text", "BYTES", (2, 1), raw)]))
    response = asyncio.run(executor.execute_async(prepared))
    assert isinstance(response, InferResponse), response
    outputs = {output.name: output.data for output in response.outputs}
    tokens = infer(runners["nlp_tokenizer"], {"raw_text": raw})
    direct = infer(runners["nlp_head"], infer(runners["nlp_encoder"], encoder_inputs(tokens)))
    assert outputs["sentiment_label"].tolist() == direct["sentiment_label"].tolist()
    np.testing.assert_allclose(outputs["confidence"], direct["confidence"], rtol=1e-6)
