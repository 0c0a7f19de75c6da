"""OpenAI's API answers: completions, chat completions, their stream chunks, embeddings and errors,
made from a model's responses (the tensors :mod:`rayinfer.protocol.openai_requests` names).

A stream is server-sent events, ``data: <chunk>`` each, ending with ``data: [DONE]``; an error
after the stream began is one more event, ``data: {"error": ...}``, before the end. An error
answer is OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with the status of the
error's Triton code (400, 404, 503, ...).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rayinfer.protocol.errors import Code, InvalidArgError, ServingError, as_serving_error, http_status
from rayinfer.protocol.types import InferResponse

SSE_CONTENT_TYPE = b"text/event-stream; charset=utf-8"
DONE_EVENT = b"data: [DONE]\n\n"
OWNER = "rayinfer"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "invalid_request_error", 501: "invalid_request_error"}
_ERROR_CODES = {Code.NOT_FOUND: "model_not_found", Code.UNAVAILABLE: "model_not_ready"}


@dataclass(frozen=True)
class Piece:
    """What one model response carries: text, token counts (None: not given), per-token log
    probabilities (None: not given)."""

    text: str
    input_tokens: int | None = None
    output_tokens: int | None = None
    logprobs: list[dict[str, Any]] | None = None


@dataclass
class Choice:
    """One choice as its responses arrive: its text so far, its counts and log probabilities."""

    index: int
    max_tokens: int
    text: str = ""
    input_tokens: int | None = None
    output_tokens: int | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    def add(self, piece: Piece) -> None:
        self.text += piece.text
        if piece.input_tokens is not None:
            self.input_tokens = piece.input_tokens
        if piece.output_tokens is not None:
            self.output_tokens = (self.output_tokens or 0) + piece.output_tokens
        if piece.logprobs:
            self.logprobs.extend(piece.logprobs)

    @property
    def finish_reason(self) -> str:
        """``length`` when the model made max_tokens tokens (as far as its counts tell), else ``stop``."""
        return "length" if self.output_tokens is not None and self.output_tokens >= self.max_tokens else "stop"


def piece(response: InferResponse) -> Piece:
    """The text (``text_output``, its elements joined), counts and log probabilities of a response."""
    text, inputs, outputs, logprobs = "", None, None, None
    for output in response.outputs:
        if output.name == "text_output":
            text = "".join(_text(value) for value in output.data.reshape(-1))
        elif output.name == "num_input_tokens" and output.data.size:
            inputs = int(output.data.reshape(-1)[0])
        elif output.name == "num_output_tokens" and output.data.size:
            outputs = int(output.data.reshape(-1)[0])
        elif output.name == "logprobs" and output.data.size:
            logprobs = _logprobs(output.data.reshape(-1)[0])
    return Piece(text, inputs, outputs, logprobs)


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def _logprobs(value: Any) -> list[dict[str, Any]] | None:
    try:
        doc = json.loads(_text(value))
    except ValueError:
        return None
    return [entry for entry in doc if isinstance(entry, dict)] if isinstance(doc, list) else None


def usage(choices: list[Choice], prompt_tokens: list[int | None]) -> dict[str, int] | None:
    """OpenAI's usage of a request's choices (``prompt_tokens``: each prompt's count, once); None
    when the model gives no counts. A choice with no text and no count of its own, where others
    have one, made no token (the model ended it at once): it counts 0."""
    if all(c.output_tokens is None for c in choices) or any(p is None for p in prompt_tokens):
        return None
    if any(c.output_tokens is None and c.text for c in choices):  # text the model gave no count for
        return None
    prompt = sum(p or 0 for p in prompt_tokens)
    completion = sum(c.output_tokens or 0 for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_document(request_id: str, created: int, model: str, choices: list[Choice],
                        logprobs: int | None, usage_doc: dict[str, int] | None) -> dict[str, Any]:
    return {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                     "logprobs": completion_logprobs(c.logprobs, logprobs, 0) if logprobs is not None else None}
                    for c in choices],
        "usage": usage_doc,
    }


def chat_document(request_id: str, created: int, model: str, choices: list[Choice], logprobs: int | None,
                  usage_doc: dict[str, int] | None) -> dict[str, Any]:
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                     "finish_reason": c.finish_reason,
                     "logprobs": {"content": chat_logprobs(c.logprobs, logprobs)} if logprobs is not None else None}
                    for c in choices],
        "usage": usage_doc,
    }


def completion_chunk(request_id: str, created: int, model: str, index: int, text: str,
                     finish_reason: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}]}


def chat_chunk(request_id: str, created: int, model: str, index: int, delta: dict[str, Any],
               finish_reason: str | None, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason,
                         "logprobs": {"content": logprobs} if logprobs is not None else None}]}


def usage_chunk(request_id: str, created: int, model: str, chat: bool, usage_doc: dict[str, int] | None) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage_doc}


def _positions(entries: list[dict[str, Any]], top: int) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(sampled token, its logprob, the ``top`` best (token, logprob) by rank) of each position
    of the model's per-token entries that has candidates."""
    positions = []
    for entry in entries:
        ranked = _ranked(entry)
        if ranked:
            best = sorted(ranked, key=lambda item: item[2] if item[2] > 0 else 1 << 30)[:top]
            positions.append((ranked[0][0], ranked[0][1], [(t, lp) for t, lp, _ in best]))
    return positions


def _ranked(entry: dict[str, Any]) -> list[tuple[str, float, int]]:
    """(token, logprob, rank) of one position's candidates, the sampled token first (vLLM's order)."""
    out = []
    for value in entry.values():
        if isinstance(value, dict) and isinstance(value.get("logprob"), (int, float)):
            out.append((str(value.get("decoded_token", "")), float(value["logprob"]), int(value.get("rank", 0) or 0)))
    return out


def chat_logprobs(entries: list[dict[str, Any]], top: int) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content`` of a chat choice from the model's per-token entries."""
    return [{"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")),
             "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in best]}
            for token, logprob, best in _positions(entries, top)]


def completion_logprobs(entries: list[dict[str, Any]], top: int, offset: int) -> dict[str, Any]:
    """OpenAI's ``logprobs`` of a completion choice (``offset``: where its text began)."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for token, logprob, best in _positions(entries, top):
        offsets.append(offset)
        offset += len(token)
        tokens.append(token)
        token_logprobs.append(logprob)
        tops.append(dict(best))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def embedding_vectors(response: InferResponse, output: str, count: int) -> list[np.ndarray]:
    """The ``count`` embeddings of a response: rows of a floating-point output, or the JSON arrays
    of ``text_output``."""
    found = next((o for o in response.outputs if o.name == output), None)
    if found is None:
        raise InvalidArgError(f"model '{response.model_name}' sent no output '{output}'")
    if output == "text_output":
        try:
            vectors = [np.asarray(json.loads(_text(v)), dtype=np.float32).reshape(-1) for v in found.data.reshape(-1)]
        except (ValueError, TypeError):
            raise InvalidArgError(f"model '{response.model_name}' is not an embedding model: its '{output}' is not "
                                  "a JSON array of numbers") from None
    else:
        data = np.asarray(found.data, dtype=np.float32)
        vectors = list(data.reshape(count, -1)) if data.size and data.size % count == 0 else []
    if len(vectors) != count:
        raise InvalidArgError(f"model '{response.model_name}' sent {len(vectors)} embeddings in '{output}' for "
                              f"{count} inputs")
    return vectors


def embedding_document(model: str, vectors: list[np.ndarray], encoding: str, dimensions: int | None,
                       prompt_tokens: int | None) -> dict[str, Any]:
    data = []
    for index, vector in enumerate(vectors):
        if dimensions is not None:
            if dimensions > vector.size:
                raise InvalidArgError(f"'dimensions' is {dimensions}; model '{model}' makes embeddings of "
                                      f"{vector.size}")
            vector = vector[:dimensions]
            norm = float(np.linalg.norm(vector))
            vector = vector / norm if norm > 0 else vector
        value: Any = (base64.b64encode(vector.astype("<f4").tobytes()).decode() if encoding == "base64"
                      else [float(x) for x in vector])
        data.append({"object": "embedding", "index": index, "embedding": value})
    tokens = prompt_tokens or 0
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def model_document(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": OWNER}


def error_answer(exc: BaseException) -> tuple[int, bytes]:
    """OpenAI's error answer for ``exc``: (status, body)."""
    error = as_serving_error(exc)
    status = http_status(error.code)
    return status, encode(error_document(error, status))


def error_document(error: ServingError, status: int) -> dict[str, Any]:
    return {"error": {
        "message": error.message,
        "type": _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
        "param": getattr(error, "param", None) or None,
        "code": _ERROR_CODES.get(error.code),
    }}


def error_event(exc: BaseException) -> bytes:
    error = as_serving_error(exc)
    return event(error_document(error, http_status(error.code)))


def encode(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def event(doc: dict[str, Any]) -> bytes:
    return b"data: " + encode(doc) + b"\n\n"
