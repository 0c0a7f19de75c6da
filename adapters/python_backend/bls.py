"""Business logic scripting (BLS): a Python model calls other models from ``execute``.

``pb_utils.InferenceRequest(model_name=..., inputs=..., requested_output_names=...)`` becomes a
protocol :class:`InferRequest`; the replica's :class:`BlsClient` (set by the deployment that
loaded the model, :mod:`rayinfer.deployments.bls_client`) sends it to a replica of the model,
through that model's own batcher, and the answer comes back as a ``pb_utils.InferenceResponse``
(an error travels in the response, as in Triton). Model control (``load_model``,
``unload_model``, ``is_model_ready``) goes through the same client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

from rayinfer.adapters.python_backend import model_context
from rayinfer.adapters.python_backend.errors import TRITON_CODES, TritonError, TritonModelException
from rayinfer.protocol.dtypes import wire_datatype
from rayinfer.protocol.errors import Code, ServingError, as_serving_error
from rayinfer.protocol.types import InferInput, InferRequest, InferResponse, RequestedOutput, StreamEnd

if TYPE_CHECKING:
    from rayinfer.adapters.python_backend.triton_python_backend_utils import InferenceRequest, InferenceResponse


class BlsClient(Protocol):
    """Sends requests to the models the cluster serves (blocking calls may come from any thread
    but the client's own)."""

    def infer(self, request: InferRequest) -> InferResponse:
        """The one response of a non-decoupled model; raises its ServingError."""

    async def infer_async(self, request: InferRequest) -> InferResponse:
        """``infer`` for a coroutine on any event loop."""

    def stream(self, request: InferRequest) -> Iterator[InferResponse | ServingError | StreamEnd]:
        """Every response of one request as the model sends them; an error ends the stream, and
        so does ``StreamEnd.FINAL_ALONE`` (the model's final flag sent on its own)."""

    def load_model(self, name: str, parameters: dict[str, Any]) -> None: ...

    def unload_model(self, name: str, unload_dependents: bool) -> None: ...

    def is_model_ready(self, name: str, version: str) -> bool: ...


_client: BlsClient | None = None  # the replica's: for a model loaded without one of its own
_loading: ContextVar[BlsClient | None] = ContextVar("rayinfer_bls_loading", default=None)


def set_client(client: BlsClient | None) -> None:
    """Set by the replica that serves the model: the client of every model loaded in the
    process without one of its own (:func:`loading_with`)."""
    global _client
    _client = client


@contextlib.contextmanager
def loading_with(client: BlsClient) -> Iterator[None]:
    """A model loaded in this block calls other models through ``client`` (the replica's, set
    by the deployment that loads it): the model's :class:`~.model_context.ModelContext` keeps it."""
    token = _loading.set(client)
    try:
        yield
    finally:
        _loading.reset(token)


def loading_client() -> BlsClient | None:
    """The client of the model being loaded (None outside :func:`loading_with`)."""
    return _loading.get()


def client() -> BlsClient:
    """The running model's client (:mod:`.model_context`), else the replica's."""
    context = model_context.current()
    if context is None and model_context.process_shared():
        raise TritonModelException(
            "a BLS call from outside the model's own calls (a thread it started itself) in the model pool, which "
            "holds many models in one process: start the thread with contextvars.copy_context().run, or use "
            "asyncio.to_thread, so that the call is the model's")
    found = (context.bls if context is not None else None) or _client
    if found is None:
        raise TritonModelException("BLS and model control need a running rayinfer server: none is reachable here")
    return found


def to_infer_request(request: InferenceRequest) -> InferRequest:
    """A pb_utils request for another model as the protocol's request."""
    if not request.model_name:
        raise TritonModelException("a BLS request needs 'model_name'")
    inputs = []
    for tensor in request.inputs():
        array = tensor._data  # as it is: BF16 too (as_numpy refuses it)
        inputs.append(InferInput(tensor.name(), wire_datatype(array.dtype), tuple(array.shape), array))
    outputs = [RequestedOutput(name) for name in request.requested_output_names()] or None
    version = "" if int(request.model_version) < 0 else str(request.model_version)
    parameters = dict(request._parameters)
    if request.timeout():
        parameters.setdefault("timeout", int(request.timeout()))
    trace = request._trace  # given as trace=request.trace(): traced as a child of that request
    return InferRequest(model_name=request.model_name, model_version=version, id=request.request_id() or None,
                        inputs=inputs, outputs=outputs, parameters=parameters,
                        trace_parent=trace._link if trace is not None else None)


def to_inference_response(result: InferResponse | BaseException | None) -> InferenceResponse:
    """The protocol's answer (or error) as what ``exec`` returns; None is the empty final one."""
    from rayinfer.adapters.python_backend import triton_python_backend_utils as pb_utils

    if result is None:
        return pb_utils.InferenceResponse([])
    if isinstance(result, BaseException):
        error = as_serving_error(result)
        return pb_utils.InferenceResponse(error=TritonError(error.message, TRITON_CODES.get(error.code, TritonError.INTERNAL)))
    tensors = [pb_utils.Tensor(output.name, output.data) for output in result.outputs]
    return pb_utils.InferenceResponse(tensors, parameters=result.parameters)


def execute(request: InferenceRequest) -> InferenceResponse:
    """``request.exec()``: the target model's response; an error is in the response."""
    try:
        return to_inference_response(client().infer(to_infer_request(request)))
    except Exception as exc:
        return to_inference_response(exc)


async def execute_async(request: InferenceRequest) -> InferenceResponse:
    """``await request.async_exec()``."""
    try:
        return to_inference_response(await client().infer_async(to_infer_request(request)))
    except Exception as exc:
        return to_inference_response(exc)


class ResponseIterator:
    """The responses of a decoupled BLS request (``request.exec(decoupled=True)``), as Triton's
    iterator gives them: each as it comes, the last one carrying the final flag (an empty one
    when the model sent the flag on its own).

    ``cancel()`` cancels the request: its model sees ``request.is_cancelled()``, and the
    iteration goes on to one final error response with code CANCELLED ("request has been
    cancelled"), which Triton's iterator gives when the model answers its cancellation so. The
    call itself ends at once (a Ray call cannot be cancelled and go on), so responses the model
    would send after it, ignoring the cancellation, do not come (Triton's iterator gives them).
    After the last response, or a second time, ``cancel()`` does nothing.
    """

    def __init__(self, responses: Iterator[InferenceResponse], cancel: Callable[[], None] | None = None) -> None:
        self._responses = responses
        self._cancel = cancel
        self._finished = False
        self._cancelled = False

    def __iter__(self) -> ResponseIterator:
        return self

    def __next__(self) -> InferenceResponse:
        response = self._next()
        if response is None:
            raise StopIteration("Iteration is done for the responses.")
        return response

    def __aiter__(self) -> ResponseIterator:
        return self

    async def __anext__(self) -> InferenceResponse:
        response = await asyncio.to_thread(self._next)
        if response is None:
            raise StopAsyncIteration
        return response

    def _next(self) -> InferenceResponse | None:
        """The next response, None at the end."""
        if self._finished:
            return None
        if self._cancelled:  # the cancellation's answer ends the iteration
            self._finished = True
            return to_inference_response(ServingError("request has been cancelled", Code.CANCELLED))
        response = next(self._responses, None)
        if response is None:
            self._finished = True
        return response

    def cancel(self) -> None:
        cancel, self._cancel = self._cancel, None
        if cancel is not None and not self._finished:
            self._cancelled = True
            cancel()


def execute_decoupled(request: InferenceRequest) -> ResponseIterator:
    """``request.exec(decoupled=True)``: sends the request, then iterates the model's responses
    as they come, and an empty final one where the model sends the final flag on its own (as
    Triton's iterator does)."""
    try:
        results = client().stream(to_infer_request(request))
    except Exception as exc:
        return ResponseIterator(iter([to_inference_response(exc)]))
    return ResponseIterator(_responses(results), getattr(results, "cancel", None))


def _responses(results: Iterator[InferResponse | ServingError | StreamEnd]) -> Iterator[InferenceResponse]:
    """Each response; an empty one last only where the model sent its final flag on its own
    (Triton's iterator ends with the response that carries the flag)."""
    try:
        for result in results:
            if result is StreamEnd.FINAL_ALONE:
                yield to_inference_response(None)
                return
            yield to_inference_response(result)
            if isinstance(result, ServingError):
                return
    except Exception as exc:
        yield to_inference_response(exc)


async def execute_decoupled_async(request: InferenceRequest) -> ResponseIterator:
    """``await request.async_exec(decoupled=True)``: the request is sent off the caller's loop;
    iterating the answer waits for each response, as Triton's iterator does."""
    return await asyncio.to_thread(execute_decoupled, request)


def model_control(call: str, *args: Any) -> Any:
    """``load_model`` / ``unload_model`` / ``is_model_ready``: a failure raises
    TritonModelException with the server's message."""
    try:
        return getattr(client(), call)(*args)
    except TritonModelException:
        raise
    except Exception as exc:
        raise TritonModelException(as_serving_error(exc).message) from None
