"""The BLS client of a model replica: a Python model's calls to other models, by deployment handle.

A request goes to a replica of the target model version (``ModelDeployment.bls_infer`` /
``bls_stream``), where it takes the same path as a client's request: validation, the model's
batcher, its statistics. The ``/v2`` replica names the application serving a model version
(:class:`~rayinfer.deployments.model_forwarder.ModelRoutes`: kept for a second). A call from
a model to itself executes in the calling replica, on the calling thread
(:meth:`ModelCore.execute_here`): sent to its own batcher it would wait for the execution that
is making it.

The calls run on an event loop of the client's own, with handles of its own (a handle routes
on the loop it was first used on), so a model may call from its ``execute`` wherever that runs
(the replica's loop, the model's thread, an async model's loop).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Iterator
from typing import Any

from rayinfer.deployments.model_forwarder import ModelRoutes
from rayinfer.deployments.names import SERVER_APP, SERVER_DEPLOYMENT
from rayinfer.deployments.serve_internals import new_handle
from rayinfer.deployments.model_handles import model_handle
from rayinfer.protocol.errors import ServingError, UnavailableError, as_serving_error
from rayinfer.protocol.types import InferRequest, InferResponse, StreamEnd
from rayinfer.serving.model_core import ModelCore


class ReplicaBlsClient:
    """Sends a Python model's BLS requests and model-control calls from its replica."""

    def __init__(self, own_route: tuple[str, str]) -> None:
        """``own_route``: (application, deployment) of the calling model version (a pooled
        version's names its own application and the pool's deployment)."""
        self._own_route = own_route
        self.core: ModelCore | None = None  # set once the model is loaded
        self._routes = ModelRoutes(lambda: self._handle((SERVER_APP, SERVER_DEPLOYMENT)))
        self._handles: dict[tuple[str, str], Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._closed = False

    # ---- the BlsClient interface (adapters/python_backend/bls.py) ----------------------------

    def infer(self, request: InferRequest) -> InferResponse:
        route = self._run(self._route(request))
        if self._is_self(route):
            return _single(self._here(request))
        return self._run(self._infer(route, request))

    async def infer_async(self, request: InferRequest) -> InferResponse:
        route = await asyncio.wrap_future(self._submit(self._route(request)))
        if self._is_self(route):
            return await asyncio.to_thread(lambda: _single(self._here(request)))
        return await asyncio.wrap_future(self._submit(self._infer(route, request)))

    def stream(self, request: InferRequest) -> Iterator[InferResponse | ServingError | StreamEnd]:
        """Sends the request now; the iterator yields each response as it arrives."""
        route = self._run(self._route(request))
        if self._is_self(route):
            return iter(list(self._here(request)))
        results: queue.SimpleQueue[Any] = queue.SimpleQueue()
        return _Stream(results, self._submit(self._forward(route, request, results)))

    def load_model(self, name: str, parameters: dict[str, Any]) -> None:
        self._run(self._server("change_model", "load", name, parameters))

    def unload_model(self, name: str, unload_dependents: bool) -> None:
        self._run(self._server("change_model", "unload", name, {"unload_dependents": unload_dependents}))

    def is_model_ready(self, name: str, version: str) -> bool:
        return self._run(self._server("model_route", name, version, False)) is not None

    # ---- calls ----------------------------------------------------------------------------------

    async def _route(self, request: InferRequest) -> tuple[str, str]:
        return await self._routes.route(request.model_name, request.model_version)

    async def _server(self, method: str, *args: Any) -> Any:
        return await getattr(self._handle((SERVER_APP, SERVER_DEPLOYMENT)), method).remote(*args)

    async def _infer(self, route: tuple[str, str], request: InferRequest) -> InferResponse:
        return await self._handle(route).bls_infer.remote(request)

    async def _forward(self, route: tuple[str, str], request: InferRequest, results: queue.SimpleQueue) -> None:
        responses = self._handle(route).options(stream=True).bls_stream.remote(request, mark_final_alone=True)
        try:
            async for result in responses:
                if result is not None:  # None ends every stream (ModelDeployment.bls_stream)
                    results.put(result)
        except asyncio.CancelledError:  # the caller cancelled the request: so does its model's replica
            responses.cancel()
        except Exception as exc:
            results.put(as_serving_error(exc))
        finally:
            results.put(_END)

    def _here(self, request: InferRequest) -> Iterator[InferResponse | ServingError | StreamEnd]:
        if self.core is None:
            raise ServingError(f"model '{request.model_name}' cannot call itself before it is loaded")
        return self.core.execute_here(request)

    def _is_self(self, route: tuple[str, str]) -> bool:
        return tuple(route) == self._own_route

    def _handle(self, route: tuple[str, str]) -> Any:
        """A handle to ``route`` (application, deployment) of the client's own: a handle routes
        on the event loop it was first used on."""
        handle = self._handles.get(route)
        if handle is None:
            handle = self._handles[route] = model_handle(route, new_handle)
        return handle

    # ---- the client's event loop ------------------------------------------------------------

    def _submit(self, coroutine: Any) -> concurrent.futures.Future:
        with self._lock:
            if self._closed:
                coroutine.close()
                raise UnavailableError(f"model '{self._own_route[0]}' was unloaded: its calls to other models end")
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=_run_until_stopped, args=(self._loop,), name="bls-client", daemon=True).start()
            return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def _run(self, coroutine: Any) -> Any:
        """Block the calling thread (never the client's own) until ``coroutine`` is done."""
        try:
            return self._submit(coroutine).result()
        except Exception as exc:
            raise as_serving_error(exc) from None

    def close(self) -> None:
        """The model is unloaded: later calls fail at once; the loop stops and is closed, and the
        handles go with it."""
        with self._lock:
            self._closed = True
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._handles.clear()


def _run_until_stopped(loop: asyncio.AbstractEventLoop) -> None:
    """The client's loop thread: the loop runs until :meth:`ReplicaBlsClient.close` stops it;
    what it still held is cancelled and the loop closed."""
    try:
        loop.run_forever()
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()  # their callers' futures end cancelled, not waiting for ever
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=5.0))
    finally:
        loop.close()


_END = object()


class _Stream:
    """The responses of one streamed request as they arrive; ``cancel()`` cancels the request."""

    def __init__(self, results: queue.SimpleQueue, call: concurrent.futures.Future) -> None:
        self._results = results
        self._call = call

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> Any:
        result = self._results.get()
        if result is _END:
            self._results.put(_END)  # a later call ends too
            raise StopIteration
        return result

    def cancel(self) -> None:
        self._call.cancel()
        self._results.put(_END)  # the call may be cancelled before it began, and so never end the queue


def _single(results: Iterator[InferResponse | ServingError]) -> InferResponse:
    result = next(iter(results))
    if isinstance(result, ServingError):
        raise result
    return result
