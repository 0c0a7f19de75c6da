"""ModelCore: one served model version, with no Ray, HTTP or gRPC inside.

A request goes through the same steps whatever its protocol: decoded by a codec
(:mod:`rayinfer.protocol`), then here *resolved and validated* (:meth:`ModelCore.prepare`),
*scheduled* (the dynamic batcher, or straight to execution), *executed* by the executor
(:mod:`executor`) and answered with its own response or error, which the codec encodes. The
translators over it are :mod:`model_http` and :mod:`model_grpc`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rayinfer.adapters.model_runner import LateAnswer
from rayinfer.protocol.custom_metrics import PROCESS_KEY
from rayinfer.protocol.errors import InternalError, InvalidArgError, ServingError, UnavailableError, as_serving_error
from rayinfer.protocol.limits import DEFAULT_CONNECTION_LIMITS
from rayinfer.protocol.shared_memory import SharedMemoryRegistry
from rayinfer.protocol.types import InferRequest, InferResponse, StreamEnd
from rayinfer.repository.model_config import config_to_json
from rayinfer.serving.batcher import DynamicBatcher, QueueFullError
from rayinfer.serving.response_cache import ResponseCache
from rayinfer.serving.protocol_stamps import PROTOCOL_STAMPS
from rayinfer.serving.trace import Trace, Tracer, tensor_activity
from rayinfer.serving.sequencer import SequenceBatcher
from rayinfer.serving.executor import BlockingSender, Executor, ResponseSender, Result

# Executions that take less than this (moving average) run on the event loop itself: handing a
# short execution to a thread and back costs more than the execution. Longer ones run on the
# model's thread so the loop keeps accepting requests.
INLINE_EXECUTION_LIMIT_S = 0.002
# A replica listener's (host, port).
Address = tuple[str, int]
# (the version asked for, "" for every served version; this replica's statistics snapshot) ->
# that model's figures summed over all replicas, as (version, snapshot) pairs.
StatisticsSource = Callable[[str, dict[str, Any]], Awaitable[list[tuple[str, dict[str, Any]]]]]


class ModelCore:
    """Answers one model version's requests in one replica; keeps its metadata and config."""

    def __init__(self, executor: Executor, versions: Sequence[int | str],
                 statistics: StatisticsSource | None = None, shm: SharedMemoryRegistry | None = None,
                 cache: ResponseCache | None = None) -> None:
        spec = executor.spec
        # The response cache, when the model and the server enable it (else no lookup at all).
        self._cache = cache
        if cache is None:
            self._schedule = self._schedule_model  # type: ignore[method-assign]
        # The system shared memory regions requests may name (the codecs read and write them).
        self.shm = shm if shm is not None else SharedMemoryRegistry()
        self.executor = executor
        self.spec = spec
        self.name = spec.name
        self.version = str(getattr(executor, "version", ""))
        self.decoupled = bool(getattr(executor, "decoupled", False))
        # A decoupled model's time to first response is taken as its first response leaves (stream).
        executor.stats.decoupled = self.decoupled
        self.metadata = _metadata(spec, [str(v) for v in versions])
        # A decoupled request's responses made and not yet taken, then its sender waits
        # (--max-queued-responses: the replica sets it from its connection limits).
        self.max_queued_responses = DEFAULT_CONNECTION_LIMITS.max_queued_responses
        self.config_json = config_to_json(spec.config)
        # Told of each answered request that is not a sequence's (a rollout's shadow traffic).
        self.on_answer: Callable[[InferRequest, InferResponse], None] | None = None
        # The trace extension's sampling of this model's requests (off until configured).
        self.tracer = Tracer(self.name, self.version)
        # A sequence model with several replicas (set by the replica: :meth:`route_sequences`).
        self._sequence_owner: Callable[[dict[str, Any], Callable[[Any], bool]], Address | None] | None = None
        self._send_on: Callable[[Address, InferRequest], Awaitable[InferResponse]] | None = None
        self._stream_on: Callable[[Address, InferRequest], AsyncIterator[Result]] | None = None
        self._statistics = statistics
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{spec.name}-v{self.version}")
        # Unknown until measured: the first executions run on the thread.
        self._execution_s_avg = float("inf")
        self._on_thread = 0  # executions handed to the model thread and not finished
        # Short executions may run on the loop (see _execute). Not for a model whose execute may
        # wait on this process's own loop: a Python model's BLS call in the model pool, whose
        # target may be a neighbour in the same replica.
        self.inline_executions = True
        # An executor that runs each request on the loop itself, without batcher or thread.
        self._execute_async = getattr(executor, "execute_async", None)
        batching = spec.dynamic_batching
        self._batcher: DynamicBatcher | None = None
        self._sequencer: SequenceBatcher | None = None
        if spec.sequence_batching is not None and self._execute_async is None:
            self._sequencer = SequenceBatcher(self._execute, spec.sequence_batching, model=spec.name,
                                              max_batch_size=spec.max_batch_size, on_reject=self._rejected)
        if batching is not None and spec.max_batch_size > 0 and self._execute_async is None:
            self._batcher = DynamicBatcher(
                self._execute,
                max_batch_size=spec.max_batch_size,
                max_queue_delay_s=batching.max_queue_delay_us / 1e6,
                preferred_batch_sizes=batching.preferred_batch_sizes,
                priority_levels=batching.priority_levels,
                default_priority_level=batching.default_priority_level,
                default_policy=batching.default_queue_policy,
                level_policies=dict(batching.priority_queue_policy),
                on_reject=self._rejected,
            )
        elif getattr(executor, "batch_delay_s", None) is not None:  # an ensemble batching its requests
            self._batcher = DynamicBatcher(
                executor.execute_batch_async, max_batch_size=spec.max_batch_size,
                max_queue_delay_s=executor.batch_delay_s, preferred_batch_sizes=(),
            )

    # ---- requests ---------------------------------------------------------------------------

    def prepare(self, request: InferRequest) -> Any:
        """Validate a decoded request against the model (rejected requests are not counted, as
        in Triton). An output requested twice is refused, as Triton's current release does
        (2.51 answered it once)."""
        if request.outputs and len(request.outputs) > 1:
            seen: set[str] = set()
            for output in request.outputs:
                if output.name in seen:
                    raise InvalidArgError(f"Duplicate output name '{output.name}' is not allowed in a request")
                seen.add(output.name)
        return self.executor.prepare(request)

    def route_sequences(self, owner: Callable[[dict[str, Any], Callable[[Any], bool]], Address | None],
                        send_on: Callable[[Address, InferRequest], Awaitable[InferResponse]],
                        stream_on: Callable[[Address, InferRequest], AsyncIterator[Result]]) -> None:
        """Send each request of a sequence another replica holds on to that replica:
        ``owner(parameters, holds)`` names its listener (None: this replica; ``holds(id)``:
        whether the sequence runs here), ``send_on`` sends it, and ``stream_on`` sends a
        decoupled model's and relays its responses as they come."""
        self._sequence_owner, self._send_on, self._stream_on = owner, send_on, stream_on

    def _held_elsewhere(self, prepared: Any) -> Address | None:
        """The listener of the replica holding this request's sequence, when not this one."""
        request = prepared.request
        if self._sequence_owner is None or request.forwarded or self._sequencer is None:
            return None
        return self._sequence_owner(request.parameters, self._sequencer.holds)

    async def infer(self, prepared: Any, batched: bool = False) -> InferResponse:
        """The one response of a request to a non-decoupled model; raises its error.
        ``batched``: the request is already a batch (an ensemble's step carrying the rows of the
        requests its own batcher gathered), executed at once, past this model's batcher, whose
        wait would come on top of the ensemble's."""
        owner = self._held_elsewhere(prepared)
        if owner is not None:
            assert self._send_on is not None
            return await self._send_on(owner, prepared.request)
        try:
            if self._traces(prepared):
                result = await self._traced(prepared, batched)
            elif batched:
                result = await self._execute_now(prepared)
            else:
                result = await self._schedule(prepared)
        except asyncio.CancelledError:
            self._cancelled(prepared)
            raise
        if isinstance(result, ServingError):
            raise result
        if self.on_answer is not None and self._sequencer is None:
            self.on_answer(prepared.request, result)
        return result

    async def stream(self, prepared: Any) -> AsyncIterator[Result]:
        """Every response of one request, in order: zero to many for a decoupled model, else
        exactly one (its error included). A decoupled execution that fails ends the stream
        with its error."""
        owner = self._held_elsewhere(prepared)
        if owner is not None:  # the replica holding its sequence answers
            assert self._send_on is not None and self._stream_on is not None
            try:
                if self.decoupled:
                    async for result in self._stream_on(owner, prepared.request):
                        yield result
                else:
                    yield await self._send_on(owner, prepared.request)
            except ServingError as exc:
                yield exc
            return
        if not self.decoupled:
            yield await (self._traced(prepared) if self._traces(prepared) else self._schedule(prepared))
            return
        sender = prepared.sender = ResponseSender(self.name, self.max_queued_responses)
        # Traced as any request, to its final response (each response's outputs at TENSORS).
        trace = self._begin_trace(prepared) if self._traces(prepared) else None
        protocol = PROTOCOL_STAMPS.get()
        received: list[tuple[str, int]] = []
        sent_elsewhere = False
        if trace is not None and trace.parent is None and protocol is not None and protocol.model == self.name \
                and protocol.finish is None:
            received = protocol.received
            # A stream's request: the /v2 replica adds the send stamps of its responses.
            sent_elsewhere = protocol.sent_elsewhere and trace.writes_timestamps
            if sent_elsewhere:
                protocol.token = trace.token
        done = asyncio.ensure_future(self._schedule(prepared))

        def end_on_failure(task: asyncio.Future) -> None:
            if task.cancelled():
                return
            error = task.exception()  # retrieved even when the final response has been sent
            if sender.closed:
                return
            result = None if error is not None else task.result()
            if error is not None or isinstance(result, ServingError):
                sender.send(as_serving_error(error) if error is not None else result, final=True)

        done.add_done_callback(end_on_failure)
        first = True
        try:
            async for response in sender.responses():
                if first:
                    self.executor.stats.record_first_response(time.perf_counter_ns() - prepared.arrival_ns)
                    first = False
                if trace is not None:
                    trace.tensors += self._output_tensors(trace, response)
                yield response
        finally:
            sender.cancel()  # a send waiting for room (or past it) now raises
            if not sender.closed:  # the caller stopped listening: the request is cancelled
                self._cancelled(prepared)
                done.cancel()
            if trace is not None:  # it ends when its execution has returned too
                def end_trace(_: Any = None) -> None:
                    trace.stamps.append(("REQUEST_END", time.perf_counter_ns()))
                    trace.stamps += received  # a stream's request: when the /v2 replica read it
                    self.tracer.finish(prepared.request, trace, awaits_send=sent_elsewhere)

                if done.done():
                    end_trace()
                else:  # the final response came before the execution returned
                    done.add_done_callback(end_trace)

    def _traces(self, prepared: Any) -> bool:
        """Whether the request may be traced: the tracer samples, or a traced request sent it."""
        return self.tracer.active or prepared.request.trace_parent is not None

    def _begin_trace(self, prepared: Any) -> Trace | None:
        """The request's trace, when traced (a traced ensemble's step always is, at the
        ensemble's levels): its first timestamps (the execution adds its own to
        ``prepared.trace``) and, at the TENSORS level, its inputs; else None."""
        link = prepared.request.trace_parent
        protocol = PROTOCOL_STAMPS.get()
        if protocol is not None and (protocol.model != self.name or protocol.finish is not None):
            protocol = None  # another model's request (an ensemble's, a BLS caller's)
        if link is not None:
            trace = self.tracer.child(link)
        else:
            trace = self.tracer.sample(protocol.context if protocol is not None else None)
        if trace is None:
            return None
        trace.stamps += [("REQUEST_START", prepared.arrival_ns), ("QUEUE_START", time.perf_counter_ns())]
        if trace.exporter is not None:
            received = protocol.received if protocol is not None and link is None else []
            self.tracer.start(trace, prepared.arrival_ns, received)
        prepared.trace, prepared.trace_link = trace.stamps, trace.link
        if trace.traces_tensors:
            trace.tensors += [tensor_activity("TENSOR_QUEUE_INPUT", t.name, t.datatype, t.data)
                              for t in prepared.request.inputs]
        return trace

    @staticmethod
    def _output_tensors(trace: Trace, result: Any) -> list[dict[str, Any]]:
        """A response's outputs as the TENSORS level traces them (none below it, or for an error)."""
        if not trace.traces_tensors or not isinstance(result, InferResponse):
            return []
        return [tensor_activity("TENSOR_BACKEND_OUTPUT", o.name, o.datatype, o.data) for o in result.outputs]

    async def _traced(self, prepared: Any, batched: bool = False) -> Any:
        """Schedule a request (``batched``: execute it at once), tracing it when traced
        (Triton's timestamps, and its tensors at the TENSORS level)."""
        trace = self._begin_trace(prepared)
        if trace is None:
            return await (self._execute_now(prepared) if batched else self._schedule(prepared))
        request, tracer = prepared.request, self.tracer
        try:
            result = await (self._execute_now(prepared) if batched else self._schedule(prepared))
        finally:
            trace.stamps.append(("REQUEST_END", time.perf_counter_ns()))
        trace.tensors += self._output_tensors(trace, result)
        protocol = PROTOCOL_STAMPS.get()
        if trace.parent is None and protocol is not None and protocol.model == self.name and protocol.finish is None:
            # Received by this replica's listener: the trace ends once the response has left
            # (a stream's: once the ``/v2`` replica has its response, and its send stamps).
            trace.stamps += protocol.received
            sent_elsewhere = protocol.sent_elsewhere and trace.writes_timestamps
            if sent_elsewhere:
                protocol.token = trace.token
            protocol.finish = lambda start, end: tracer.finish(request, trace, protocol.send_stamps(start, end),
                                                               sent_elsewhere)
        else:
            tracer.finish(request, trace)
        return result

    def execute_here(self, request: InferRequest) -> Iterator[Result | StreamEnd]:
        """A request from this model's own ``execute`` (a model calling itself): validated and
        executed on the calling thread, past the batcher and the model thread, which the calling
        execution holds; its responses (errors included) as they come, then
        ``StreamEnd.FINAL_ALONE`` if a decoupled model sent its final flag on its own."""
        prepared = self.prepare(request)
        sender = prepared.sender = BlockingSender(self.name, self.max_queued_responses) if self.decoupled else None
        results = self.executor.execute([prepared])
        if sender is None or results is not None:  # an answer, or a decoupled execution that failed
            result = results[0] if results else InternalError(f"model '{self.name}' gave no response")
            yield result.wait_blocking() if isinstance(result, LateAnswer) else result
            return
        try:
            yield from sender.responses()
            if not sender.final_yielded:
                yield StreamEnd.FINAL_ALONE
        finally:
            sender.cancel()  # the caller stopped taking them: a send waiting for room raises

    async def _schedule(self, prepared: Any) -> Any:
        """The request's result: from the response cache when it holds it, else the model's."""
        cache = self._cache
        assert cache is not None  # without one, _schedule is _schedule_model
        start = time.perf_counter_ns()
        key = cache.key(prepared.request)
        cached = cache.get(key, prepared.request, self.name, self.version)
        lookup_end = time.perf_counter_ns()
        stats = self.executor.stats
        if cached is not None:
            stats.record_cache_hit(lookup_end - prepared.arrival_ns, lookup_end - start)
            return cached
        result = await self._schedule_model(prepared)
        if isinstance(result, InferResponse):
            insert_start = time.perf_counter_ns()
            trim = cache.put(key, result)
            stats.record_cache_miss(lookup_end - start + time.perf_counter_ns() - insert_start)
            if trim:  # every entry's size on the node: not on the loop
                await asyncio.to_thread(cache.trim)
        return result

    async def _schedule_model(self, prepared: Any) -> Any:
        if self._sequencer is not None:
            result = await self._sequencer.submit(prepared)
        elif self._batcher is not None:
            # The schedule-policy parameters (checked by the codecs: non-negative integers).
            parameters = prepared.request.parameters
            try:
                result = await self._batcher.submit(prepared, prepared.rows, parameters.get("priority", 0),
                                                    parameters.get("timeout", 0))
            except QueueFullError as exc:  # Triton's message names the request
                raise UnavailableError(f"[request id: {prepared.request.id or '<id_unknown>'}] {exc}") from None
        elif self._execute_async is not None:  # an ensemble: each request runs its own steps
            return await self._execute_async(prepared)
        else:
            result = (await self._execute([prepared]))[0]
        # A Python model may answer through the request's response sender after execute returned.
        return await result.wait() if isinstance(result, LateAnswer) else result

    async def _execute_now(self, prepared: Any) -> Any:
        """One request's result, executed at once (a batch already: past the batcher)."""
        result = (await self._execute([prepared]))[0]
        return await result.wait() if isinstance(result, LateAnswer) else result

    async def _execute(self, batch: list[Any]) -> list[Any]:
        """Execute on the loop when executions are known to be short, else on the model thread;
        one at a time either way (a model instance executes one batch at a time, as in Triton):
        not on the loop while the thread still has executions. A decoupled model's always run on
        the thread: its sends past --max-queued-responses wait there for the loop to take them."""
        if (self._execution_s_avg < INLINE_EXECUTION_LIMIT_S and not self._on_thread and not self.decoupled
                and self.inline_executions):
            results, elapsed = self._timed_execute(batch)
        else:
            loop = asyncio.get_running_loop()
            self._on_thread += 1
            try:
                results, elapsed = await loop.run_in_executor(self._thread, self._timed_execute, batch)
            finally:
                self._on_thread -= 1
        average = self._execution_s_avg
        self._execution_s_avg = elapsed if average == float("inf") else 0.8 * average + 0.2 * elapsed
        return results if results is not None else [None] * len(batch)

    def _cancelled(self, prepared: Any) -> None:
        """The client gave up on a request: a running model that looks (``is_cancelled()``) can
        stop early; one that had not started never will (the batcher skips it), and counts as a failure, as in Triton (CANCELED)."""
        prepared.cancelled = True
        if not prepared.started:
            self.executor.stats.record_failure(time.perf_counter_ns() - prepared.arrival_ns, "CANCELED")

    def _rejected(self, prepared: Any) -> None:
        """A request whose queue timeout expired (or whose sequence's wait for a slot did): a
        failure, as Triton counts it (REJECTED)."""
        self.executor.stats.record_failure(time.perf_counter_ns() - prepared.arrival_ns, "REJECTED")

    def _timed_execute(self, batch: list[Any]) -> tuple[list[Result] | None, float]:
        """The execution and its own duration: the hand-off to and from the model thread is not
        the model's time, and counting it would keep a busy loop from ever running inline."""
        start = time.perf_counter()
        for prepared in batch:
            prepared.started = True
        results = self.executor.execute(batch)
        end = time.perf_counter()
        for prepared in batch:
            if getattr(prepared, "trace", None) is not None:
                prepared.trace += [("COMPUTE_START", int(start * 1e9)), ("COMPUTE_END", int(end * 1e9))]
        return results, end - start

    async def ready(self) -> bool:
        """Whether the model says it can serve (a Python model's ``is_ready()``, off the loop;
        true when the executor has no such check)."""
        check_async = getattr(self.executor, "is_ready_async", None)
        if check_async is not None:  # an ensemble: ready when its members are
            return bool(await check_async())
        check = getattr(self.executor, "is_ready", None)
        return True if check is None else await asyncio.to_thread(check)

    @property
    def open_sequences(self) -> int:
        """Sequences this core holds (a sequence model's, started and not ended or timed out)."""
        return self._sequencer.open_sequences if self._sequencer is not None else 0

    # ---- statistics -------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """This replica's statistics plus its requests waiting for execution (a gauge) and the
        model's own metrics, if it has any."""
        snapshot = self.executor.stats.snapshot()
        queue = self._sequencer or self._batcher
        snapshot["pending_request_count"] = queue.pending_requests if queue is not None else 0
        snapshot["response_cache"] = self._cache is not None
        if self._cache is not None:
            snapshot["cache_evictions"] = self._cache.evictions
        custom_metrics = getattr(self.executor, "custom_metrics", None)
        families = custom_metrics() if custom_metrics is not None else None
        if families is not None:  # the process's own metric families (a Python model's), if it reports them
            snapshot["custom_metrics_version"], snapshot["custom_metrics"] = families
            snapshot["custom_metrics_process"] = PROCESS_KEY
        return snapshot

    async def statistics(self, version: str) -> list[tuple[str, dict[str, Any]]]:
        """(version, figures) of ``version`` ("" for every served version) summed over all
        replicas, from the statistics source when there is one, else this replica's own."""
        snapshot = self.snapshot()
        if self._statistics is not None:
            merged = await self._statistics(version, snapshot)
            if merged:
                return merged
        return [(self.version, snapshot)]

    def close(self) -> None:
        """Unload the model, then let its thread go."""
        close = getattr(self.executor, "close", None)
        if self._sequencer is not None:
            self._sequencer.close()
        try:
            if close is not None:
                close()
        finally:
            self._thread.shutdown(wait=False)

    async def aclose(self) -> None:
        """:meth:`close` from the replica's loop: the model's own unloading (a Python model's
        ``finalize``, which may call other models) runs in a thread, not on the loop."""
        close = getattr(self.executor, "close", None)
        if self._sequencer is not None:
            self._sequencer.close()
        try:
            if close is not None:
                await asyncio.to_thread(close)
        finally:
            self._thread.shutdown(wait=False)


def _metadata(spec: Any, versions: list[str]) -> dict[str, Any]:
    """The model's metadata document (Triton's HTTP form; the gRPC message is built from it)."""
    batch_dim = [-1] if spec.max_batch_size > 0 else []

    def tensors(specs: Any) -> list[dict[str, Any]]:
        return [{"name": t.name, "datatype": t.datatype, "shape": batch_dim + list(t.dims)} for t in specs]

    return {
        "name": spec.name,
        "versions": versions,
        "platform": spec.platform or spec.backend,
        "inputs": tensors(spec.inputs),
        "outputs": tensors(spec.outputs),
    }
