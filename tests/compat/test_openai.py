"""The OpenAI-compatible API (``/v1`` on the HTTP port) judged by OpenAI's own Python client:
tiny_llm (the example language model) and nlp_embedding (the example embedding ensemble) of the
session server, chat and completions streaming and not, embeddings, errors, a client that leaves
a stream, and many streams at once."""

from __future__ import annotations

import http.client
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import tritonclient.http as httpclient

from conftest import metric_value
from waiting import wait_until

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the movie was"}]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"http://{server['url']}/v1", api_key="not-checked", max_retries=0,
                       timeout=60) as client:
        yield client


def test_the_model_list_holds_the_ready_models(client):
    listed = {model.id: model for model in client.models.list()}
    assert {"tiny_llm", "nlp_embedding", "simple"} <= set(listed)
    assert listed["tiny_llm"].object == "model" and listed["tiny_llm"].owned_by == "rayinfer"
    assert client.models.retrieve("tiny_llm").id == "tiny_llm"
    assert "on_demand_never_loaded" not in listed  # in the repository, not loaded (model control)
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no_such_model")
    assert missing.value.code == "model_not_found" and "no_such_model" in missing.value.message


def test_a_chat_completion_with_choices_from_one_seed(client):
    """n choices, each its own request to the model (choice i samples with seed + i): the same
    seed gives the same choices again, and usage counts the prompt once and every choice's tokens."""
    reply = client.chat.completions.create(model="tiny_llm", messages=CHAT, n=2, max_tokens=5, seed=7,
                                           temperature=0.9, extra_body={"ignore_eos": True})
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-") and reply.model == "tiny_llm"
    assert [choice.index for choice in reply.choices] == [0, 1]
    for choice in reply.choices:
        assert choice.message.role == "assistant" and choice.finish_reason == "length"
        assert len(choice.message.content.split()) == 5  # a token is a word of the vocabulary
    assert reply.choices[0].message.content != reply.choices[1].message.content
    usage = reply.usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens == 10
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    again = client.chat.completions.create(model="tiny_llm", messages=CHAT, n=2, max_tokens=5, seed=7,
                                           temperature=0.9, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]


def test_a_streamed_completion_is_the_text_of_a_whole_one(client):
    """Token by token (one event each) or whole, a prompt and a seed give one text; with
    include_usage the last chunk carries the usage and no choice."""
    args = {"model": "tiny_llm", "prompt": "the movie was", "max_tokens": 6, "seed": 3, "temperature": 0.8,
            "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**args)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    pieces = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert len(pieces) == 7 and "".join(pieces) == whole.choices[0].text  # a token each, then the finish
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    echoed = client.completions.create(**args, echo=True)
    assert echoed.choices[0].text == "the movie was" + whole.choices[0].text


def test_stop_and_top_p_shape_the_text(client):
    """A stop word ends the text before it (finish_reason stop); a top_p that keeps one token
    samples greedily, as temperature 0 does."""
    args = {"model": "tiny_llm", "prompt": "the movie was", "max_tokens": 6, "seed": 11, "extra_body": {"ignore_eos": True}}
    words = client.completions.create(**args).choices[0].text.split()
    cut = client.completions.create(**args, stop=[words[3]]).choices[0]
    assert cut.finish_reason == "stop" and cut.text.split() == words[:words.index(words[3])]
    greedy = client.completions.create(**args, temperature=0).choices[0].text
    assert client.completions.create(**args, top_p=1e-6).choices[0].text == greedy


def test_a_streamed_chat_sends_the_role_then_the_content(client):
    reply = client.chat.completions.create(model="tiny_llm", messages=CHAT, max_tokens=4, seed=1, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny_llm", messages=CHAT, max_tokens=4, seed=1,
                                                 temperature=0, stream=True))
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason


def test_log_probabilities_where_the_model_gives_them(client):
    reply = client.chat.completions.create(model="tiny_llm", messages=CHAT, max_tokens=3, seed=2,
                                           logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    tokens = reply.choices[0].logprobs.content
    assert len(tokens) == 3 and "".join(t.token for t in tokens) == reply.choices[0].message.content
    for token in tokens:
        assert token.logprob <= 0 and len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob


def test_embeddings_are_the_ensembles_outputs(client, server):
    """The client asks for base64 by default; floats give the same vectors, which are what the
    ensemble answers over Triton's protocol."""
    texts = ["I love this great movie", "this was terrible"]
    result = client.embeddings.create(model="nlp_embedding", input=texts)
    assert result.object == "list" and result.model == "nlp_embedding"
    vectors = np.array([item.embedding for item in result.data])
    assert [item.index for item in result.data] == [0, 1] and vectors.shape == (2, 64)
    assert result.usage.prompt_tokens > 0 and result.usage.total_tokens == result.usage.prompt_tokens
    floats = client.embeddings.create(model="nlp_embedding", input=texts, encoding_format="float")
    np.testing.assert_allclose(np.array([item.embedding for item in floats.data]), vectors, rtol=1e-6)
    triton = httpclient.InferenceServerClient(server["url"])
    tensor = httpclient.InferInput("text_input", [2, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object))
    np.testing.assert_allclose(triton.infer("nlp_embedding", [tensor]).as_numpy("embedding"), vectors, rtol=1e-5)
    triton.close()


def test_errors_have_openais_shape_and_name_what_is_wrong(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="no_such_model", messages=CHAT)
    assert "no_such_model" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny_llm", messages=CHAT, temperature=5)
    assert error.value.param == "temperature" and error.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="simple", messages=CHAT)
    assert "model 'simple' is not a language model" in error.value.message
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model="tiny_llm", input="text")
    assert "not an embedding model" in error.value.message
    # The model's own refusal (its first response), streaming or not: an error answer, not a stream.
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model="tiny_llm", prompt="a", max_tokens=10**6, stream=stream)
        assert "max_tokens must be from 0 to 4096" in error.value.message


def test_a_body_that_is_not_json_is_a_400_naming_the_request(server):
    host, port = server["url"].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("POST", "/v1/chat/completions", b"{not json", {"content-type": "application/json"})
        response = connection.getresponse()
        doc = json.loads(response.read())
    finally:
        connection.close()
    assert response.status == 400 and doc["error"]["type"] == "invalid_request_error"
    assert "chat completion request" in doc["error"]["message"]


def test_a_client_that_leaves_a_stream_cancels_the_generation_and_the_model_serves_on(client, server):
    """tiny_llm counts the generations it stopped because their request was cancelled."""
    counter = 'tiny_llm_cancelled{model="tiny_llm"}'
    before = metric_value(server, counter)
    stream = client.completions.create(model="tiny_llm", prompt="go on", max_tokens=4000, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].text
    stream.close()
    wait_until(lambda: metric_value(server, counter) >= before + 1, "tiny_llm to see its request cancelled",
               timeout_s=30)
    assert client.completions.create(model="tiny_llm", prompt="go on", max_tokens=2,
                                     extra_body={"ignore_eos": True}).usage.completion_tokens == 2


def test_many_streams_at_once_each_get_their_own_text(client):
    """Sixteen chat streams at once (tiny_llm batches them, a token of each per step): each is
    the text its seed gives when asked alone."""

    def streamed(seed: int) -> str:
        chunks = client.chat.completions.create(model="tiny_llm", messages=CHAT, max_tokens=8, seed=seed,
                                                stream=True, extra_body={"ignore_eos": True})
        return "".join(chunk.choices[0].delta.content or "" for chunk in chunks)

    seeds = list(range(16))
    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(streamed, seeds))
    assert all(len(text.split()) == 8 for text in texts)
    assert len(set(texts)) > 1
    alone = client.chat.completions.create(model="tiny_llm", messages=CHAT, max_tokens=8, seed=5,
                                           extra_body={"ignore_eos": True})
    assert alone.choices[0].message.content == texts[5]


def test_time_to_first_response_is_in_tritons_histogram(client, server):
    """--metrics-config histogram_latencies=true (the session server's): each generation's
    first token counts in nv_inference_first_response_histogram_ms, whatever way it came (the
    earlier tests' may still be on their way to the metrics port: at least these three)."""
    count = 'nv_inference_first_response_histogram_ms_count{model="tiny_llm",version="1"}'
    before = metric_value(server, count)
    list(client.completions.create(model="tiny_llm", prompt="a", max_tokens=5, stream=True,
                                   extra_body={"ignore_eos": True}))
    client.completions.create(model="tiny_llm", prompt="a", max_tokens=5, n=2, extra_body={"ignore_eos": True})
    wait_until(lambda: metric_value(server, count) >= before + 3, "three first responses in the histogram",
               timeout_s=30)
    with urllib.request.urlopen(server["metrics_url"], timeout=10) as response:  # one scrape
        samples = dict(line.rsplit(" ", 1) for line in response.read().decode().splitlines()
                       if line.startswith("nv_inference_first_response_histogram_ms") and 'model="tiny_llm"' in line)
    buckets = [float(samples[f'nv_inference_first_response_histogram_ms_bucket{{model="tiny_llm",version="1",'
                                f'le="{le}"}}']) for le in ("100", "500", "2000", "5000", "+Inf")]
    assert buckets == sorted(buckets) and buckets[-1] == float(samples[count]) >= before + 3
