"""A ``backend: "vllm"`` model on a machine with an NVIDIA GPU and vLLM (the vllm extra): a tiny
Llama written here (random weights from a fixed seed, a word-level tokenizer trained on the
spot, nothing downloaded) served through Triton's generate extension, a gRPC stream and the
OpenAI-compatible API, a client that leaves a stream, and Triton's vLLM tensors (auto-complete
fills them in: the config names only the backend). Skipped without a GPU or vLLM."""

from __future__ import annotations

import json
import queue
import urllib.request

import numpy as np
import pytest

from conftest import HTTP_PORT, port_flags, start_server, stop_server, stop_shared_server

torch = pytest.importorskip("torch", reason="needs PyTorch (the torch or test extra)")
pytestmark = [
    pytest.mark.own_cluster,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA"),
]
vllm = pytest.importorskip("vllm", reason="needs vLLM (the vllm extra)")
transformers = pytest.importorskip("transformers", reason="needs transformers (vLLM brings it)")

PORT = HTTP_PORT + 800
WORDS = "the a movie film was is great good bad terrible and but i it this that loved hated story acting".split()
CONFIG = """backend: "vllm"
instance_group [ { count: 1 kind: KIND_GPU } ]
parameters { key: "chat_template" value: { string_value: "{% for m in messages %}{{ m['content'] }} {% endfor %}" } }
"""


def write_tiny_llama(folder) -> None:
    """A two-layer Llama with random weights and a word-level tokenizer over WORDS."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocabulary = {word: index for index, word in enumerate(["<unk>", "<s>", "</s>", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(vocabulary), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    stop_shared_server()  # one Ray cluster at a time
    repo = tmp_path_factory.mktemp("vllm_repo")
    weights = tmp_path_factory.mktemp("tiny_llama")
    write_tiny_llama(weights)
    (repo / "tiny_llama" / "1").mkdir(parents=True)
    (repo / "tiny_llama" / "config.pbtxt").write_text(CONFIG)
    (repo / "tiny_llama" / "1" / "model.json").write_text(json.dumps({
        "model": str(weights), "gpu_memory_utilization": 0.3, "enforce_eager": True, "max_model_len": 128}))
    log = tmp_path_factory.mktemp("vllm_server") / "rayinfer.log"
    proc = start_server(repo, log, [*port_flags(PORT)])
    try:
        yield f"127.0.0.1:{PORT}"
    finally:
        stop_server(proc)


def _post(url: str, path: str, doc: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://{url}{path}", json.dumps(doc).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.status, response.read()


def test_generate_and_generate_stream_give_the_same_greedy_text(vllm_server):
    settings = json.dumps({"max_tokens": 6, "temperature": 0, "ignore_eos": True})
    status, body = _post(vllm_server, "/v2/models/tiny_llama/generate",
                         {"text_input": "the movie was", "sampling_parameters": settings,
                          "exclude_input_in_output": True, "return_num_output_tokens": True})
    assert status == 200
    whole = json.loads(body)
    assert whole["num_output_tokens"] == 6 and whole["text_output"]
    status, body = _post(vllm_server, "/v2/models/tiny_llama/generate_stream",
                         {"text_input": "the movie was", "stream": True, "sampling_parameters": settings})
    events = [json.loads(line[len(b"data: "):]) for line in body.split(b"\n\n") if line.startswith(b"data: ")]
    assert len(events) >= 2
    assert "".join(e["text_output"] for e in events) == whole["text_output"]


def test_a_grpc_stream_and_the_openai_api(vllm_server):
    import openai
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{PORT + 1}")
    assert client.get_model_config("tiny_llama").config.model_transaction_policy.decoupled  # auto-completed
    received: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"i loved this film"], dtype=object))
    stream = grpcclient.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    settings = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    settings.set_data_from_numpy(np.array([json.dumps({"max_tokens": "4", "ignore_eos": True}).encode()],
                                          dtype=object))
    client.async_stream_infer("tiny_llama", [text, stream, settings])
    pieces = []
    while len(pieces) < 4:
        result, error = received.get(timeout=120)
        assert error is None, error
        pieces.append(result.as_numpy("text_output")[0])
    client.stop_stream()
    client.close()
    api = openai.OpenAI(base_url=f"http://{vllm_server}/v1", api_key="unused", max_retries=0, timeout=120)
    reply = api.chat.completions.create(model="tiny_llama", messages=[{"role": "user", "content": "a good story"}],
                                        max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 5 and reply.choices[0].message.content
    chunks = list(api.completions.create(model="tiny_llama", prompt="the acting", max_tokens=5, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True}))
    assert len([c for c in chunks if c.choices and c.choices[0].text]) >= 2
    # A client that leaves a long stream: vLLM aborts it and the model serves on.
    long = api.completions.create(model="tiny_llama", prompt="the", max_tokens=100, stream=True,
                                  extra_body={"ignore_eos": True})
    next(iter(long))
    long.close()
    again = api.completions.create(model="tiny_llama", prompt="the", max_tokens=2, extra_body={"ignore_eos": True})
    assert again.usage.completion_tokens == 2
