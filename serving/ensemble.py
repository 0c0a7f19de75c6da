"""The executor of an ensemble: each request runs the step graph, calling the member models.

A step starts as soon as the tensors it maps in exist, so independent steps run concurrently;
tensors move between steps as numpy arrays, and each call goes to the member's own deployment,
where it meets that model's batcher like any client's request (steps batch across ensemble
requests). A failing step fails only its request, with an error naming the step and model; the
steps still running for that request are cancelled. No Ray here: the deployment gives the
executor a :class:`StepCaller` (and a :class:`StepStreamer` for decoupled members).

A decoupled member answers a step with zero to many responses. Each response forks a *flow*:
the rest of the graph runs once per response, with that response's outputs, and every flow
that completes the graph is one response of the ensemble, which is then decoupled too (its
responses stream over gRPC). Steps a flow shares with the flow it forked from (started before
the fork) run once, their result shared. Decoupled steps must lie on one path (checked at load).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np

from rayinfer.adapters.batching import group_by_signature, merge_inputs, split_outputs
from rayinfer.adapters.model_runner import TRANSPORT_PARAMETERS, ModelRunner, PreparedRequest
from rayinfer.protocol.errors import ServingError, as_serving_error
from rayinfer.protocol.types import InferInput, InferOutput, InferRequest, InferResponse, RequestedOutput
from rayinfer.repository.ensemble import EnsemblePlan, EnsembleStep
from rayinfer.repository.model_config import ModelSpec

# Sends one request to a member model version; returns its response or raises its error.
StepCaller = Callable[[InferRequest], Awaitable[InferResponse]]
# Sends one request to a decoupled member; its responses as they come, its error raised.
StepStreamer = Callable[[InferRequest], AsyncIterator[InferResponse]]
# (model, version) -> whether that member is ready to serve.
ReadyCheck = Callable[[str, str], Awaitable[bool]]
# (datatype, shape, data) of one ensemble tensor.
Tensor = tuple[str, tuple[int, ...], np.ndarray]
# Transport parameters of the ensemble's request that its steps' requests carry too.
_STEP_PARAMETERS = frozenset({"priority", "sequence_id", "sequence_start", "sequence_end"})


class EnsembleExecutor(ModelRunner):
    """Validates requests against the ensemble's own config (as any model does) and runs them
    through the steps, each alone (``execute_async``) or, when the ensemble batches its requests,
    several together (``execute_batch_async``); each request gets its own response or error, or,
    when a member is decoupled, its own stream of them."""

    def __init__(self, spec: ModelSpec, plan: EnsemblePlan, version: int, call: StepCaller,
                 member_ready: ReadyCheck | None = None, stream: StepStreamer | None = None,
                 decoupled_members: frozenset[tuple[str, str]] = frozenset()) -> None:
        super().__init__(spec, adapter=None, version=version)  # type: ignore[arg-type]
        self.plan = plan
        self._call = call
        self._stream = stream
        self._member_ready = member_ready
        self._producer = {t: s.index for s in plan.steps for _, t in s.output_map}
        self._reads = {s.index: s.consumes + ((s.run_if_present,) if s.run_if_present else ()) for s in plan.steps}
        self._decoupled_steps = {s.index for s in plan.steps if (s.model_name, s.model_version) in decoupled_members}
        # An ensemble with a decoupled member streams its responses (the serving core reads this).
        self.decoupled = bool(self._decoupled_steps)
        # The serving core batches the ensemble's requests when this is set (never when decoupled).
        self.batch_delay_s = None if plan.batch_delay_us is None or self.decoupled else plan.batch_delay_us / 1e6

    def execute(self, batch: Any) -> list[Any]:
        raise ServingError(f"ensemble '{self.spec.name}' runs its requests with execute_async")

    def close(self) -> None:
        """Nothing to unload: the members are deployments of their own."""

    async def execute_async(self, prepared: PreparedRequest) -> InferResponse | ServingError | None:
        """Run one request through every step it reaches: its response or its error; when
        decoupled, its responses go to ``prepared.sender`` and None returns (or its error)."""
        start = time.perf_counter_ns()
        results: list[InferResponse] = []

        async def emit(tensors: dict[str, Tensor]) -> None:
            response = self._response(prepared, tensors)
            if self.decoupled:  # waits while --max-queued-responses wait to be sent
                await prepared.sender.send_async(response)
            else:
                results.append(response)

        try:
            await _Run(self, prepared.request, emit, prepared.trace_link).run()
        except Exception as exc:  # the request's own error; the replica keeps serving
            return self._failed([prepared], exc)[0]
        end = time.perf_counter_ns()
        self.stats.record_execution(1, prepared.rows, 0, end - start, 0)
        self.stats.record_success(end - prepared.arrival_ns, start - prepared.arrival_ns)
        if self.decoupled:
            prepared.sender.send(None, final=True)
            return None
        return results[0] if results else ServingError(f"ensemble '{self.spec.name}' gave no response")

    async def execute_batch_async(self, batch: list[PreparedRequest]) -> list[InferResponse | ServingError]:
        """Requests the ensemble batched (``max_queue_delay_microseconds``): those with equal
        signatures run the graph once, their rows merged, and each gets its own rows back."""
        results: list[Any] = [None] * len(batch)

        async def run_group(indices: list[int]) -> None:
            group = [batch[i] for i in indices]
            if len(group) == 1:
                results[indices[0]] = await self.execute_async(group[0])
                return
            for i, result in zip(indices, await self._execute_merged(group)):
                results[i] = result

        await asyncio.gather(*(run_group(ix) for ix in group_by_signature([p.signature for p in batch])))
        return results

    async def _execute_merged(self, group: list[PreparedRequest]) -> list[InferResponse | ServingError]:
        start = time.perf_counter_ns()
        rows = [p.rows for p in group]
        merged = merge_inputs([p.arrays for p in group])
        first = group[0].request
        request = InferRequest(self.spec.name, self.version, first.id, parameters=first.parameters, inputs=[
            InferInput(name, self._inputs[name].datatype, tuple(array.shape), array) for name, array in merged.items()])
        outcome: list[dict[str, Tensor]] = []

        async def emit(tensors: dict[str, Tensor]) -> None:
            outcome.append(tensors)

        # Its steps are traced as children of the first traced request's trace (if any).
        trace_link = next((p.trace_link for p in group if p.trace_link is not None), None)
        try:
            await _Run(self, request, emit, trace_link).run()
            if not outcome:
                raise ServingError(f"ensemble '{self.spec.name}' gave no response")
            names = [n for n in group[0].output_names if n in outcome[0]]
            pieces = split_outputs({n: outcome[0][n][2] for n in names}, rows)
        except Exception as exc:
            return self._failed(group, exc)
        end = time.perf_counter_ns()
        self.stats.record_execution(len(group), sum(rows), 0, end - start, 0)
        responses: list[InferResponse | ServingError] = []
        for p, piece in zip(group, pieces):
            self.stats.record_success(end - p.arrival_ns, start - p.arrival_ns)
            outputs = [InferOutput(n, *self._as_asked(p, n, outcome[0][n][0], tuple(piece[n].shape), piece[n]))
                       for n in names]
            responses.append(InferResponse(self.spec.name, self.version, outputs=outputs, id=p.request.id))
        return responses

    async def is_ready_async(self) -> bool:
        """Ready only when every member is."""
        if self._member_ready is None:
            return True
        checks = [self._member_ready(model, version) for model, version in self.plan.members]
        return all(await asyncio.gather(*checks))

    # ---- the graph ----------------------------------------------------------------------------

    def _settled(self, step: EnsembleStep, settled: set[int]) -> bool:
        """Every tensor the step reads is an ensemble input or its writer has finished."""
        return all(self._producer.get(t, -1) in settled or t not in self._producer for t in self._reads[step.index])

    @staticmethod
    def _skipped(step: EnsembleStep, tensors: dict[str, Tensor]) -> bool:
        """A conditional step whose condition does not hold (its outputs stay absent)."""
        if step.run_if_present is not None and step.run_if_present not in tensors:
            return True
        if step.run_if is not None:
            flag = tensors.get(step.run_if)
            if flag is None or flag[2].size != 1 or not bool(flag[2].reshape(-1)[0]):
                return True
        return False

    @staticmethod
    def _take_outputs(step: EnsembleStep, response: InferResponse, tensors: dict[str, Tensor]) -> None:
        produced = {o.name: o for o in response.outputs}
        for member_output, tensor in step.output_map:
            output = produced.get(member_output)
            if output is None:
                raise ServingError(f"in ensemble, {step.label} returned no output '{member_output}'")
            tensors[tensor] = (output.datatype, tuple(output.shape), output.data)

    def _step_error(self, step: EnsembleStep, exc: BaseException) -> ServingError:
        """The step's error with its code, naming the ensemble, the step and its model."""
        error = as_serving_error(exc)
        version = f" version {step.model_version}" if step.model_version else ""
        return ServingError(f"in ensemble '{self.spec.name}', step {step.index} (model "
                            f"'{step.model_name}'{version}) failed: {error.message}", error.code)

    def _as_asked(self, prepared: PreparedRequest, name: str, datatype: str, shape: tuple[int, ...],
                  data: Any) -> tuple[str, tuple[int, ...], Any]:
        """(datatype, shape, data) of an output as the request asked for it (a classification)."""
        if prepared.classes is None or name not in prepared.classes:
            return datatype, shape, data
        datatype, data = self.classified(prepared, name, datatype, np.asarray(data).reshape(shape))
        return datatype, tuple(data.shape), data

    def _response(self, prepared: PreparedRequest, tensors: dict[str, Any]) -> InferResponse:  # type: ignore[override]
        outputs = []
        for name in prepared.output_names:
            tensor = tensors.get(name)
            if tensor is None:
                continue  # written only by a step that did not run
            outputs.append(InferOutput(name, *self._as_asked(prepared, name, *tensor)))
        return InferResponse(model_name=self.spec.name, model_version=self.version, outputs=outputs,
                             id=prepared.request.id)


class _Run:
    """One request's walk through the graph: its flows (one, or one per response of each
    decoupled step), the first error, and every call still running."""

    def __init__(self, executor: EnsembleExecutor, request: InferRequest,
                 emit: Callable[[dict[str, Tensor]], Awaitable[None]], trace_link: str | None = None) -> None:
        self.x = executor
        self.request = request
        self.emit = emit
        # A traced request's link: its steps are traced as its children (Triton's child traces).
        self.trace_link = trace_link
        # The steps get the request's priority and sequence (a stateful member sees the
        # ensemble's correlation id and start / end flags, as in Triton).
        self.parameters = {k: v for k, v in request.parameters.items()
                           if k not in TRANSPORT_PARAMETERS or k in _STEP_PARAMETERS}
        self.tasks: set[asyncio.Future] = set()  # flows, streams and step calls
        self.error: BaseException | None = None
        self.finished = asyncio.Event()

    async def run(self) -> None:
        tensors = {t.name: (t.datatype, tuple(t.shape), t.data) for t in self.request.inputs}
        try:
            if self.x.decoupled:  # flows fork per response: each a task, the first error ends all
                self.spawn(self.flow(tensors, set(), {}))
                await self.finished.wait()
            else:  # one flow: it runs in this task
                await self.flow(tensors, set(), {})
        finally:
            for task in list(self.tasks):
                task.cancel()
        if self.error is not None:
            raise self.error

    def step_request(self, step: EnsembleStep, tensors: dict[str, Tensor]) -> InferRequest:
        """The request of ``step`` to its member, from the tensors this flow has."""
        inputs = []
        for member_input, tensor in step.input_map:
            if tensor in tensors:
                datatype, shape, data = tensors[tensor]
                inputs.append(InferInput(member_input, datatype, shape, data))
        return InferRequest(
            model_name=step.model_name,
            model_version=step.model_version,
            id=self.request.id,
            inputs=inputs,
            outputs=[RequestedOutput(member_output) for member_output, _ in step.output_map],
            parameters=dict(self.parameters),
            trace_parent=self.trace_link,
        )

    def spawn(self, coroutine: Any, call: bool = False) -> asyncio.Future:
        """Run ``coroutine`` as part of this request: cancelled with it; a flow's or a fork's
        exception ends the request (a ``call``'s reaches the flows waiting for it, which name
        the step)."""
        task = asyncio.ensure_future(coroutine)
        self.tasks.add(task)
        task.add_done_callback(lambda done: self._done(done, call))
        return task

    def _done(self, task: asyncio.Future, call: bool) -> None:
        self.tasks.discard(task)
        if not call and not task.cancelled() and task.exception() is not None and self.error is None:
            self.error = task.exception()
            self.finished.set()
        if not self.tasks:
            self.finished.set()

    async def flow(self, tensors: dict[str, Tensor], settled: set[int], started: dict[int, Any]) -> None:
        """Run the steps not yet settled; emit the tensors once every step has settled.
        ``started``: steps started before this flow forked (their calls are shared)."""
        x = self.x
        waiting = [s for s in x.plan.steps if s.index not in settled]
        running: dict[asyncio.Future, EnsembleStep] = {}
        while True:
            starts: list[EnsembleStep] = []
            progressed = True
            while progressed:  # a skipped step settles its tensors: look again
                progressed = False
                for step in [s for s in waiting if x._settled(s, settled)]:
                    waiting.remove(step)
                    if x._skipped(step, tensors):
                        settled.add(step.index)
                        progressed = True
                    elif step.index in x._decoupled_steps:
                        if step.index not in started:  # forks the rest of the graph per response
                            started[step.index] = self.spawn(self.fork(step, tensors, settled, started))
                    elif step.index in started:
                        running[started[step.index]] = step
                    else:
                        starts.append(step)
            if len(starts) == 1 and not running and not x.decoupled:
                # The only step that can run now (a chain's next): called from this task, with
                # no task and wait of its own.
                step = starts[0]
                try:
                    response = await x._call(self.step_request(step, tensors))
                except Exception as exc:
                    raise x._step_error(step, exc) from None
                x._take_outputs(step, response, tensors)
                settled.add(step.index)
                continue
            for step in starts:
                request = self.step_request(step, tensors)
                started[step.index] = self.spawn(x._call(request), call=True)
                running[started[step.index]] = step
            if not running:
                if len(settled) == len(x.plan.steps):  # else a decoupled step's flows go on
                    await self.emit(tensors)
                return
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for call in done:
                step = running.pop(call)
                try:
                    response = call.result()
                except Exception as exc:
                    raise x._step_error(step, exc) from None
                x._take_outputs(step, response, tensors)
                settled.add(step.index)

    async def fork(self, step: EnsembleStep, tensors: dict[str, Tensor], settled: set[int],
                   started: dict[int, Any]) -> None:
        """A decoupled step: a new flow from this one's state for each of its responses."""
        x = self.x
        assert x._stream is not None
        request = self.step_request(step, tensors)
        try:
            async for response in x._stream(request):
                child = dict(tensors)
                x._take_outputs(step, response, child)
                self.spawn(self.flow(child, settled | {step.index}, dict(started)))
        except Exception as exc:
            raise x._step_error(step, exc) from None
