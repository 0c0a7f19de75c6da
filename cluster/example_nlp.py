"""Writes an example text-classification pipeline into a model repository, built in code.

Five models, nothing downloaded: ``nlp_tokenizer`` (Python model: UTF-8 text -> token ids and
attention mask over a vocabulary written next to it), ``nlp_encoder`` (ONNX: a two-layer
transformer encoder, masked mean pooling -> a 64-wide embedding), ``nlp_head`` (Python model:
linear layer, softmax -> label and confidence), ``nlp_ensemble``, which chains the three so a
client sends text and gets a label back, and ``nlp_embedding``, which chains the first two so a
client sends text and gets its embedding (the OpenAI-compatible API's embedding model). Weights are random from fixed seeds: the labels are not
meaningful sentiment, but every generation writes the same models, and the pipeline exercises
BYTES tensors, Python models, a dynamically batched ONNX model and an ensemble together.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rayinfer.cluster.model_files import finish_onnx, write_model, write_python_model

SEQUENCE_LENGTH = 128
HIDDEN = 64
HEADS = 4
FFN = 128
LAYERS = 2
LABELS = ("negative", "neutral", "positive")

# Ids 0-2 are [PAD], [UNK] and [CLS]; these words follow in order, one id each.
VOCAB_WORDS = """
the a an and or but if then so because of to in on at by for with about from into over after before
under between through during without again once here there when where why how all any both each few more
most other some such no nor not only own same than too very can will just should now i me my myself we our
you your he him his she her it its they them their what which who whom this that these those am is are was
were be been being have has had having do does did doing would could might must shall may one two three
first last new old big small long short high low early late young right left next many much little lot
good great excellent amazing wonderful fantastic awesome brilliant perfect beautiful nice fine best better
love loved loves like liked enjoy enjoyed happy glad fun funny pleasant recommend favorite superb solid
bad terrible awful horrible worst worse poor boring dull hate hated hates dislike disappointing disappointed
sad angry annoying waste broken ugly stupid slow mess failure wrong problem problems issue issues
okay ok average decent mediocre fair normal plain simple usual ordinary
movie film show book story song music game food place service product price time day night year week
people man woman friend family thing things way work world life hand part case point home
really quite pretty rather truly totally absolutely never always often sometimes ever still even also
make made get got go went see saw know knew think thought take took come came want give use find tell
ask feel felt try leave call watch watched read buy bought eat ate play played
don't didn't doesn't isn't wasn't won't can't couldn't wouldn't i'm it's that's
"""

TOKENIZER_CONFIG = """name: "nlp_tokenizer"
backend: "python"
max_batch_size: 8
input [ { name: "raw_text" data_type: TYPE_STRING dims: [ 1 ] } ]
output [
  { name: "input_ids" data_type: TYPE_INT64 dims: [ 128 ] },
  { name: "attention_mask" data_type: TYPE_INT64 dims: [ 128 ] },
  { name: "num_input_tokens" data_type: TYPE_UINT32 dims: [ 1 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

ENCODER_CONFIG = """name: "nlp_encoder"
platform: "onnxruntime_onnx"
max_batch_size: 32
input [
  { name: "input_ids" data_type: TYPE_INT64 dims: [ 128 ] },
  { name: "attention_mask" data_type: TYPE_INT64 dims: [ 128 ] }
]
output [ { name: "embedding" data_type: TYPE_FP32 dims: [ 64 ] } ]
dynamic_batching { max_queue_delay_microseconds: 2000 }
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "intra_op_thread_count" value: { string_value: "1" } }
"""

HEAD_CONFIG = """name: "nlp_head"
backend: "python"
max_batch_size: 8
input [ { name: "embedding" data_type: TYPE_FP32 dims: [ 64 ] } ]
output [
  { name: "sentiment_label" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "confidence" data_type: TYPE_FP32 dims: [ 1 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

# The embedding model of the OpenAI-compatible API's /v1/embeddings: text in, the encoder's
# embedding and the number of tokens it read out.
EMBEDDING_CONFIG = """name: "nlp_embedding"
platform: "ensemble"
max_batch_size: 8
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
output [
  { name: "embedding" data_type: TYPE_FP32 dims: [ 64 ] },
  { name: "num_input_tokens" data_type: TYPE_UINT32 dims: [ 1 ] }
]
ensemble_scheduling { step [
  { model_name: "nlp_tokenizer" model_version: -1
    input_map { key: "raw_text" value: "text_input" }
    output_map { key: "input_ids" value: "input_ids" }
    output_map { key: "attention_mask" value: "attention_mask" }
    output_map { key: "num_input_tokens" value: "num_input_tokens" } },
  { model_name: "nlp_encoder" model_version: -1
    input_map { key: "input_ids" value: "input_ids" }
    input_map { key: "attention_mask" value: "attention_mask" }
    output_map { key: "embedding" value: "embedding" } }
] }
"""

ENSEMBLE_CONFIG = """name: "nlp_ensemble"
platform: "ensemble"
max_batch_size: 8
input [ { name: "raw_text" data_type: TYPE_STRING dims: [ 1 ] } ]
output [
  { name: "sentiment_label" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "confidence" data_type: TYPE_FP32 dims: [ 1 ] }
]
ensemble_scheduling { step [
  { model_name: "nlp_tokenizer" model_version: -1
    input_map { key: "raw_text" value: "raw_text" }
    output_map { key: "input_ids" value: "input_ids" }
    output_map { key: "attention_mask" value: "attention_mask" } },
  { model_name: "nlp_encoder" model_version: -1
    input_map { key: "input_ids" value: "input_ids" }
    input_map { key: "attention_mask" value: "attention_mask" }
    output_map { key: "embedding" value: "embedding" } },
  { model_name: "nlp_head" model_version: -1
    input_map { key: "embedding" value: "embedding" }
    output_map { key: "sentiment_label" value: "sentiment_label" }
    output_map { key: "confidence" value: "confidence" } }
] }
"""

TOKENIZER_MODEL = r'''import os
import re

import numpy as np
import triton_python_backend_utils as pb_utils

MAX_LENGTH = 128
PAD, UNK, CLS = 0, 1, 2


class TritonPythonModel:
    """raw_text [rows, 1] (UTF-8) -> input_ids, attention_mask [rows, 128]: [CLS] + word ids, 0-padded;
    num_input_tokens [rows, 1]: how many of them are tokens."""

    def initialize(self, args):
        path = os.path.join(args["model_repository"], args["model_version"], "vocab.txt")
        with open(path, encoding="utf-8") as f:
            self.ids = {line.rstrip("\n"): i for i, line in enumerate(f)}

    def encode(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        words = re.findall(r"[a-z0-9']+", str(text).lower())
        return ([CLS] + [self.ids.get(word, UNK) for word in words])[:MAX_LENGTH]

    def execute(self, requests):
        responses = []
        for request in requests:
            texts = pb_utils.get_input_tensor_by_name(request, "raw_text").as_numpy().reshape(-1)
            input_ids = np.zeros((len(texts), MAX_LENGTH), dtype=np.int64)
            for row, text in enumerate(texts):
                ids = self.encode(text)
                input_ids[row, :len(ids)] = ids
            mask = (input_ids != PAD).astype(np.int64)  # every real token's id is >= 1
            counts = mask.sum(axis=1, keepdims=True).astype(np.uint32)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("input_ids", input_ids), pb_utils.Tensor("attention_mask", mask),
                pb_utils.Tensor("num_input_tokens", counts)]))
        return responses
'''

HEAD_MODEL = r'''import os

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """embedding [rows, 64] -> softmax(embedding @ weight + bias): best label and its probability."""

    def initialize(self, args):
        path = os.path.join(args["model_repository"], args["model_version"], "head.npz")
        with np.load(path) as head:
            self.weight, self.bias = head["weight"], head["bias"]
            self.labels = [str(label).encode() for label in head["labels"]]

    def execute(self, requests):
        responses = []
        for request in requests:
            embedding = pb_utils.get_input_tensor_by_name(request, "embedding").as_numpy()
            logits = embedding.astype(np.float32) @ self.weight + self.bias
            probs = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            labels = np.array([self.labels[i] for i in probs.argmax(axis=1)], dtype=object).reshape(-1, 1)
            confidence = probs.max(axis=1, keepdims=True).astype(np.float32)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("sentiment_label", labels), pb_utils.Tensor("confidence", confidence)]))
        return responses
'''


def vocabulary() -> list[str]:
    """The tokenizer's vocabulary; a token's id is its index."""
    return ["[PAD]", "[UNK]", "[CLS]", *dict.fromkeys(VOCAB_WORDS.split())]


class _GraphBuilder:
    """Collects ONNX nodes and initializers; every node gets one fresh output name."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed=seed)
        self.nodes: list = []
        self.initializers: list = []

    def const(self, name: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, name: str, shape: tuple[int, ...], scale: float) -> str:
        return self.const(name, (self.rng.standard_normal(shape) * scale).astype(np.float32))

    def op(self, op_type: str, *inputs: str, output: str | None = None, **attrs) -> str:
        from onnx import helper

        output = output or f"{op_type.lower()}_{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], **attrs))
        return output

    def layer_norm(self, x: str, name: str) -> str:
        gamma = self.const(f"{name}_gamma", np.ones(HIDDEN, np.float32))
        beta = self.const(f"{name}_beta", np.zeros(HIDDEN, np.float32))
        return self.op("LayerNormalization", x, gamma, beta, axis=-1, epsilon=1e-5)


def _encoder_layer(g: _GraphBuilder, x: str, mask_bias: str, i: int) -> str:
    """One pre-LayerNorm block: x + attention(LN(x)), then + FFN(LN(...)); linear layers bias-free."""
    head_dim = HIDDEN // HEADS
    h = g.layer_norm(x, f"layer{i}_ln1")

    def project(name: str, perm: list[int], scale: float = 1.0) -> str:  # [B, T, H] -> per-head layout
        y = g.op("MatMul", h, g.weight(f"layer{i}_{name}", (HIDDEN, HIDDEN), scale / np.sqrt(HIDDEN)))
        return g.op("Transpose", g.op("Reshape", y, "heads_shape"), perm=perm)

    q = project("wq", [0, 2, 1, 3], 1 / np.sqrt(head_dim))  # the 1/sqrt(d) score scale, folded into Wq
    k = project("wk", [0, 2, 3, 1])
    v = project("wv", [0, 2, 1, 3])
    probs = g.op("Softmax", g.op("Add", g.op("MatMul", q, k), mask_bias), axis=-1)  # [B, heads, T, T]
    context = g.op("Reshape", g.op("Transpose", g.op("MatMul", probs, v), perm=[0, 2, 1, 3]), "hidden_shape")
    x = g.op("Add", x, g.op("MatMul", context, g.weight(f"layer{i}_wo", (HIDDEN, HIDDEN), 1 / np.sqrt(HIDDEN))))
    h = g.layer_norm(x, f"layer{i}_ln2")
    h = g.op("Relu", g.op("MatMul", h, g.weight(f"layer{i}_w1", (HIDDEN, FFN), 1 / np.sqrt(HIDDEN))))
    return g.op("Add", x, g.op("MatMul", h, g.weight(f"layer{i}_w2", (FFN, HIDDEN), 1 / np.sqrt(FFN))))


def encoder_model(vocab_size: int, seed: int = 0):
    """input_ids, attention_mask [batch, 128] (INT64) -> embedding [batch, 64] (FP32).

    Token + position embeddings, two transformer layers (4 heads; padding masked out of the
    attention by a -1e4 bias before Softmax) and a mean over the unmasked positions.
    """
    from onnx import TensorProto, helper

    g = _GraphBuilder(seed)
    g.const("heads_shape", np.array([0, 0, HEADS, HIDDEN // HEADS], np.int64))
    g.const("hidden_shape", np.array([0, 0, HIDDEN], np.int64))
    tokens = g.op("Gather", g.weight("token_embedding", (vocab_size, HIDDEN), 1 / np.sqrt(2)), "input_ids")
    x = g.op("Add", tokens, g.weight("position_embedding", (SEQUENCE_LENGTH, HIDDEN), 1 / np.sqrt(2)))
    one = g.const("one", np.array(1, np.float32))
    mask = g.op("Cast", "attention_mask", to=TensorProto.FLOAT)  # [B, T]: 1 token, 0 padding
    bias = g.op("Mul", g.op("Sub", mask, one), g.const("big", np.array(1e4, np.float32)))  # 0 or -1e4
    bias = g.op("Unsqueeze", bias, g.const("axes_1_2", np.array([1, 2], np.int64)))  # [B, 1, 1, T]
    for i in range(LAYERS):
        x = _encoder_layer(g, x, bias, i)
    x = g.layer_norm(x, "final_ln")
    weighted = g.op("Mul", x, g.op("Unsqueeze", mask, g.const("axes_2", np.array([2], np.int64))))
    total = g.op("ReduceSum", weighted, g.const("axes_1", np.array([1], np.int64)), keepdims=0)
    count = g.op("Max", g.op("ReduceSum", mask, "axes_1", keepdims=1), one)
    g.op("Div", total, count, output="embedding")
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", SEQUENCE_LENGTH])
              for n in ("input_ids", "attention_mask")]
    output = helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", HIDDEN])
    graph = helper.make_graph(g.nodes, "nlp_encoder", inputs, [output], initializer=g.initializers)
    return finish_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def write_head(path: Path, seed: int = 1) -> None:
    """``head.npz``: weight [64, 3], bias [3] from a fixed seed, and the labels in logit order."""
    rng = np.random.default_rng(seed=seed)
    weight = (rng.standard_normal((HIDDEN, len(LABELS))) / np.sqrt(HIDDEN)).astype(np.float32)
    bias = (rng.standard_normal(len(LABELS)) * 0.1).astype(np.float32)
    np.savez(path, weight=weight, bias=bias, labels=np.array(LABELS))


def write_nlp_pipeline(repository: Path) -> list[Path]:
    """Write the five models (idempotent) and return their folders, ensembles last."""
    repository = Path(repository)
    vocab = vocabulary()
    tokenizer = write_python_model(repository, "nlp_tokenizer", TOKENIZER_CONFIG, TOKENIZER_MODEL)
    (tokenizer / "1" / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    encoder = write_model(repository, "nlp_encoder", ENCODER_CONFIG, encoder_model(len(vocab)))
    head = write_python_model(repository, "nlp_head", HEAD_CONFIG, HEAD_MODEL)
    write_head(head / "1" / "head.npz")
    ensembles = []
    for name, config in (("nlp_ensemble", ENSEMBLE_CONFIG), ("nlp_embedding", EMBEDDING_CONFIG)):
        ensemble = repository / name
        (ensemble / "1").mkdir(parents=True, exist_ok=True)  # an ensemble has a version folder, empty
        (ensemble / "config.pbtxt").write_text(config)
        ensembles.append(ensemble)
    return [tokenizer, encoder, head, *ensembles]
