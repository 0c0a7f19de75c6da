"""Writes an example language model into a model repository, built in code: ``tiny_llm``.

A decoupled Python model with the tensor names of Triton's vLLM backend: ``text_input`` (the
prompt), optional ``stream`` (send each token as it is made, else one response with the whole
text), ``sampling_parameters`` (a JSON object: ``max_tokens``, at most 4096, ``temperature``,
``top_p``, ``seed``, ``stop``, ``ignore_eos``, ``logprobs``: top log probabilities per token, at most 20) and
``exclude_input_in_output``; it answers ``text_output``, and with ``return_num_input_tokens``,
``return_num_output_tokens`` and ``return_logprobs`` also ``num_input_tokens``,
``num_output_tokens`` (in each streamed response: the tokens it carries) and ``logprobs`` (vLLM's
JSON: per token, the sampled one first, then the top ones, each with its log probability, rank
and text). The request's parameters of the same names override the sampling parameters, so that
a generate request can give them as plain members. Its config's ``chat_template`` parameter is
the chat template the OpenAI-compatible API renders messages with.

The tokenizer is written on the spot: the words of the example text pipeline's vocabulary
(:mod:`example_nlp`), one id each, and ``[EOS]``. The decoder is a small recurrent network whose
weights are random from a fixed seed: its text is not meaningful, but every generation writes
the same model and the same prompt and seed give the same text. Concurrent generations are
batched: up to 32 advance together, one token each per step of one loop (one matrix product for
all), and a new request joins at the next step (continuous batching, as vLLM does); more wait
for a place. A cancelled request (the client went away) stops at the next step, counted in the
metric ``tiny_llm_cancelled``.
"""

from __future__ import annotations

from pathlib import Path

from rayinfer.cluster.example_nlp import vocabulary
from rayinfer.cluster.model_files import write_python_model

LLM_CONFIG = """name: "tiny_llm"
backend: "python"
max_batch_size: 0
input [
  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "sampling_parameters" data_type: TYPE_STRING dims: [ 1 ] optional: true },
  { name: "exclude_input_in_output" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "return_num_input_tokens" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "return_num_output_tokens" data_type: TYPE_BOOL dims: [ 1 ] optional: true },
  { name: "return_logprobs" data_type: TYPE_BOOL dims: [ 1 ] optional: true }
]
output [
  { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] },
  { name: "num_input_tokens" data_type: TYPE_UINT32 dims: [ 1 ] },
  { name: "num_output_tokens" data_type: TYPE_UINT32 dims: [ 1 ] },
  { name: "logprobs" data_type: TYPE_STRING dims: [ 1 ] }
]
model_transaction_policy { decoupled: true }
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "chat_template" value: { string_value: "%s" } }
"""

# The chat template (Jinja2, as a Hugging Face tokenizer's): each message on a line, then the
# assistant's turn. Written into the config above, its quotes escaped.
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")

LLM_MODEL = '''import json
import os
import queue
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

HIDDEN = 64
MAX_TOKENS = 4096  # the most a request may ask for
MAX_LOGPROBS = 20  # top log probabilities a token may carry
BATCH = 32  # generations that advance together, one token each per step; more wait for a place
DEFAULTS = {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "seed": 0, "stop": [], "logprobs": None,
            "ignore_eos": False}


class Generation:
    """One request being answered: its sampling settings, state and what it made so far."""

    def __init__(self, request, settings, prompt_tokens, state, text):
        self.sender = request.get_response_sender()
        self.settings = settings
        self.rng = np.random.default_rng(int(settings["seed"]))
        self.prompt_tokens = prompt_tokens
        self.state = state
        self.text = text
        self.made = 0
        self.done = False  # its final response sent
        self.logprobs = []
        self.stop = {str(word).strip().lower() for word in settings["stop"]}  # words of the vocabulary
        self.stream = flag(request, "stream")
        self.counts = (flag(request, "return_num_input_tokens"), flag(request, "return_num_output_tokens"))
        self.with_logprobs = flag(request, "return_logprobs") and settings["logprobs"] is not None


def flag(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return tensor is not None and bool(tensor.as_numpy().reshape(-1)[0])


class TritonPythonModel:
    def initialize(self, args):
        path = os.path.join(args["model_repository"], args["model_version"], "vocab.txt")
        with open(path, encoding="utf-8") as vocab:
            self.words = [line.rstrip("\\n") for line in vocab if line.strip()]
        self.ids = {word: index for index, word in enumerate(self.words)}
        self.eos = self.ids["[EOS]"]
        self.unk = self.ids["[UNK]"]
        rng = np.random.default_rng(0)  # the weights: random, the same every time
        size = len(self.words)
        self.embedding = rng.normal(0, 1, (size, HIDDEN)).astype(np.float32)
        self.recurrent = rng.normal(0, 1 / np.sqrt(HIDDEN), (HIDDEN, HIDDEN)).astype(np.float32)
        self.output = rng.normal(0, 2 / np.sqrt(HIDDEN), (HIDDEN, size)).astype(np.float32)
        self.banned = [self.ids["[PAD]"], self.ids["[CLS]"]]
        # The family is kept as long as its metric (Triton's rule for custom metrics).
        self.cancelled_family = pb_utils.MetricFamily(
            name="tiny_llm_cancelled", description="Generations stopped because their request was cancelled",
            kind=pb_utils.MetricFamily.COUNTER)
        self.cancelled = self.cancelled_family.Metric(labels={"model": "tiny_llm"})
        self.waiting = queue.Queue()
        self.stopping = threading.Event()
        self.loop = threading.Thread(target=self.generate_forever, name="tiny_llm", daemon=True)
        self.loop.start()

    def execute(self, requests):
        for request in requests:
            try:
                self.waiting.put(self.start(request))
            except (ValueError, TypeError, KeyError) as exc:  # the request's settings
                self.fail(request.get_response_sender(), f"tiny_llm: {exc}", pb_utils.TritonError.INVALID_ARG)
        return None

    def tokens(self, text):
        return [self.ids.get(word, self.unk) for word in text.lower().split()]

    def settings(self, request):
        settings = dict(DEFAULTS)
        raw = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
        if raw is not None:
            settings.update(json.loads(raw.as_numpy().reshape(-1)[0]))
        given = json.loads(request.parameters())
        settings.update({key: value for key, value in given.items() if key in DEFAULTS})
        if not 0 <= int(settings["max_tokens"]) <= MAX_TOKENS:
            raise ValueError(f"max_tokens must be from 0 to {MAX_TOKENS}, not {settings['max_tokens']}")
        if not 0 < float(settings["top_p"]) <= 1:
            raise ValueError(f"top_p must be over 0 and at most 1, not {settings['top_p']}")
        if settings["logprobs"] is not None and not 0 <= int(settings["logprobs"]) <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be from 0 to {MAX_LOGPROBS}, not {settings['logprobs']}")
        if not isinstance(settings["stop"], list):
            settings["stop"] = [settings["stop"]]
        return settings

    def start(self, request):
        """A request's generation, its state past the prompt."""
        prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
        prompt = prompt.decode("utf-8") if isinstance(prompt, bytes) else str(prompt)
        settings = self.settings(request)
        tokens = self.tokens(prompt)
        state = np.zeros(HIDDEN, np.float32)
        for token in tokens or [self.unk]:
            state = np.tanh(self.embedding[token] + state @ self.recurrent)
        keep_prompt = not (flag(request, "exclude_input_in_output") or flag(request, "stream"))
        return Generation(request, settings, len(tokens), state, prompt if keep_prompt else "")

    def take_waiting(self, active):
        """Move waiting generations into ``active`` up to BATCH: wait up to 0.1 s for one when
        none is under way, else take only those already waiting."""
        while len(active) < BATCH:
            try:
                active.append(self.waiting.get(timeout=0.1) if not active else self.waiting.get_nowait())
            except queue.Empty:
                return

    def generate_forever(self):
        """Advance every generation under way by one token per step, together (one matrix
        product for all of them); a new request joins at the next step."""
        active = []
        while not self.stopping.is_set():
            self.take_waiting(active)
            if active:
                try:
                    active = self.step(active)
                except Exception as exc:  # the generations under way fail; the loop serves on
                    for generation in active:
                        if not generation.done:  # not finished before the failure
                            self.fail(generation.sender, f"tiny_llm: {exc}", pb_utils.TritonError.INTERNAL)
                    active = []
        for generation in active:
            self.finish(generation)

    def step(self, active):
        going = []
        for generation in active:
            if generation.sender.is_cancelled():
                self.cancelled.increment(1)
                self.finish(generation)
            elif generation.made >= int(generation.settings["max_tokens"]):
                self.finish(generation)
            else:
                going.append(generation)
        if not going:
            return going
        logits = np.stack([g.state for g in going]) @ self.output
        logits[:, self.banned] = -np.inf
        for row, generation in enumerate(going):
            if generation.settings["ignore_eos"]:  # vLLM's: it runs to max_tokens
                logits[row, self.eos] = -np.inf
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        tokens = []
        kept = []
        for row, generation in enumerate(going):
            token = self.sample(logits[row], generation)
            if token == self.eos or self.words[token] in generation.stop:
                self.finish(generation)
                continue
            generation.made += 1
            piece = " " + self.words[token]
            entry = self.logprob_entry(log_probs[row], token, generation) if generation.with_logprobs else None
            if generation.stream:
                try:
                    generation.sender.send(self.answer(generation, piece, 1, [entry] if entry else None))
                except pb_utils.TritonModelException:
                    if not generation.sender.is_cancelled():
                        raise
                    # Cancelled while its send waited for the client to take the responses
                    # before it: this generation ends here, the others go on.
                    self.cancelled.increment(1)
                    self.finish(generation)
                    continue
            else:
                generation.text += piece
                if entry:
                    generation.logprobs.append(entry)
            tokens.append(token)
            kept.append(generation)
        if kept:
            states = np.tanh(self.embedding[tokens] + np.stack([g.state for g in kept]) @ self.recurrent)
            for generation, state in zip(kept, states):
                generation.state = state
        return kept

    def sample(self, logits, generation):
        temperature = float(generation.settings["temperature"])
        if temperature <= 0:
            return int(np.argmax(logits))
        weights = np.exp((logits - logits.max()) / temperature)
        weights /= weights.sum()
        order = np.argsort(-weights)
        keep = order[: int(np.searchsorted(np.cumsum(weights[order]), float(generation.settings["top_p"]))) + 1]
        return int(generation.rng.choice(keep, p=weights[keep] / weights[keep].sum()))

    def logprob_entry(self, log_probs, token, generation):
        """vLLM's log probabilities of one position: the sampled token first, then the top ones."""
        top = int(generation.settings["logprobs"])
        entry = {str(token): {"logprob": float(log_probs[token]), "rank": int((log_probs > log_probs[token]).sum()) + 1,
                              "decoded_token": " " + self.words[token]}}
        for rank, other in enumerate(np.argsort(-log_probs)[:top], start=1):
            entry.setdefault(str(int(other)), {"logprob": float(log_probs[other]), "rank": rank,
                                               "decoded_token": " " + self.words[int(other)]})
        return entry

    def finish(self, generation):
        if not generation.stream and not generation.sender.is_cancelled():
            generation.sender.send(self.answer(generation, generation.text, generation.made,
                                               generation.logprobs if generation.with_logprobs else None))
        generation.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        generation.done = True

    def answer(self, generation, text, made, logprobs):
        outputs = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object))]
        if generation.counts[0]:
            outputs.append(pb_utils.Tensor("num_input_tokens", np.array([generation.prompt_tokens], np.uint32)))
        if generation.counts[1]:
            outputs.append(pb_utils.Tensor("num_output_tokens", np.array([made], np.uint32)))
        if logprobs is not None:
            outputs.append(pb_utils.Tensor("logprobs", np.array([json.dumps(logprobs).encode()], dtype=object)))
        return pb_utils.InferenceResponse(outputs)

    def fail(self, sender, message, code):
        """The error as the request's last response; a request whose client is gone gets only
        the final flag (a send for it raises, and the generation loop must go on)."""
        try:
            if not sender.is_cancelled():
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)))
        except pb_utils.TritonModelException:
            if not sender.is_cancelled():
                raise
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        self.stopping.set()  # generations under way end at the next step
        self.loop.join(timeout=10)
'''


def write_language_model(repository: Path) -> list[Path]:
    """Write ``tiny_llm`` with its vocabulary; returns its folder."""
    config = LLM_CONFIG % CHAT_TEMPLATE.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    folder = write_python_model(repository, "tiny_llm", config, LLM_MODEL)
    words = [word for word in vocabulary() if word not in ("[EOS]",)] + ["[EOS]"]
    (folder / "1" / "vocab.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
    return [folder]
