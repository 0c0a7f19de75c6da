"""The OpenAI-compatible API over models reached through a :class:`ModelAccess`.

``GET /v1/models`` (and ``/v1/models/<id>``) lists the ready models; ``POST /v1/completions``
and ``/v1/chat/completions`` generate with a language model, ``POST /v1/embeddings`` embeds
with an embedding model (:mod:`rayinfer.protocol.openai_requests` says which tensors each
takes). Each of a request's ``n`` choices (for each of its prompts) is one request to the
model, all sent at once; choice ``i`` of a request with a ``seed`` samples with ``seed + i``
(and of one without, with a random seed + i, so that its choices differ). A stream's status
is its first response's: an error the model answers at once (a bad sampling parameter) is an
error answer, not a stream; later errors are an event. A stream given up by its client
closes what feeds it, which cancels the model's requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

from rayinfer.protocol import openai_responses as answers
from rayinfer.protocol.chat_template import render_chat
from rayinfer.protocol.errors import InternalError, InvalidArgError, NotFoundError, ServingError, as_serving_error
from rayinfer.protocol.openai_requests import (
    GenerationRequest,
    ModelInterface,
    chat_request,
    completion_request,
    embedding_infer_request,
    embedding_request,
    generation_infer_request,
)
from rayinfer.protocol.types import InferRequest, InferResponse

Result: TypeAlias = InferResponse | ServingError
Headers: TypeAlias = list[tuple[bytes, bytes]]
Answer: TypeAlias = tuple[int, Headers, bytes | AsyncIterator[bytes]]
_JSON: Headers = [(b"content-type", b"application/json")]
_SSE: Headers = [(b"content-type", answers.SSE_CONTENT_TYPE), (b"cache-control", b"no-cache")]
PREFIX = "/v1"
_POST_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")


class ModelAccess(Protocol):
    """How the service reaches models (a Serve deployment's handles, or a test's models)."""

    async def ready_models(self) -> list[str]:
        """The names of the models ready now."""

    async def interface(self, model: str) -> ModelInterface:
        """The model's tensors and template; Triton's error when it is not served."""

    def stream(self, request: InferRequest) -> AsyncIterator[Result]:
        """Every response of one request as the model sends it (one for a model that is not
        decoupled); closing the iterator cancels the request."""


@dataclass(frozen=True)
class OpenAIOptions:
    """The API's limits (each a server flag, :class:`~rayinfer.cluster.settings.ServerSettings`)."""

    default_max_tokens: int = 16
    max_choices: int = 16
    max_embedding_inputs: int = 256


class OpenAIService:
    """Answers the API's requests; keeps when it first listed each model (a model's ``created``)."""

    def __init__(self, access: ModelAccess, options: OpenAIOptions) -> None:
        self._access = access
        self._options = options
        self._created: dict[str, int] = {}

    async def respond(self, method: str, path: str, body: bytes) -> Answer:
        """The answer to one request (``path`` under ``/v1``)."""
        path = path.rstrip("/") or "/"
        try:
            if path == "/v1/models" or path.startswith("/v1/models/"):
                if method != "GET":
                    return _method_not_allowed(method, path)
                return await self._models(path[len("/v1/models/"):] if path != "/v1/models" else None)
            if path not in _POST_ROUTES:
                raise NotFoundError(f"Not Found: {method} {path}")
            if method != "POST":
                return _method_not_allowed(method, path)
            options = self._options
            if path == "/v1/embeddings":
                return await self._embeddings(body)
            if path == "/v1/completions":
                request = completion_request(body, options.default_max_tokens, options.max_choices)
            else:
                request = chat_request(body, options.default_max_tokens, options.max_choices)
            return await self._generate(request)
        except Exception as exc:
            return error_answer(exc)

    # ---- models ---------------------------------------------------------------------------------

    async def _models(self, model: str | None) -> Answer:
        names = await self._access.ready_models()
        now = int(time.time())
        for name in names:
            self._created.setdefault(name, now)
        if model is None:
            doc: dict[str, Any] = {"object": "list",
                                   "data": [answers.model_document(n, self._created[n]) for n in sorted(names)]}
        elif model in names:
            doc = answers.model_document(model, self._created[model])
        else:
            raise NotFoundError(f"The model '{model}' does not exist or is not ready")
        return 200, list(_JSON), answers.encode(doc)

    # ---- completions and chat completions -------------------------------------------------------

    async def _generate(self, request: GenerationRequest) -> Answer:
        model = await self._access.interface(request.model)
        model.require_text_generation()
        prompts = request.prompts or (render_chat(model.chat_template, model.name, list(request.messages),
                                                  request.template_arguments),)
        base = request.sampling.get("seed") if request.seeded else (
            random.randrange(1 << 31) if request.n > 1 else None)
        infer_requests = [generation_infer_request(model, request, prompt, None if base is None else base + j)
                          for prompt in prompts for j in range(request.n)]
        reply = _Reply(request, f"{'chatcmpl' if request.chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()),
                       len(prompts))
        streams = [self._access.stream(r) for r in infer_requests]
        if request.stream:
            return await _events(reply, prompts, _merged(streams))
        choices = [answers.Choice(i, request.max_tokens) for i in range(len(streams))]
        await _gather([_collect(s, c) for s, c in zip(streams, choices)])
        if request.echo:
            for choice in choices:
                choice.text = prompts[choice.index // request.n] + choice.text
        return 200, list(_JSON), answers.encode(reply.document(choices))

    # ---- embeddings -----------------------------------------------------------------------------

    async def _embeddings(self, body: bytes) -> Answer:
        request = embedding_request(body, self._options.max_embedding_inputs)
        model = await self._access.interface(request.model)
        text_input, output = model.embedding_tensors()
        size = model.max_batch_size if model.max_batch_size > 0 else 1
        batches = [request.texts[i:i + size] for i in range(0, len(request.texts), size)]
        responses = await _gather([_single(self._access.stream(embedding_infer_request(model, text_input, batch)))
                                   for batch in batches])
        vectors = [v for batch, response in zip(batches, responses)
                   for v in answers.embedding_vectors(response, output, len(batch))]
        tokens = [_token_count(response) for response in responses]
        doc = answers.embedding_document(request.model, vectors, request.encoding_format, request.dimensions,
                                         None if None in tokens else sum(t or 0 for t in tokens))
        return 200, list(_JSON), answers.encode(doc)


@dataclass(frozen=True)
class _Reply:
    """The parts every answer to one generation request shares."""

    request: GenerationRequest
    id: str
    created: int
    prompt_count: int

    def document(self, choices: list[answers.Choice]) -> dict[str, Any]:
        usage = self.usage(choices)
        make = answers.chat_document if self.request.chat else answers.completion_document
        return make(self.id, self.created, self.request.model, choices, self.request.logprobs, usage)

    def usage(self, choices: list[answers.Choice]) -> dict[str, int] | None:
        n = self.request.n  # each prompt's count, from whichever of its choices gave one
        prompts = [next((c.input_tokens for c in choices[p * n:(p + 1) * n] if c.input_tokens is not None), None)
                   for p in range(self.prompt_count)]
        return answers.usage(choices, prompts)

    def chunk(self, index: int, text: str | None, finish: str | None, logprobs: Any = None,
              role: bool = False) -> bytes:
        request = self.request
        if request.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                {"content": text} if text is not None else {})
            doc = answers.chat_chunk(self.id, self.created, request.model, index, delta, finish, logprobs)
        else:
            doc = answers.completion_chunk(self.id, self.created, request.model, index, text or "", finish, logprobs)
        return answers.event(doc)


async def _events(reply: _Reply, prompts: tuple[str, ...],
                  results: AsyncGenerator[tuple[int, Result | None], None]) -> Answer:
    """The stream's status (its first response's) and its events."""
    try:
        first = await anext(results, None)
    except BaseException:
        await results.aclose()
        raise
    if first is not None and isinstance(first[1], ServingError):
        await results.aclose()
        return error_answer(first[1])
    request = reply.request
    choices = [answers.Choice(i, request.max_tokens) for i in range(request.choice_count)]
    offsets = [0] * len(choices)

    async def events() -> AsyncIterator[bytes]:
        try:
            for choice in choices:
                if request.chat:
                    yield reply.chunk(choice.index, None, None, role=True)
                elif request.echo:
                    prompt = prompts[choice.index // request.n]
                    offsets[choice.index] = len(prompt)
                    yield reply.chunk(choice.index, prompt, None)
            item = first
            while item is not None:
                index, result = item
                if isinstance(result, ServingError):
                    raise result
                choice = choices[index]
                if result is None:  # the choice's stream ended
                    yield reply.chunk(index, None if request.chat else "", choice.finish_reason)
                else:
                    part = answers.piece(result)
                    choice.add(part)
                    yield reply.chunk(index, part.text, None, _chunk_logprobs(request, part, offsets, index))
                item = await anext(results, None)
            if request.include_usage:
                yield answers.event(answers.usage_chunk(reply.id, reply.created, request.model, request.chat,
                                                        reply.usage(choices)))
        except Exception as exc:  # the stream failed after it began: an event says so
            yield answers.error_event(exc)
        finally:
            await results.aclose()  # a client gone: the requests are cancelled
        yield answers.DONE_EVENT

    return 200, list(_SSE), events()


def _chunk_logprobs(request: GenerationRequest, part: answers.Piece, offsets: list[int], index: int) -> Any:
    if request.logprobs is None:
        return None
    if request.chat:
        return answers.chat_logprobs(part.logprobs or [], request.logprobs)
    doc = answers.completion_logprobs(part.logprobs or [], request.logprobs, offsets[index])
    offsets[index] += len(part.text)
    return doc


async def _merged(streams: list[AsyncIterator[Result]]) -> AsyncGenerator[tuple[int, Result | None], None]:
    """(choice, result) as each stream sends them, and (choice, None) as each ends (a stream
    that fails ends with its error); closing this closes every stream."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as results:  # type: ignore[type-var]
            async for result in results:
                yield 0, result
        yield 0, None
        return
    queue: asyncio.Queue[tuple[int, Result | None]] = asyncio.Queue(maxsize=len(streams) * 4)

    async def forward(index: int, stream: AsyncIterator[Result]) -> None:
        try:
            async with contextlib.aclosing(stream) as results:  # type: ignore[type-var]
                async for result in results:
                    await queue.put((index, result))
        except Exception as exc:
            await queue.put((index, as_serving_error(exc)))
        await queue.put((index, None))

    tasks = [asyncio.ensure_future(forward(i, s)) for i, s in enumerate(streams)]
    try:
        ended = 0
        while ended < len(streams):
            item = await queue.get()
            ended += item[1] is None
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(stream: AsyncIterator[Result], choice: answers.Choice) -> None:
    """A choice's whole text: at most a response per token asked for, and one more (a model
    that sends more is stopped, so that what is held for the answer stays bounded)."""
    taken = 0
    async with contextlib.aclosing(stream) as results:  # type: ignore[type-var]
        async for result in results:
            if isinstance(result, ServingError):
                raise result
            taken += 1
            if taken > choice.max_tokens + 1:
                raise InternalError(f"model '{result.model_name}' sent more than {choice.max_tokens + 1} responses "
                                    f"to a request for {choice.max_tokens} tokens")
            choice.add(answers.piece(result))


async def _single(stream: AsyncIterator[Result]) -> InferResponse:
    """The one response of a request to a model that answers once."""
    found: InferResponse | None = None
    async with contextlib.aclosing(stream) as results:  # type: ignore[type-var]
        async for result in results:
            if isinstance(result, ServingError):
                raise result
            if found is not None:
                raise InvalidArgError(f"model '{result.model_name}' sent more than one response to an embedding request")
            found = result
    if found is None:
        raise InvalidArgError("the model sent no response to an embedding request")
    return found


async def _gather(calls: list[Any]) -> list[Any]:
    """Every call's result; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _token_count(response: InferResponse) -> int | None:
    found = next((o for o in response.outputs if o.name == "num_input_tokens"), None)
    return int(found.data.sum()) if found is not None else None


def error_answer(exc: BaseException) -> tuple[int, Headers, bytes]:
    """OpenAI's error answer to a request that failed with ``exc``."""
    status, body = answers.error_answer(exc)
    return status, list(_JSON), body


def _method_not_allowed(method: str, path: str) -> Answer:
    doc = answers.error_document(InvalidArgError(f"Method Not Allowed: {method} {path}"), 405)
    return 405, [*_JSON, (b"allow", b"GET" if path.startswith("/v1/models") else b"POST")], answers.encode(doc)
