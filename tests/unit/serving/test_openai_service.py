"""The OpenAI-compatible API over the example language model (tiny_llm) and the example
embedding ensemble (nlp_embedding), run in this process: the real models and serving cores,
no Ray, no sockets (tests/compat/test_openai.py drives the same through the server with the
official client)."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rayinfer.adapters.loader import load_runner
from rayinfer.cluster.example_llm import write_language_model
from rayinfer.cluster.example_nlp import write_nlp_pipeline
from rayinfer.protocol.errors import NotFoundError, ServingError
from rayinfer.protocol.openai_requests import ModelInterface, model_interface
from rayinfer.protocol.types import InferInput, InferRequest, InferResponse
from rayinfer.repository.ensemble import parse_ensemble
from rayinfer.repository.model_config import config_to_json, spec_from_config
from rayinfer.repository.scanner import scan_model
from rayinfer.serving.ensemble import EnsembleExecutor
from rayinfer.serving.model_core import ModelCore
from rayinfer.serving.openai_service import OpenAIOptions, OpenAIService
from waiting import wait_until_async

MEMBERS = ("nlp_tokenizer", "nlp_encoder")


class ExampleModels:
    """A ModelAccess over the example models, in this process; counts the requests it sends."""

    def __init__(self, root: Path) -> None:
        self.llm = ModelCore(load_runner(root, "tiny_llm", 1)[0], [1])
        self.members = {name: ModelCore(load_runner(root, name, 1)[0], [1]) for name in MEMBERS}
        entry = scan_model(root / "nlp_embedding")
        assert entry.config is not None
        self.embedding = EnsembleExecutor(spec_from_config(entry.config, root / "nlp_embedding" / "config.pbtxt"),
                                          parse_ensemble(entry.config, root / "nlp_embedding"), 1, self._member)
        self.configs = {"tiny_llm": self.llm.config_json, "nlp_embedding": config_to_json(entry.config)}
        self.sent: list[InferRequest] = []

    async def _member(self, request: InferRequest) -> InferResponse:
        core = self.members[request.model_name]
        return await core.infer(core.prepare(request))

    async def ready_models(self) -> list[str]:
        return ["tiny_llm", "nlp_embedding"]

    async def interface(self, model: str) -> ModelInterface:
        if model not in self.configs:
            raise NotFoundError(f"Request for unknown model: '{model}' is not found")
        return model_interface(self.configs[model])

    async def stream(self, request: InferRequest) -> AsyncIterator[InferResponse | ServingError]:
        self.sent.append(request)
        if request.model_name == "nlp_embedding":
            yield await self.embedding.execute_async(self.embedding.prepare(request))
            return
        async for response in self.llm.stream(self.llm.prepare(request)):
            yield response


# One event loop for the module: the serving cores' batchers belong to the loop they first ran in.
LOOP = asyncio.new_event_loop()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> ExampleModels:
    root = tmp_path_factory.mktemp("openai")
    write_language_model(root)
    write_nlp_pipeline(root)
    return ExampleModels(root)


@pytest.fixture
def service(models: ExampleModels) -> OpenAIService:
    models.sent.clear()
    return OpenAIService(models, OpenAIOptions(default_max_tokens=6, max_choices=4, max_embedding_inputs=8))


def call(service: OpenAIService, path: str, doc: Any = None, method: str = "POST") -> tuple[int, dict, Any]:
    """(status, headers, the JSON document or, for a stream, the list of its events' data)."""

    async def run() -> tuple[int, dict, Any]:
        body = b"" if doc is None else (doc if isinstance(doc, bytes) else json.dumps(doc).encode())
        status, headers, payload = await service.respond(method, path, body)
        named = {k.decode(): v.decode() for k, v in headers}
        if isinstance(payload, bytes):
            return status, named, json.loads(payload)
        text = b"".join([chunk async for chunk in payload]).decode()
        events = [block.removeprefix("data: ") for block in text.split("\n\n") if block]
        return status, named, [e if e == "[DONE]" else json.loads(e) for e in events]

    return LOOP.run_until_complete(run())


CHAT = {"model": "tiny_llm", "messages": [{"role": "user", "content": "the movie was"}]}


def test_models_lists_the_ready_models(service: OpenAIService) -> None:
    status, _, doc = call(service, "/v1/models", method="GET")
    assert status == 200 and doc["object"] == "list"
    assert [m["id"] for m in doc["data"]] == ["nlp_embedding", "tiny_llm"]
    assert all(m["object"] == "model" and m["owned_by"] == "rayinfer" and m["created"] > 0 for m in doc["data"])
    status, _, one = call(service, "/v1/models/tiny_llm", method="GET")
    assert status == 200 and one["id"] == "tiny_llm"
    status, _, missing = call(service, "/v1/models/nope", method="GET")
    assert status == 404 and missing["error"]["code"] == "model_not_found" and "nope" in missing["error"]["message"]


def test_a_completion_counts_its_tokens_and_stops_at_max_tokens(service: OpenAIService) -> None:
    status, headers, doc = call(service, "/v1/completions", {"model": "tiny_llm", "prompt": "the movie was",
                                                              "max_tokens": 5, "seed": 3})
    assert status == 200 and headers["content-type"] == "application/json"
    assert doc["object"] == "text_completion" and doc["id"].startswith("cmpl-") and doc["model"] == "tiny_llm"
    (choice,) = doc["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["text"]
    assert doc["usage"]["completion_tokens"] == 5 and doc["usage"]["prompt_tokens"] > 0
    assert doc["usage"]["total_tokens"] == doc["usage"]["prompt_tokens"] + 5
    again = call(service, "/v1/completions", {"model": "tiny_llm", "prompt": "the movie was", "max_tokens": 5,
                                              "seed": 3})[2]
    assert again["choices"][0]["text"] == choice["text"]  # a seed repeats its sampling
    # max_tokens defaults to the flag's value (--openai-default-max-tokens), here 6.
    default = call(service, "/v1/completions", {"model": "tiny_llm", "prompt": "hi"})[2]
    assert default["usage"]["completion_tokens"] == 6
    # The model gets the vLLM backend's tensors.
    sent = service_request(service, "/v1/completions", {"model": "tiny_llm", "prompt": "hi", "temperature": 0.5})
    names = {i.name for i in sent.inputs}
    assert {"text_input", "stream", "sampling_parameters", "exclude_input_in_output"} <= names
    sampling = json.loads(next(i for i in sent.inputs if i.name == "sampling_parameters").data.ravel()[0])
    assert sampling["temperature"] == 0.5 and sampling["max_tokens"] == 6


def service_request(service: OpenAIService, path: str, doc: dict) -> InferRequest:
    models: ExampleModels = service._access  # type: ignore[assignment]
    models.sent.clear()
    assert call(service, path, doc)[0] == 200
    return models.sent[0]


def test_a_stop_sequence_ends_the_text_before_it(service: OpenAIService) -> None:
    base = {"model": "tiny_llm", "prompt": "the movie was", "max_tokens": 12, "seed": 11}
    text = call(service, "/v1/completions", base)[2]["choices"][0]["text"]
    words = text.split()
    assert len(words) >= 3
    stop = " " + words[2]
    cut = call(service, "/v1/completions", {**base, "stop": [stop]})[2]["choices"][0]
    assert cut["finish_reason"] == "stop" and stop not in cut["text"]
    assert text.startswith(cut["text"])


def test_echo_puts_the_prompt_before_the_text(service: OpenAIService) -> None:
    doc = call(service, "/v1/completions", {"model": "tiny_llm", "prompt": ["good film", "bad film"], "max_tokens": 2,
                                            "echo": True, "seed": 1})[2]
    assert [c["index"] for c in doc["choices"]] == [0, 1]
    assert doc["choices"][0]["text"].startswith("good film") and doc["choices"][1]["text"].startswith("bad film")


def test_chat_renders_the_models_template_and_answers_n_choices(service: OpenAIService) -> None:
    status, _, doc = call(service, "/v1/chat/completions", {**CHAT, "max_tokens": 4, "n": 2, "seed": 5,
                                                            "logprobs": True, "top_logprobs": 2})
    assert status == 200 and doc["object"] == "chat.completion" and doc["id"].startswith("chatcmpl-")
    assert [c["index"] for c in doc["choices"]] == [0, 1]
    for choice in doc["choices"]:
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
        content = choice["logprobs"]["content"]
        assert len(content) == 4 and "".join(t["token"] for t in content) == choice["message"]["content"]
        for token in content:
            assert token["logprob"] <= 0 and len(token["top_logprobs"]) == 2
            assert token["top_logprobs"][0]["logprob"] >= token["top_logprobs"][1]["logprob"]
    assert doc["usage"]["completion_tokens"] == 8  # both choices'
    # The prompt is the model's chat_template applied to the messages.
    sent = service_request(service, "/v1/chat/completions", CHAT)
    prompt = next(i for i in sent.inputs if i.name == "text_input").data.ravel()[0]
    assert b"the movie was" in prompt and prompt != b"the movie was"


def test_a_chat_stream_sends_a_role_then_deltas_then_usage_and_done(service: OpenAIService) -> None:
    status, headers, events = call(service, "/v1/chat/completions", {
        **CHAT, "max_tokens": 3, "stream": True, "n": 2, "stream_options": {"include_usage": True},
        "seed": 3})  # a seed whose choices make 3 tokens each (without one, a choice may end at [EOS])
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
        assert mine[0]["delta"].get("role") == "assistant"
        assert mine[-1]["finish_reason"] == "length"
        assert sum(1 for c in mine if c["delta"].get("content")) == 3


def test_a_completion_stream_with_echo_and_logprobs(service: OpenAIService) -> None:
    status, _, events = call(service, "/v1/completions", {"model": "tiny_llm", "prompt": "good", "max_tokens": 3,
                                                          "stream": True, "echo": True, "logprobs": 2, "seed": 2})
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    assert chunks[0]["text"] == "good"
    tokens = [c for c in chunks if c["logprobs"]]
    assert len(tokens) == 3
    assert all(len(c["logprobs"]["top_logprobs"][0]) <= 2 for c in tokens)
    assert chunks[-1]["finish_reason"] == "length"


def test_embeddings_as_floats_and_base64(service: OpenAIService) -> None:
    texts = ["I love this great movie", "this was terrible", "ok", "fine", "bad", "good", "meh"]
    status, _, doc = call(service, "/v1/embeddings", {"model": "nlp_embedding", "input": texts})
    assert status == 200 and doc["object"] == "list" and doc["model"] == "nlp_embedding"
    assert [d["index"] for d in doc["data"]] == list(range(7))
    vectors = np.array([d["embedding"] for d in doc["data"]], dtype=np.float32)
    assert vectors.shape == (7, 64) and np.isfinite(vectors).all()
    assert doc["usage"]["prompt_tokens"] == doc["usage"]["total_tokens"] > 7
    one = call(service, "/v1/embeddings", {"model": "nlp_embedding", "input": "ok"})[2]
    np.testing.assert_allclose(one["data"][0]["embedding"], vectors[2], atol=1e-5)  # no batch neighbours
    encoded = call(service, "/v1/embeddings", {"model": "nlp_embedding", "input": texts[:2],
                                               "encoding_format": "base64"})[2]
    decoded = np.frombuffer(base64.b64decode(encoded["data"][1]["embedding"]), dtype=np.float32)
    np.testing.assert_allclose(decoded, vectors[1], atol=1e-5)
    status, _, error = call(service, "/v1/embeddings", {"model": "nlp_embedding", "input": ["x"] * 9})
    assert status == 400 and error["error"]["param"] == "input"  # --openai-max-embedding-inputs is 8 here


@pytest.mark.parametrize(("path", "doc", "status", "param", "words"), [
    ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404, None, "nope"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", "messages"),
    ("/v1/chat/completions", {**CHAT, "n": 5}, 400, "n", "4"),  # --openai-max-choices is 4 here
    ("/v1/chat/completions", {**CHAT, "temperature": 3}, 400, "temperature", "temperature"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "stop"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools", "tools"),
    ("/v1/completions", {"model": "tiny_llm"}, 400, "prompt", "prompt"),
    ("/v1/completions", {"model": "tiny_llm", "prompt": "x", "logprobs": 9}, 400, "logprobs", "logprobs"),
    ("/v1/completions", b"{not json", 400, None, "JSON"),
    ("/v1/embeddings", {"model": "tiny_llm", "input": "x"}, 400, None, "embedding"),
    ("/v1/completions", {"model": "nlp_embedding", "prompt": "x"}, 400, None, "language model"),
])
def test_bad_requests_get_openais_error_shape(service: OpenAIService, path: str, doc: Any, status: int,
                                              param: str | None, words: str) -> None:
    got, headers, body = call(service, path, doc)
    assert got == status and headers["content-type"] == "application/json"
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"  # OpenAI's, for an unknown model too
    assert error["code"] == ("model_not_found" if status == 404 else None)
    assert error["param"] == param and words in error["message"]


def test_an_error_the_model_answers_at_once_is_an_answer_not_a_stream(service: OpenAIService) -> None:
    status, headers, body = call(service, "/v1/chat/completions", {**CHAT, "max_tokens": 100000, "stream": True})
    assert status == 400 and headers["content-type"] == "application/json"
    assert "max_tokens" in body["error"]["message"]


def test_unknown_routes_and_methods(service: OpenAIService) -> None:
    assert call(service, "/v1/nothing", {})[0] == 404
    status, headers, _ = call(service, "/v1/chat/completions", method="GET")
    assert status == 405 and headers["allow"] == "POST"
    status, headers, _ = call(service, "/v1/models", {}, method="POST")
    assert status == 405 and headers["allow"] == "GET"


def test_a_stream_given_up_cancels_the_models_request(service: OpenAIService, models: ExampleModels) -> None:
    async def run() -> None:
        status, _, body = await service.respond("POST", "/v1/completions", json.dumps(
            {"model": "tiny_llm", "prompt": "go", "max_tokens": 4000, "stream": True}).encode())
        assert status == 200 and not isinstance(body, bytes)
        first = await body.__anext__()
        assert first.startswith(b"data: ")
        await body.aclose()  # type: ignore[attr-defined]
        # The model stops well before its 4000 tokens: a fresh request is answered at once.
        status, _, doc = await asyncio.wait_for(service.respond("POST", "/v1/completions", json.dumps(
            {"model": "tiny_llm", "prompt": "go", "max_tokens": 2}).encode()), 30)
        assert status == 200 and json.loads(doc)["usage"]["completion_tokens"] == 2  # type: ignore[arg-type]

    LOOP.run_until_complete(run())


def test_usage_counts_a_choice_the_model_ended_at_once_as_no_tokens() -> None:
    from rayinfer.protocol import openai_responses as answers

    made = answers.Choice(0, 3, input_tokens=4, output_tokens=3)
    ended_at_once = answers.Choice(1, 3)  # no response with counts: the model's first token ended it
    assert answers.usage([made, ended_at_once], [4]) == {"prompt_tokens": 4, "completion_tokens": 3,
                                                         "total_tokens": 7}
    assert answers.usage([answers.Choice(0, 3), answers.Choice(1, 3)], [None]) is None  # a model without counts
    assert answers.usage([made, answers.Choice(1, 3, text="words")], [4]) is None  # text with no count: unknown


@pytest.mark.parametrize("seed", [3, 168, 236])  # 168 and 236: a choice ends at [EOS] at once
def test_a_streams_usage_is_given_whatever_its_choices_make(service: OpenAIService, seed: int) -> None:
    _, _, events = call(service, "/v1/chat/completions", {
        **CHAT, "max_tokens": 3, "stream": True, "n": 2, "stream_options": {"include_usage": True}, "seed": seed})
    usage = events[-2]["usage"]
    assert usage is not None and 0 <= usage["completion_tokens"] <= 6
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_a_stream_cancelled_while_the_model_waits_for_room_ends_alone_and_is_counted(models: ExampleModels) -> None:
    """tiny_llm's send waits while --max-queued-responses of its responses are not taken (here
    2); the client goes away meanwhile: that send raises, the generation ends counted in
    tiny_llm_cancelled, and the model's loop serves on (it used to fail every generation under
    way and stop)."""
    core = models.llm
    cancelled = core.executor.adapter.model.cancelled
    limit = core.max_queued_responses
    core.max_queued_responses = 2

    async def run() -> None:
        before = cancelled.value()
        prepared = core.prepare(_llm_request(4000, stream=True))
        responses = core.stream(prepared)
        await responses.__anext__()
        await wait_until_async(lambda: prepared.sender._queued >= 2, "the model's send to wait for room")
        await responses.aclose()  # the client went away
        await wait_until_async(lambda: cancelled.value() == before + 1, "the generation counted as cancelled")
        answered = [r async for r in core.stream(core.prepare(_llm_request(2)))]
        assert answered and all(isinstance(r, InferResponse) for r in answered)  # no error

    try:
        LOOP.run_until_complete(run())
    finally:
        core.max_queued_responses = limit


def _llm_request(max_tokens: int, stream: bool = False) -> InferRequest:
    settings = json.dumps({"max_tokens": max_tokens, "ignore_eos": True}).encode()
    return InferRequest("tiny_llm", inputs=[
        InferInput("text_input", "BYTES", (1,), np.array([b"go"], dtype=np.object_)),
        InferInput("stream", "BOOL", (1,), np.array([stream])),
        InferInput("sampling_parameters", "BYTES", (1,), np.array([settings], dtype=np.object_))])
