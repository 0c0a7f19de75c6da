"""OpenAI's API requests, read and checked, and the Triton requests they become.

A language model takes the tensors of Triton's vLLM backend, as Triton's OpenAI frontend sends
them: ``text_input`` (the prompt, BYTES), ``stream`` (BOOL), ``sampling_parameters`` (a JSON
object in BYTES: ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ...),
``exclude_input_in_output`` (BOOL), and where the model declares them ``return_num_input_tokens``,
``return_num_output_tokens`` and ``return_logprobs`` (BOOL); it answers ``text_output`` (BYTES)
and optionally ``num_input_tokens``, ``num_output_tokens`` (token counts) and ``logprobs``. An
embedding model takes the text in ``text_input`` or its one BYTES input, and answers
``text_output`` (a JSON array, as vLLM's embedding models do) or a floating-point output
(``embedding``, or its one such output). A model's ``chat_template`` parameter is its chat
template (:mod:`rayinfer.protocol.chat_template`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rayinfer.protocol.errors import InvalidArgError, InvalidParamError
from rayinfer.protocol.http_codec import parse_json_body
from rayinfer.protocol.types import InferInput, InferRequest

TEXT_INPUT, TEXT_OUTPUT = "text_input", "text_output"
FLOAT_TYPES = ("FP16", "FP32", "FP64", "BF16")
# Request members that are not sampling parameters (handled here, or not the model's business).
_NOT_SAMPLING = frozenset({
    "model", "prompt", "messages", "stream", "stream_options", "n", "echo", "logprobs", "top_logprobs", "user",
    "max_tokens", "max_completion_tokens", "suffix", "best_of", "logit_bias", "tools", "tool_choice",
    "parallel_tool_calls", "response_format", "store", "metadata", "service_tier", "functions", "function_call",
    "add_generation_prompt", "chat_template_kwargs",
})
# The sampling parameters checked here, by type (others pass to the model as given).
_NUMBERS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
            "frequency_penalty": (-2.0, 2.0)}
MAX_STOP_SEQUENCES = 4
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class ModelInterface:
    """What the OpenAI API needs of a model's config: its tensors and its chat template."""

    name: str
    inputs: dict[str, str]  # name -> datatype
    outputs: dict[str, str]
    max_batch_size: int = 0
    chat_template: str | None = None

    @property
    def generates_text(self) -> bool:
        return self.inputs.get(TEXT_INPUT) == "BYTES" and self.outputs.get(TEXT_OUTPUT) == "BYTES"

    def require_text_generation(self) -> None:
        if not self.generates_text:
            raise InvalidArgError(
                f"model '{self.name}' is not a language model: the OpenAI API needs a BYTES input "
                f"'{TEXT_INPUT}' and a BYTES output '{TEXT_OUTPUT}' (the tensors of Triton's vLLM backend)")

    def embedding_tensors(self) -> tuple[str, str]:
        """(the text input, the embedding output); InvalidArgError when the model has none."""
        texts = [name for name, datatype in self.inputs.items() if datatype == "BYTES"]
        text = TEXT_INPUT if TEXT_INPUT in texts else (texts[0] if len(texts) == 1 else None)
        floats = [name for name, datatype in self.outputs.items() if datatype in FLOAT_TYPES]
        if self.outputs.get(TEXT_OUTPUT) == "BYTES":
            output: str | None = TEXT_OUTPUT
        else:
            output = "embedding" if "embedding" in floats else (floats[0] if len(floats) == 1 else None)
        if text is None or output is None:
            raise InvalidArgError(
                f"model '{self.name}' is not an embedding model: the OpenAI API needs one BYTES input (or "
                f"'{TEXT_INPUT}') and a floating-point output ('embedding', or the only one) or a BYTES "
                f"'{TEXT_OUTPUT}' holding a JSON array")
        return text, output


def model_interface(config: dict[str, Any]) -> ModelInterface:
    """The interface of a model from its config in Triton's JSON form."""
    template = (config.get("parameters") or {}).get("chat_template", {}).get("string_value") or None
    return ModelInterface(
        name=str(config.get("name", "")),
        inputs={str(t["name"]): _datatype(t.get("data_type", "")) for t in config.get("input", [])},
        outputs={str(t["name"]): _datatype(t.get("data_type", "")) for t in config.get("output", [])},
        max_batch_size=int(config.get("max_batch_size", 0) or 0),
        chat_template=template,
    )


def _datatype(config_type: str) -> str:
    name = str(config_type).removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


@dataclass(frozen=True)
class GenerationRequest:
    """A completion or chat completion request, checked. ``prompts``: the completion's prompts
    (a chat's is rendered from ``messages`` by the model's template); ``logprobs``: how many top
    log probabilities each token carries (None: no log probabilities)."""

    chat: bool
    model: str
    stream: bool
    n: int
    max_tokens: int
    sampling: dict[str, Any]
    prompts: tuple[str, ...] = ()
    messages: tuple[dict[str, Any], ...] = ()
    echo: bool = False
    logprobs: int | None = None
    include_usage: bool = False
    seeded: bool = False
    template_arguments: dict[str, Any] = field(default_factory=dict)

    @property
    def choice_count(self) -> int:
        return self.n * max(1, len(self.prompts))


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str
    texts: tuple[str, ...]
    encoding_format: str = "float"
    dimensions: int | None = None


def completion_request(body: bytes, default_max_tokens: int, max_choices: int) -> GenerationRequest:
    """A ``POST /v1/completions`` body, checked (InvalidArgError naming the member)."""
    doc = parse_json_body(body, "completion request")
    model = _model(doc)
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        prompts: tuple[str, ...] = (prompt,)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = tuple(prompt)
    else:
        raise _invalid("prompt", "'prompt' must be a string or a non-empty array of strings (token ids are not supported)")
    _refuse(doc, "suffix", "logit_bias")
    if doc.get("best_of") not in (None, 1):
        raise _invalid("best_of", "best_of other than 1 is not supported")
    logprobs = doc.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS):
        raise _invalid("logprobs", f"'logprobs' must be an integer from 0 to {MAX_COMPLETION_LOGPROBS}")
    request = _generation(doc, model, chat=False, prompts=prompts,
                          max_tokens=_max_tokens(doc, ("max_tokens",), default_max_tokens),
                          echo=_bool(doc, "echo", False), logprobs=logprobs)
    return _checked_choices(request, max_choices)


def chat_request(body: bytes, default_max_tokens: int, max_choices: int) -> GenerationRequest:
    """A ``POST /v1/chat/completions`` body, checked."""
    doc = parse_json_body(body, "chat completion request")
    model = _model(doc)
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages", "'messages' must be a non-empty array of messages")
    checked = tuple(_message(i, m) for i, m in enumerate(messages))
    _refuse(doc, "logit_bias", "tools", "functions")
    if doc.get("tool_choice") not in (None, "none"):
        raise _invalid("tool_choice", "tool calls are not supported")
    response_format = doc.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
        raise _invalid("response_format", "only the 'text' response format is supported")
    logprobs = None
    if _bool(doc, "logprobs", False):
        top = doc.get("top_logprobs", 0)
        if top is None:
            top = 0
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise _invalid("top_logprobs", f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}")
        logprobs = top
    elif doc.get("top_logprobs") is not None:
        raise _invalid("top_logprobs", "'top_logprobs' can only be used when 'logprobs' is true")
    kwargs = doc.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _invalid("chat_template_kwargs", "'chat_template_kwargs' must be an object")
    request = _generation(doc, model, chat=True, messages=checked,
                          max_tokens=_max_tokens(doc, ("max_completion_tokens", "max_tokens"), default_max_tokens),
                          logprobs=logprobs,
                          template_arguments={**kwargs,
                                              "add_generation_prompt": _bool(doc, "add_generation_prompt", True)})
    return _checked_choices(request, max_choices)


def embedding_request(body: bytes, max_inputs: int) -> EmbeddingRequest:
    """A ``POST /v1/embeddings`` body, checked: at most ``max_inputs`` texts."""
    doc = parse_json_body(body, "embedding request")
    model = _model(doc)
    given = doc.get("input")
    texts = (given,) if isinstance(given, str) else tuple(given) if isinstance(given, list) else ()
    if not texts or not all(isinstance(t, str) for t in texts):
        raise _invalid("input", "'input' must be a string or a non-empty array of strings (token ids are not supported)")
    if len(texts) > max_inputs:
        raise _invalid("input", f"'input' holds {len(texts)} texts; at most {max_inputs} are taken")
    encoding = doc.get("encoding_format", "float") or "float"
    if encoding not in ("float", "base64"):
        raise _invalid("encoding_format", "'encoding_format' must be 'float' or 'base64'")
    dimensions = doc.get("dimensions")
    if dimensions is not None and (not _is_int(dimensions) or dimensions < 1):
        raise _invalid("dimensions", "'dimensions' must be a positive integer")
    return EmbeddingRequest(model, texts, encoding, dimensions)


def generation_infer_request(model: ModelInterface, request: GenerationRequest, prompt: str,
                             seed: int | None) -> InferRequest:
    """The Triton request of one choice: ``prompt`` (rendered), ``seed`` (the choice's, or None)."""
    sampling = dict(request.sampling, max_tokens=request.max_tokens)
    if seed is not None:
        sampling["seed"] = seed
    if request.logprobs is not None:
        sampling["logprobs"] = request.logprobs
    tensors: dict[str, Any] = {
        TEXT_INPUT: np.array([prompt.encode("utf-8")], dtype=object),
        "stream": np.array([request.stream]),
        "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=object),
        "exclude_input_in_output": np.array([True]),
        "return_num_input_tokens": np.array([True]),
        "return_num_output_tokens": np.array([True]),
        "return_logprobs": np.array([request.logprobs is not None]),
    }
    inputs = [_tensor(model, name, value) for name, value in tensors.items() if name in model.inputs]
    return InferRequest(model_name=model.name, inputs=inputs)


def embedding_infer_request(model: ModelInterface, text_input: str, texts: tuple[str, ...]) -> InferRequest:
    """One Triton request embedding ``texts``: a batch of them when the model batches, else one."""
    data = np.array([t.encode("utf-8") for t in texts], dtype=object)
    shape = (len(texts), 1) if model.max_batch_size > 0 else (len(texts),)
    return InferRequest(model_name=model.name, inputs=[InferInput(text_input, "BYTES", shape, data.reshape(shape))])


def _tensor(model: ModelInterface, name: str, value: np.ndarray) -> InferInput:
    if model.max_batch_size > 0:
        value = value.reshape(1, -1)
    datatype = model.inputs[name]
    if datatype != "BYTES" and value.dtype == object:
        raise InvalidArgError(f"model '{model.name}' declares input '{name}' as {datatype}, not BYTES")
    if datatype == "BOOL" and value.dtype != np.bool_:
        raise InvalidArgError(f"model '{model.name}' declares input '{name}' as {datatype}, not BOOL")
    return InferInput(name, datatype, tuple(value.shape), value)


def _generation(doc: dict[str, Any], model: str, **fields: Any) -> GenerationRequest:
    stream = _bool(doc, "stream", False)
    options = doc.get("stream_options")
    if options is not None and not stream:
        raise _invalid("stream_options", "'stream_options' can only be used when 'stream' is true")
    if options is not None and not isinstance(options, dict):
        raise _invalid("stream_options", "'stream_options' must be an object")
    n = doc.get("n", 1)
    if n is None:
        n = 1
    if not _is_int(n) or n < 1:
        raise _invalid("n", "'n' must be a positive integer")
    sampling = {key: value for key, value in doc.items() if key not in _NOT_SAMPLING and value is not None}
    for key, (low, high) in _NUMBERS.items():
        value = sampling.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not low <= value <= high):
            raise _invalid(key, f"'{key}' must be a number from {low:g} to {high:g}")
    if sampling.get("top_p") == 0:
        raise _invalid("top_p", "'top_p' must be above 0")
    seed = sampling.get("seed")
    if seed is not None and not _is_int(seed):
        raise _invalid("seed", "'seed' must be an integer")
    stop = sampling.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP_SEQUENCES:
            raise _invalid("stop", f"'stop' must be a string or an array of at most {MAX_STOP_SEQUENCES} strings")
        sampling["stop"] = stops
    return GenerationRequest(model=model, stream=stream, n=n, sampling=sampling, seeded=seed is not None,
                             include_usage=bool((options or {}).get("include_usage", False)), **fields)


def _checked_choices(request: GenerationRequest, max_choices: int) -> GenerationRequest:
    if request.choice_count > max_choices:
        raise _invalid("n", f"the request asks for {request.choice_count} choices; at most {max_choices} are "
                       "generated for one request (--openai-max-choices)")
    return request


def _max_tokens(doc: dict[str, Any], names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = doc.get(name)
        if value is not None:
            if not _is_int(value) or value < 0:
                raise _invalid(name, f"'{name}' must be a non-negative integer")
            return int(value)
    return default


def _message(index: int, message: Any) -> dict[str, Any]:
    """One chat message, its content as text (the text parts of a list of parts, joined)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise _invalid(where, f"'{where}' must be an object")
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise _invalid(f"{where}.role", f"'{where}.role' must be system, developer, user, assistant or tool")
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _invalid(f"{where}.content", f"'{where}.content' may hold text parts only")
            parts.append(part["text"])
        content = "\n".join(parts)
    elif content is None and role == "assistant":
        content = ""
    elif not isinstance(content, str):
        raise _invalid(f"{where}.content", f"'{where}.content' must be a string or an array of text parts")
    checked = {"role": role, "content": content}
    if isinstance(message.get("name"), str):
        checked["name"] = message["name"]
    return checked


def _model(doc: dict[str, Any]) -> str:
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise _invalid("model", "'model' must name a model")
    return model


def _refuse(doc: dict[str, Any], *names: str) -> None:
    for name in names:
        if doc.get(name) not in (None, [], {}):
            raise _invalid(name, f"'{name}' is not supported")


def _bool(doc: dict[str, Any], name: str, default: bool) -> bool:
    value = doc.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _invalid(name, f"'{name}' must be a boolean")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _invalid(param: str, message: str) -> InvalidParamError:
    return InvalidParamError(message, param)
