"""The executor of an ensemble: each request runs the step graph, calling the member models.

A step starts as soon as the tensors it maps in exist, so independent steps run concurrently;
tensors move between steps as numpy arrays, and each call goes to the member's own deployment,
where it meets that model's batcher like any client's request (steps batch across ensemble
requests). A failing step fails only its request, with an error naming the step and model; the
steps still running for that request are cancelled. No Ray here: the deployment gives the
executor a :class:`StepCaller`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from rayinfer.adapters.model_runner import TRANSPORT_PARAMETERS, ModelRunner, PreparedRequest
from rayinfer.protocol.errors import ServingError, as_serving_error
from rayinfer.protocol.types import InferInput, InferOutput, InferRequest, InferResponse, RequestedOutput
from rayinfer.repository.ensemble import EnsemblePlan, EnsembleStep
from rayinfer.repository.model_config import ModelSpec

# Sends one request to a member model version; returns its response or raises its error.
StepCaller = Callable[[InferRequest], Awaitable[InferResponse]]
# (model, version) -> whether that member is ready to serve.
ReadyCheck = Callable[[str, str], Awaitable[bool]]
# (datatype, shape, data) of one ensemble tensor.
Tensor = tuple[str, tuple[int, ...], np.ndarray]


class EnsembleExecutor(ModelRunner):
    """Validates requests against the ensemble's own config (as any model does) and runs each
    one through the steps; one response or error per request, never a batch of them."""

    def __init__(self, spec: ModelSpec, plan: EnsemblePlan, version: int, call: StepCaller,
                 member_ready: ReadyCheck | None = None) -> None:
        super().__init__(spec, adapter=None, version=version)  # type: ignore[arg-type]
        self.plan = plan
        self._call = call
        self._member_ready = member_ready
        self._producer = {t: s.index for s in plan.steps for _, t in s.output_map}
        self._reads = {s.index: s.consumes + ((s.run_if_present,) if s.run_if_present else ()) for s in plan.steps}

    def execute(self, batch: Any) -> list[Any]:
        raise ServingError(f"ensemble '{self.spec.name}' runs its requests with execute_async")

    async def execute_async(self, prepared: PreparedRequest) -> InferResponse | ServingError:
        """Run one request through every step it reaches; its response or its error."""
        start = time.perf_counter_ns()
        try:
            tensors = await self._run_steps(prepared.request)
            response = self._response(prepared, tensors)
        except Exception as exc:  # the request's own error; the replica keeps serving
            self.stats.record_failure(time.perf_counter_ns() - prepared.arrival_ns)
            return as_serving_error(exc)
        end = time.perf_counter_ns()
        self.stats.record_execution(1, prepared.rows, 0, end - start, 0)
        self.stats.record_success(end - prepared.arrival_ns, start - prepared.arrival_ns)
        return response

    async def is_ready_async(self) -> bool:
        """Ready only when every member is."""
        if self._member_ready is None:
            return True
        checks = [self._member_ready(model, version) for model, version in self.plan.members]
        return all(await asyncio.gather(*checks))

    # ---- the graph ----------------------------------------------------------------------------

    async def _run_steps(self, request: InferRequest) -> dict[str, Tensor]:
        """Start every step whose tensors are settled (written, or never to be written by a
        skipped step), then wait for any running one, until none is left."""
        tensors: dict[str, Tensor] = {t.name: (t.datatype, tuple(t.shape), t.data) for t in request.inputs}
        parameters = {k: v for k, v in request.parameters.items()
                      if k not in TRANSPORT_PARAMETERS or k == "priority"}
        waiting = list(self.plan.steps)
        settled: set[int] = set()
        running: dict[asyncio.Future, EnsembleStep] = {}
        try:
            while waiting or running:
                started = True
                while started:  # a skipped step settles its tensors: look again
                    started = False
                    for step in [s for s in waiting if self._settled(s, settled)]:
                        waiting.remove(step)
                        if self._skipped(step, tensors):
                            settled.add(step.index)
                            started = True
                            continue
                        call = self._call(self._step_request(step, request, tensors, parameters))
                        running[asyncio.ensure_future(call)] = step
                if not running:  # the graph is acyclic: nothing can be left waiting
                    break
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    step = running.pop(task)
                    try:
                        response = task.result()
                    except Exception as exc:
                        raise self._step_error(step, exc) from None
                    self._take_outputs(step, response, tensors)
                    settled.add(step.index)
        finally:
            for task in running:
                task.cancel()
        return tensors

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

    def _step_request(self, step: EnsembleStep, request: InferRequest, tensors: dict[str, Tensor],
                      parameters: dict[str, Any]) -> InferRequest:
        inputs = []
        for member_input, tensor in step.input_map:
            if tensor in tensors:
                datatype, shape, data = tensors[tensor]
                inputs.append(InferInput(member_input, datatype, shape, data))
        return InferRequest(
            model_name=step.model_name,
            model_version=step.model_version,
            id=request.id,
            inputs=inputs,
            outputs=[RequestedOutput(member_output) for member_output, _ in step.output_map],
            parameters=dict(parameters),
        )

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

    def _response(self, prepared: PreparedRequest, tensors: dict[str, Any]) -> InferResponse:  # type: ignore[override]
        outputs = []
        for name in prepared.output_names:
            tensor = tensors.get(name)
            if tensor is None:
                continue  # written only by a step that did not run
            datatype, shape, data = tensor
            outputs.append(InferOutput(name, datatype, shape, data))
        return InferResponse(model_name=self.spec.name, model_version=self.version, outputs=outputs,
                             id=prepared.request.id)
