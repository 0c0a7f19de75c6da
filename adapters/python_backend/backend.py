"""Loads a Triton ``model.py`` and runs its ``TritonPythonModel`` as the serving core's executor.

Loading follows Triton's rules: the module is ``default_model_filename`` (``model.py``) of the
version folder, with the version folder and the model folder on ``sys.path`` (in a pool replica, only where
it holds modules of the model's own to import);
``triton_python_backend_utils`` is this package's module; ``auto_complete_config`` completes the
config before it is read; ``initialize(args)`` gets Triton's keys. ``execute`` receives the whole
dynamic batch as a list of requests and returns one response per request (a decoupled model:
answers through each request's response sender and returns None); ``async def execute`` runs on
a loop of the backend's own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import importlib.util
import inspect
import json
import logging
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from rayinfer.adapters.base import model_file
from rayinfer.adapters.model_runner import (
    NOT_ITERATIVE_MESSAGE,
    RESCHEDULED,
    TRANSPORT_PARAMETERS,
    ModelRunner,
    PreparedRequest,
    keep_state,
    trace_compute,
)
from rayinfer.adapters.python_backend import bls, environment, model_context
from rayinfer.adapters.python_backend.model_context import ModelContext
from rayinfer.adapters.python_backend.readiness import ReadinessCheck
from rayinfer.adapters.python_backend.sender_answer import SenderAnswer
from rayinfer.adapters.python_backend.requirements import activate_requirements
from rayinfer.adapters.python_backend.errors import SERVING_CODES
from rayinfer.adapters.python_backend import triton_python_backend_utils as pb_utils
from rayinfer.protocol.dtypes import wire_datatype
from rayinfer.protocol.errors import Code, InternalError, InvalidArgError, ModelConfigError, ServingError, as_serving_error
from rayinfer.protocol.types import InferOutput, InferResponse
from rayinfer.repository.instance_groups import runs_on_gpu
from rayinfer.repository.model_config import ModelConfig, config_to_json
from rayinfer.repository.python_env import model_requirements, own_modules
from rayinfer.repository.sequence_config import sequence_flags

logger = logging.getLogger(__name__)

_PB_UTILS = "triton_python_backend_utils"


class PythonBackendAdapter:
    """Holds one ``TritonPythonModel`` instance: ``load`` imports and initializes it."""

    def __init__(self) -> None:
        self.model: Any = None
        self.model_dir = ""
        self.context: ModelContext | None = None  # what pb_utils answers for this model
        self._modules: tuple[str, str, Any] | None = None  # (its module's name, its file's, the module)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()

    @property
    def runner_class(self) -> type[ModelRunner]:
        return PythonModelRunner

    def model_path(self, model_dir: Path, version: int, config: ModelConfig) -> Path:
        """The ``model.py`` to run: the version's (a backend built on this one runs its own)."""
        return model_file(model_dir, version, config)

    def load(self, model_dir: Path, version: int, config: ModelConfig, auto_complete: bool) -> None:
        path = self.model_path(model_dir, version, config)
        self.model_dir = str(model_dir)
        self.context = ModelContext(self.model_dir, bls.loading_client())
        model_context.loaded(self.context)
        sys.modules.setdefault(_PB_UTILS, pb_utils)
        env = config.parameters.get(environment.PARAMETER)
        if env is not None and env.string_value:  # a conda-pack environment's packages
            environment.activate_execution_env(env.string_value, model_dir, config.name)
        packages = model_requirements(model_dir, version, config)
        if packages:  # requirements.txt or the pip_requirements parameter
            activate_requirements(packages, config.name)
        for folder in (model_dir, path.parent):  # in the pool, only where the model has modules to
            # import: a pool replica holds hundreds of models, and every import reads every folder on sys.path
            if str(folder) not in sys.path and (not model_context.process_shared() or own_modules(folder, path)):
                sys.path.insert(0, str(folder))
        module_name = f"rayinfer_python_model_{config.name}_{version}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ModelConfigError(f"{path}: cannot be imported as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        # As in Triton's stub: the model's module is importable by its file's name (a model
        # running ``unittest.main('model')`` finds its own tests), and argv holds no arguments
        # of the worker process (unittest and argparse in a model read it).
        model_context.register_module(self.context, path.stem, module)
        sys.argv = [""]
        self._modules = (module_name, path.stem, module)
        try:
            with model_context.entered(self.context):  # the module's own code may ask for its folder
                spec.loader.exec_module(module)
        except Exception as exc:
            raise ModelConfigError(f"{path}: failed to import: {type(exc).__name__}: {exc}") from None
        model_class = getattr(module, "TritonPythonModel", None)
        if model_class is None:
            raise ModelConfigError(f"{path}: defines no class 'TritonPythonModel'")
        with model_context.entered(self.context):
            if auto_complete and hasattr(model_class, "auto_complete_config"):
                _auto_complete(model_class, config, path)
            self.model = model_class()
        args = {
            "model_config": json.dumps(config_to_json(config)),
            # A GPU replica sees its one GPU as device 0 (Ray sets CUDA_VISIBLE_DEVICES).
            "model_instance_kind": "GPU" if runs_on_gpu(config) else "CPU",
            "model_instance_name": f"{config.name}_0_0",
            "model_instance_device_id": "0",
            "model_repository": self.model_dir,
            "model_version": str(version),
            "model_name": config.name,
        }
        if hasattr(self.model, "initialize"):
            try:
                self.call(self.model.initialize, args)
            except Exception as exc:
                raise InternalError(f"Failed to initialize model '{config.name}': {type(exc).__name__}: {exc}") from None

    def execute_requests(self, requests: list[pb_utils.InferenceRequest], background: bool = False) -> Any:
        """The model's ``execute`` on one batch, awaited on the backend's loop when async. With
        ``background`` (a decoupled model) an async execute is left running on that loop and its
        future returned: the next batch starts while it awaits, as in Triton."""
        with model_context.entered(self.context):  # an async execute's task copies it
            result = model_code(self.model.execute, requests)
            if not inspect.isawaitable(result):
                return result
            if background and threading.current_thread() is not self._loop_thread:
                return asyncio.run_coroutine_threadsafe(_awaited(result), self._event_loop())
            return self._wait(result)

    def call(self, method: Any, *args: Any) -> Any:
        """Call one of the model's methods; a coroutine is run on the backend's loop."""
        with model_context.entered(self.context):
            result = model_code(method, *args)
            return self._wait(result) if inspect.isawaitable(result) else result

    def _wait(self, awaitable: Any) -> Any:
        if threading.current_thread() is self._loop_thread:
            # An async execute calling its own model with a blocking exec(): its loop is busy
            # with the caller, so this execution gets a loop of its own.
            with ThreadPoolExecutor(1) as pool:  # in this model's context, as the caller
                return pool.submit(contextvars.copy_context().run, asyncio.run, _awaited(awaitable)).result()
        return asyncio.run_coroutine_threadsafe(_awaited(awaitable), self._event_loop()).result()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._loop_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._loop_thread = threading.Thread(target=self._loop.run_forever, name="python-model-loop",
                                                     daemon=True)
                self._loop_thread.start()
            return self._loop

    def unload(self) -> None:
        if self.model is not None and hasattr(self.model, "finalize"):
            self.call(self.model.finalize)
        self.model = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._modules is not None:  # nothing of the process keeps the model's module (a pool
            # replica loads and unloads models all along)
            for name in self._modules[:2]:  # not a reload's new module of the same name
                if sys.modules.get(name) is self._modules[2]:
                    del sys.modules[name]
        if self.context is not None:
            model_context.unloaded(self.context)


class ModelExit(Exception):
    """A model's ``sys.exit()`` (or another BaseException its code raised): an error of the
    call that raised it, never the end of the replica's threads, loops or process."""


def model_code(method: Any, *args: Any) -> Any:
    """``method(*args)``: one of the model's methods, its exits turned into :class:`ModelExit`."""
    try:
        return method(*args)
    except Exception:
        raise
    except BaseException as exc:
        raise ModelExit(f"{type(exc).__name__}: {exc}") from exc


async def _awaited(awaitable: Any) -> Any:
    try:
        return await awaitable
    except Exception:
        raise
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        raise ModelExit(f"{type(exc).__name__}: {exc}") from exc


def _auto_complete(model_class: Any, config: ModelConfig, path: Path) -> None:
    """Run the model's ``auto_complete_config`` on Triton's JSON form of ``config``, in place."""
    wrapper = pb_utils.ModelConfig(config_to_json(config))
    try:
        completed = model_class.auto_complete_config(wrapper)
    except Exception as exc:
        raise ModelConfigError(f"{path}: auto_complete_config failed: {type(exc).__name__}: {exc}") from None
    doc = (completed or wrapper).as_dict()
    try:
        config.Clear()
        json_format.ParseDict(doc, config)
    except json_format.ParseError as exc:
        raise ModelConfigError(f"{path}: auto_complete_config gave an invalid config: {exc}") from None


class PythonModelRunner(ModelRunner):
    """The executor of a Python model: validates as every model does, then hands the whole batch
    to ``execute`` as Triton's requests, one response (or error) per request."""

    calls_models = True  # execute may call other models (BLS) and wait for their answers

    def __init__(self, spec: Any, adapter: Any, version: int) -> None:
        super().__init__(spec, adapter, version)
        self.decoupled = bool(spec.config.model_transaction_policy.decoupled)
        # Requests the model reschedules run again (sequence_batching { iterative_sequence: true }).
        self.iterative = bool(spec.sequence_batching is not None and spec.sequence_batching.iterative)
        self._readiness = ReadinessCheck(spec.name)

    def execute(self, batch: Sequence[PreparedRequest]) -> list[InferResponse | ServingError] | None:
        start = time.perf_counter_ns()
        requests = [self._request(p) for p in batch]
        infer_start = time.perf_counter_ns()
        try:
            # A decoupled async execute runs on in the background (unless its requests may be
            # rescheduled, which is known only once it returned).
            responses = self.adapter.execute_requests(requests, self.decoupled and not self.iterative)
        except Exception as exc:  # the requests fail (those already answered keep their answer)
            error = self._execute_error(exc)
            return self._failed(batch, error, [] if self.decoupled else [q._answer for q in requests])
        infer_end = time.perf_counter_ns()
        trace_compute(batch, infer_start, infer_end)
        if self.decoupled:
            if isinstance(responses, concurrent.futures.Future):  # an async execute, still running
                responses.add_done_callback(functools.partial(self._async_done, batch))
                self._record(batch, start, infer_start, infer_end)
                return None
            if responses is not None:  # Triton's message, which names the model instance
                instance = f"{self.spec.name}_0_0"  # the model_instance_name given to initialize
                return self._failed(batch, InternalError(
                    f"Failed to process the request(s) for model '{instance}', message: Python model "
                    f"'{instance}' is using the decoupled mode and the execute function must return None."))
            marks = self._rescheduled_decoupled(batch, requests)
            self._record(batch, start, infer_start, infer_end, marks)
            return marks
        if responses is None and all(q._sender_taken for q in requests):  # answered through their senders
            responses = [None] * len(batch)
        if not isinstance(responses, list) or len(responses) != len(batch):
            count = len(responses) if isinstance(responses, list) else type(responses).__name__
            return self._failed(batch, InternalError(
                f"model '{self.spec.name}' returned {count} responses for {len(batch)} requests; "
                "execute must return one InferenceResponse per request"
            ))
        results = [self._rescheduled(r) if _rescheduling(q) else self._result(p, q, r)
                   for p, q, r in zip(batch, requests, responses)]
        self._record(batch, start, infer_start, infer_end, results)
        return results

    def _execute_error(self, exc: BaseException) -> ServingError:
        reason = str(exc) if isinstance(exc, ModelExit) else f"{type(exc).__name__}: {exc}"
        return InternalError(f"Failed to process the request(s) for model '{self.spec.name}', message: {reason}")

    def _result(self, prepared: PreparedRequest, request: pb_utils.InferenceRequest, response: Any) -> Any:
        """A non-decoupled request's result: what ``execute`` returned for it, or what the model
        sent through its response sender (before returning, or later: a LateAnswer)."""
        answer = request._answer
        if not request._sender_taken or answer is None:
            return self._answer(prepared, response)
        if response is not None:  # returned: the sender is closed (an answer it sent comes first)
            request._sender.close()
            return answer.result if answer.result is not None else self._answer(prepared, response)
        return answer.after_return()

    def _async_done(self, batch: Sequence[PreparedRequest], done: concurrent.futures.Future) -> None:
        """A decoupled model's async execute ended: an exception goes to the log with its
        traceback, and ends the streams of its requests that are still open."""
        exc = None if done.cancelled() else done.exception()
        if exc is None:
            return
        logger.error("%s", "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip())
        error = self._execute_error(exc)
        for p in batch:
            if p.sender is not None and not p.sender.closed:
                try:
                    p.sender.send(error, final=True)
                except ServingError:  # its final response came meanwhile
                    pass

    def _rescheduled(self, response: Any) -> Any:
        """The result of a request the model rescheduled, returning ``response`` for it."""
        if not self.iterative:
            return InvalidArgError(NOT_ITERATIVE_MESSAGE)
        if response is not None:  # Triton's message, spelling included
            return InternalError("Expected a None object in the execute function return list for reschduled "
                                 f"request, found type '{type(response).__name__}'.")
        return RESCHEDULED

    def _rescheduled_decoupled(self, batch: Sequence[PreparedRequest],
                               requests: list[pb_utils.InferenceRequest]) -> list[Any] | None:
        """A decoupled execution's results: RESCHEDULED for the requests to run again (None for
        the others, answered through their senders), or None when none is rescheduled. A model
        without iterative_sequence ends a rescheduled request's stream with Triton's error."""
        again = [_rescheduling(q) and not p.padding for p, q in zip(batch, requests)]
        if not any(again):
            return None
        if self.iterative:
            return [RESCHEDULED if a else None for a in again]
        for p, a in zip(batch, again):
            if a and not p.sender.closed:
                p.sender.send(InvalidArgError(NOT_ITERATIVE_MESSAGE), final=True)
        return None

    def is_ready(self) -> bool:
        """The model's own ``is_ready()`` (or ``is_model_ready()``: Triton's test models use both
        names) when it has one, by Triton's rules (:class:`ReadinessCheck`)."""
        model = self.adapter.model
        check = getattr(model, "is_ready", None) or getattr(model, "is_model_ready", None)
        return True if check is None else self._readiness.ask(lambda: self.adapter.call(check))

    def custom_metrics(self) -> tuple[int, list[dict[str, Any]]] | None:
        """The process's own metric families (``pb_utils.MetricFamily``) and their update count;
        None where another model of the process reports them (a pool replica)."""
        if not model_context.reports_process_metrics(self.adapter.context):
            return None
        return pb_utils.metrics_snapshot()

    def _request(self, prepared: PreparedRequest) -> pb_utils.InferenceRequest:
        request = prepared.request
        inputs = [pb_utils.Tensor(name, array) for name, array in prepared.arrays.items()]
        # As in Triton, the model sees the request's own parameters; how the answer is encoded
        # (binary_data_output) and scheduled (priority, timeout) are the server's.
        parameters = {k: v for k, v in request.parameters.items() if k not in TRANSPORT_PARAMETERS}
        timeout = request.parameters.get("timeout", 0)
        correlation_id, start, end = sequence_flags(request.parameters)
        flags = (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if start else 0) | \
            (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END if end else 0)
        pb_request = pb_utils.InferenceRequest(
            inputs=inputs, requested_output_names=list(prepared.output_names), request_id=request.id or "",
            correlation_id=correlation_id, flags=flags, timeout=timeout if isinstance(timeout, int) else 0,
            model_name=self.spec.name, model_version=int(self.version),
        )
        pb_request._parameters = parameters  # a client's may hold doubles too, which Triton passes on
        pb_request._cancelled = cancelled = lambda: prepared.cancelled
        if prepared.trace_link is not None:  # traced: BLS requests given request.trace() are its children
            pb_request._trace = pb_utils.InferenceTrace(prepared.trace_link)
        if prepared.sender is not None:
            sender = prepared.sender
            pb_request._sender = pb_utils.InferenceResponseSender(
                lambda response, final: sender.send(None if response is None else self._answer(prepared, response),
                                                    final),
                cancelled,
            )
        else:  # a non-decoupled model may answer through the sender too (made only when asked for;
            # the factory is given the request then: holding it here would make a reference cycle,
            # which only the garbage collector frees, and its runs cost every request)
            pb_request._sender_factory = functools.partial(self._answer_sender, prepared)
        return pb_request

    def _answer_sender(self, prepared: PreparedRequest,
                       pb_request: pb_utils.InferenceRequest) -> pb_utils.InferenceResponseSender:
        """A non-decoupled request's response sender: its one response is the request's answer."""
        answer = pb_request._answer = SenderAnswer()
        return pb_utils.InferenceResponseSender(
            lambda response, final: None if response is None else answer.sent(self._answer(prepared, response)),
            pb_request._cancelled, decoupled=False,
        )

    def _answer(self, prepared: PreparedRequest, response: Any) -> InferResponse | ServingError:
        """A model's InferenceResponse as the request's answer (only the outputs it asked for)."""
        if not isinstance(response, pb_utils.InferenceResponse):
            return InternalError(f"model '{self.spec.name}' returned {type(response).__name__}, not an InferenceResponse")
        if response.has_error():
            error = response.error()
            return ServingError(error.message(), SERVING_CODES.get(error.code(), Code.INTERNAL))
        by_name = {t.name(): t._data for t in response.output_tensors()}  # BF16 too (as_numpy refuses it)
        if self._state_outputs:  # a sequence model's implicit state, for the sequence's next request
            keep_state([prepared], [by_name], self._state_outputs, self.spec.max_batch_size > 0)
        outputs = []
        for name in prepared.output_names:
            array = by_name.get(name)
            if array is None:  # as in Triton, the response carries the outputs the model gave
                continue
            try:
                datatype = wire_datatype(array.dtype)
            except ServingError as exc:
                return InternalError(f"output '{name}' of model '{self.spec.name}': {exc.message}")
            try:
                datatype, array = self.classified(prepared, name, datatype, array)
            except ServingError as exc:
                return exc
            outputs.append(InferOutput(name, datatype, tuple(array.shape), array))
        return InferResponse(
            model_name=self.spec.name, model_version=self.version, outputs=outputs, id=prepared.request.id,
            parameters=response._parameters,  # the dict itself: parameters() is the model's JSON view
        )

    def _record(self, batch: Sequence[PreparedRequest], start: int, infer_start: int, infer_end: int,
                results: list[InferResponse | ServingError] | None = None) -> None:
        end = time.perf_counter_ns()
        self.stats.record_execution(len(batch), sum(p.rows for p in batch), infer_start - start,
                                    infer_end - infer_start, end - infer_end)
        for index, p in enumerate(batch):
            if p.padding or (results is not None and results[index] is RESCHEDULED):  # counted when it ends
                continue
            if results is not None and isinstance(results[index], ServingError):
                self.stats.record_failure(end - p.arrival_ns)
            else:
                self.stats.record_success(end - p.arrival_ns, start - p.arrival_ns)

    def _failed(self, batch: Sequence[PreparedRequest], error: ServingError,
                answers: Sequence[SenderAnswer | None] = ()) -> list[Any]:
        """``error`` for every request of ``batch``, but those whose sender already answered them."""
        now = time.perf_counter_ns()
        results: list[Any] = []
        for index, p in enumerate(batch):
            answer = answers[index] if index < len(answers) else None
            if answer is not None and answer.result is not None:
                results.append(answer.result)
                continue
            if not p.padding:
                self.stats.record_failure(now - p.arrival_ns)
            results.append(as_serving_error(error))
        return results


def _rescheduling(request: pb_utils.InferenceRequest) -> bool:
    """Whether the model asked for ``request`` to run again (``set_release_flags``)."""
    return bool(request._release_flags & pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
