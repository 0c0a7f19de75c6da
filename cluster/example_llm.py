"""Writes an example language model into a model repository, built in code: ``tiny_llm``.

A decoupled Python model with the tensor names of Triton's vLLM backend: ``text_input`` (the
prompt), optional ``stream`` (send each token as it is made, else one response with the whole
text), ``sampling_parameters`` (a JSON object: ``max_tokens``, at most 4096, ``temperature``,
``top_p``, ``seed``, ``stop``) and ``exclude_input_in_output``; it answers ``text_output``. The
request's parameters of the same names override the sampling parameters, so that a generate
request can give them as plain members. The tokenizer is written on the spot: the words of the example text
pipeline's vocabulary (:mod:`example_nlp`), one id each, and ``[EOS]``. The decoder is a small
recurrent network whose weights are random from a fixed seed: its text is not meaningful, but
every generation writes the same model and the same prompt and seed give the same text. A
cancelled request (the client went away) stops generating. Eight requests generate at once; the
others wait for one of them to end.
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
  { name: "exclude_input_in_output" data_type: TYPE_BOOL dims: [ 1 ] optional: true }
]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] } ]
model_transaction_policy { decoupled: true }
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

LLM_MODEL = '''import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

HIDDEN = 64
MAX_TOKENS = 4096  # the most a request may ask for
GENERATIONS = 8  # generations at once; more requests wait for one to end
DEFAULTS = {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "seed": 0, "stop": []}


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
        self.pool = ThreadPoolExecutor(GENERATIONS, thread_name_prefix="tiny_llm")
        self.stopping = threading.Event()

    def execute(self, requests):
        for request in requests:
            self.pool.submit(self.generate, request)
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
        return settings

    def flag(self, request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return tensor is not None and bool(tensor.as_numpy().reshape(-1)[0])

    def generate(self, request):
        sender = request.get_response_sender()
        try:
            prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
            prompt = prompt.decode("utf-8") if isinstance(prompt, bytes) else str(prompt)
            settings = self.settings(request)
            stream = self.flag(request, "stream")
            text = "" if self.flag(request, "exclude_input_in_output") or stream else prompt
            for piece in self.pieces(prompt, settings, sender):
                if stream:
                    sender.send(self.answer(piece))
                text += piece
            if not stream:
                sender.send(self.answer(text))
        except (ValueError, TypeError, KeyError) as exc:  # the request's settings
            sender.send(pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"tiny_llm: {exc}", pb_utils.TritonError.INVALID_ARG)))
        except Exception as exc:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"tiny_llm: {exc}")))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def pieces(self, prompt, settings, sender):
        """The generated text, a word at a time (a leading space before each)."""
        rng = np.random.default_rng(int(settings["seed"]))
        state = np.zeros(HIDDEN, np.float32)
        for token in self.tokens(prompt) or [self.unk]:
            state = np.tanh(self.embedding[token] + state @ self.recurrent)
        stop = settings["stop"] if isinstance(settings["stop"], list) else [settings["stop"]]
        stop = {str(word).lower() for word in stop}  # words of the vocabulary, which is lowercase
        for _ in range(int(settings["max_tokens"])):
            if sender.is_cancelled() or self.stopping.is_set():
                return
            logits = state @ self.output
            logits[self.ids["[PAD]"]] = logits[self.ids["[CLS]"]] = -np.inf
            token = self.sample(logits, float(settings["temperature"]), float(settings["top_p"]), rng)
            if token == self.eos or self.words[token] in stop:
                return
            yield " " + self.words[token]
            state = np.tanh(self.embedding[token] + state @ self.recurrent)

    def sample(self, logits, temperature, top_p, rng):
        if temperature <= 0:
            return int(np.argmax(logits))
        weights = np.exp((logits - logits.max()) / temperature)
        weights /= weights.sum()
        order = np.argsort(-weights)
        keep = order[: int(np.searchsorted(np.cumsum(weights[order]), top_p)) + 1]
        return int(rng.choice(keep, p=weights[keep] / weights[keep].sum()))

    def answer(self, text):
        return pb_utils.InferenceResponse([pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=object))])

    def finalize(self):
        self.stopping.set()  # generations under way end at their next token
        self.pool.shutdown(wait=True, cancel_futures=True)
'''


def write_language_model(repository: Path) -> list[Path]:
    """Write ``tiny_llm`` with its vocabulary; returns its folder."""
    folder = write_python_model(repository, "tiny_llm", LLM_CONFIG, LLM_MODEL)
    words = [word for word in vocabulary() if word not in ("[EOS]",)] + ["[EOS]"]
    (folder / "1" / "vocab.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
    return [folder]
