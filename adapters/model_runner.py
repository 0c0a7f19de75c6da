"""Validates requests against a model's spec and executes them, one or many at a time.

The runner is the protocol-neutral data plane of one model version in one replica: front-ends
decode wire formats into :class:`InferRequest`, the runner checks them against the config,
merges compatible requests into one model execution, and splits the results back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

import numpy as np

from rayinfer.adapters.base import ModelAdapter
from rayinfer.adapters.batching import group_by_signature, merge_inputs, split_outputs
from rayinfer.protocol.classification import check_classifiable, classification_count, classify
from rayinfer.protocol.dtypes import numpy_dtype, wire_datatype
from rayinfer.protocol.errors import InvalidArgError, ServingError, as_serving_error
from rayinfer.protocol.statistics import ModelStatistics
from rayinfer.protocol.types import InferOutput, InferRequest, InferResponse
from rayinfer.repository.model_config import ModelSpec, TensorSpec


@dataclass(slots=True)
class PreparedRequest:
    """A validated request: inputs in the model's shapes, its row count and merge signature."""

    request: InferRequest
    arrays: dict[str, np.ndarray]
    rows: int
    output_names: tuple[str, ...]
    signature: tuple
    arrival_ns: int
    # A decoupled executor's channel for this request's responses (set by the serving core).
    sender: Any = None
    # Set by the serving core when the client gave up on the request (a model may look).
    cancelled: bool = False
    # Set by the serving core when the request's execution begins.
    started: bool = False
    # A row the sequence batcher added for a slot with no request: executed, never answered.
    padding: bool = False
    # A sequence model's implicit state after this request (state output -> array, no batch dim).
    state_outputs: dict[str, np.ndarray] | None = None
    # Outputs asked for as classifications: name -> how many classes (Triton's extension).
    classes: dict[str, int] | None = None
    # A traced request's timestamps, (name, perf_counter ns), set by the serving core.
    trace: list[tuple[str, int]] | None = None
    # A traced request's link, which the requests it sends on carry (an ensemble's steps).
    trace_link: str | None = None


class LateAnswer:
    """A request's result that comes after its execution returned (a Python model answering
    through its response sender from another thread): set once, from any thread; the serving
    core awaits it in the request's place."""

    __slots__ = ("_future",)

    def __init__(self) -> None:
        self._future: concurrent.futures.Future = concurrent.futures.Future()

    def set(self, result: Any) -> None:
        try:
            self._future.set_result(result)
        except concurrent.futures.InvalidStateError:  # the client gave up on the request
            pass

    async def wait(self) -> Any:
        return await asyncio.wrap_future(self._future)

    def wait_blocking(self) -> Any:
        return self._future.result()


def trace_compute(batch: Sequence[PreparedRequest], infer_start: int, infer_end: int) -> None:
    """Note where the model's own part of an execution began and ended, in traced requests."""
    for p in batch:
        if p.trace is not None:
            p.trace += [("COMPUTE_INPUT_END", infer_start), ("COMPUTE_OUTPUT_START", infer_end)]


class _Rescheduled:
    """What an execution gives a request its model rescheduled (a Python model's
    ``set_release_flags(TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)``, iterative sequences): no
    answer yet; the sequence batcher queues it to run again."""

    def __repr__(self) -> str:
        return "RESCHEDULED"


RESCHEDULED: Any = _Rescheduled()

# Triton's answer to a request rescheduled by a model without iterative_sequence.
NOT_ITERATIVE_MESSAGE = ("Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, while the model is "
                         "not configured to handle such a flag.")


# Request parameters that shape how a request travels or is encoded, not what the model computes:
# requests differing only in these may share one execution.
TRANSPORT_PARAMETERS = frozenset({"binary_data_output", "priority", "timeout", "sequence_id", "sequence_start",
                                  "sequence_end", "triton_enable_empty_final_response"})


def parameters_key(parameters: dict[str, Any]) -> tuple:
    """What of a request's parameters the model sees, as a hashable merge key: requests are
    merged into one execution only when these are equal, so each execution's parameters are
    every one of its requests' own."""
    if not parameters:
        return ()
    return tuple(sorted((k, repr(v)) for k, v in parameters.items() if k not in TRANSPORT_PARAMETERS))


def _shape_matches(shape: Sequence[int], dims: Sequence[int]) -> bool:
    return len(shape) == len(dims) and all(d == -1 or d == s for s, d in zip(shape, dims))


def _fmt(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


class ModelRunner:
    """Runs one loaded model version; keeps its statistics. The serving core's executor for
    backends with one response per request (:mod:`rayinfer.serving.executor`)."""

    decoupled = False

    def __init__(self, spec: ModelSpec, adapter: ModelAdapter, version: int):
        self.spec = spec
        self.adapter = adapter
        self.version = str(version)
        self.stats = ModelStatistics(first_response_buckets=spec.first_response_buckets)
        self._inputs = spec.input_map
        self._outputs = spec.output_map
        self._required = [t.name for t in spec.inputs if not t.optional]
        sequences = spec.sequence_batching
        self._state_outputs = [s.output_name for s in sequences.states] if sequences is not None else []

    def prepare(self, request: InferRequest) -> PreparedRequest:
        """Check names, datatypes, shapes and batch size against the config (INVALID_ARG if wrong)."""
        spec = self.spec
        given = [t.name for t in request.inputs]
        missing = [n for n in self._required if n not in given]
        for tensor in request.inputs:
            if tensor.name not in self._inputs:
                raise InvalidArgError(
                    f"unexpected inference input '{tensor.name}' for model '{spec.name}'"
                )
        if missing or len(set(given)) != len(given):
            count = len(self._required)
            expected = f"{count}" if count == len(self._inputs) else f"number of inputs between {count} and " \
                f"{len(self._inputs)}"
            raise InvalidArgError(
                f"expected {expected} inputs but got {len(given)} inputs for model "
                f"'{spec.name}'. Got input(s) {given}, but missing required input(s) {missing}. "
                "Please provide all required input(s)."
            )
        batching = spec.max_batch_size > 0
        rows = 1
        arrays: dict[str, np.ndarray] = {}
        signature: list[Any] = []
        for position, tensor in enumerate(request.inputs):
            config = self._inputs[tensor.name]
            if tensor.datatype != config.datatype:
                raise InvalidArgError(
                    f"inference input '{tensor.name}' data-type is '{tensor.datatype}', but model "
                    f"'{spec.name}' expects '{config.datatype}'"
                )
            shape = tensor.shape
            expected = ((-1,) if batching else ()) + config.dims
            if not _shape_matches(shape, expected):
                raise InvalidArgError(
                    f"unexpected shape for input '{tensor.name}' for model '{spec.name}'. "
                    f"Expected {_fmt(expected)}, got {_fmt(shape)}"
                )
            if batching:
                if position == 0:
                    rows = shape[0]
                elif shape[0] != rows:
                    raise InvalidArgError(
                        f"input '{tensor.name}' batch size {shape[0]} does not match the batch size "
                        f"{rows} of the other inputs for model '{spec.name}'"
                    )
            arrays[tensor.name] = _to_model_shape(tensor.data, config, batching, rows)
            signature.append((tensor.name, shape[1:] if batching else shape))
        if batching and not 1 <= rows <= spec.max_batch_size:
            raise InvalidArgError(
                f"inference request batch-size must be <= {spec.max_batch_size} for "
                f"'{spec.name}'" if rows else f"inference request batch-size must be >= 1 for '{spec.name}'"
            )
        if request.outputs:
            for out in request.outputs:
                if out.name not in self._outputs:
                    raise InvalidArgError(
                        f"unexpected inference output '{out.name}' for model '{spec.name}'"
                    )
            # (ModelCore.prepare has refused an output requested twice.)
            output_names = tuple(dict.fromkeys(o.name for o in request.outputs))
            classes = self._classes(request)
        else:
            output_names = tuple(self._outputs)
            classes = None
        signature.sort()
        return PreparedRequest(
            request=request,
            arrays=arrays,
            rows=rows,
            output_names=output_names,
            signature=(tuple(signature), output_names, parameters_key(request.parameters)),
            arrival_ns=time.perf_counter_ns(),
            classes=classes,
        )

    def _classes(self, request: InferRequest) -> dict[str, int] | None:
        """The outputs a request asks for as classifications (their datatype must allow it)."""
        classes = {}
        for out in request.outputs or ():
            count = classification_count(out.parameters) if out.parameters else 0
            if count:
                check_classifiable(self._outputs[out.name].datatype)
                classes[out.name] = count
        return classes or None

    def close(self) -> None:
        """Unload the model (its backend frees what it holds; a Python model is finalized)."""
        self.adapter.unload()

    def execute(self, batch: Sequence[PreparedRequest]) -> list[InferResponse | ServingError] | None:
        """Run the requests, merging those with equal signatures (input shapes past the batch
        dimension, requested outputs and parameters) into one execution each.

        Blocking: call it from a worker thread. Returns one response or error per request.
        """
        results: list[InferResponse | ServingError] = [None] * len(batch)  # type: ignore[list-item]
        signatures = [p.signature for p in batch] if self.spec.max_batch_size > 0 else list(range(len(batch)))
        for indices in group_by_signature(signatures):
            group = [batch[i] for i in indices]
            for i, result in zip(indices, self._execute_group(group)):
                results[i] = result
        return results

    def _execute_group(self, group: list[PreparedRequest]) -> list[InferResponse | ServingError]:
        start = time.perf_counter_ns()
        rows = [p.rows for p in group]
        try:
            merged = merge_inputs([p.arrays for p in group])
            wanted = list(dict.fromkeys(n for p in group for n in p.output_names)) + self._state_outputs
            infer_start = time.perf_counter_ns()
            # Requests of one group have equal parameters but for TRANSPORT_PARAMETERS (the
            # signature holds the rest); the first request's are passed.
            outputs = self.adapter.execute(merged, wanted, group[0].request.parameters)
            infer_end = time.perf_counter_ns()
            trace_compute(group, infer_start, infer_end)
            per_request = split_outputs(outputs, rows) if self.spec.max_batch_size > 0 else [outputs]
            if self._state_outputs:
                keep_state(group, per_request, self._state_outputs, self.spec.max_batch_size > 0)
            responses: list[InferResponse | ServingError] = [
                self._response(p, out) for p, out in zip(group, per_request)
            ]
        except Exception as exc:  # reported per request, never crashes the replica
            return self._failed(group, exc)
        end = time.perf_counter_ns()
        self.stats.record_execution(
            len(group), sum(rows), infer_start - start, infer_end - infer_start, end - infer_end
        )
        for p in group:
            if not p.padding:
                self.stats.record_success(end - p.arrival_ns, start - p.arrival_ns)
        return responses

    def _failed(self, group: Sequence[PreparedRequest], exc: BaseException) -> list[InferResponse | ServingError]:
        """``exc`` as every request's error in ``group``, each counted as a failure."""
        error = as_serving_error(exc)
        now = time.perf_counter_ns()
        for p in group:
            if not p.padding:
                self.stats.record_failure(now - p.arrival_ns)
        return [error] * len(group)

    def _response(self, prepared: PreparedRequest, outputs: dict[str, np.ndarray]) -> InferResponse:
        batching = self.spec.max_batch_size > 0
        tensors = []
        for name in prepared.output_names:
            array = outputs[name]
            config = self._outputs[name]
            if config.reshape is not None:
                array = array.reshape(((prepared.rows,) if batching else ()) + config.dims)
            datatype = config.datatype
            if datatype != "BYTES" and wire_datatype(array.dtype) != datatype:
                array = array.astype(numpy_dtype(datatype))
            datatype, array = self.classified(prepared, name, datatype, array)
            tensors.append(InferOutput(name, datatype, tuple(array.shape), array))
        return InferResponse(
            model_name=self.spec.name,
            model_version=self.version,
            outputs=tensors,
            id=prepared.request.id,
        )


    def classified(self, prepared: PreparedRequest, name: str, datatype: str,
                   array: np.ndarray) -> tuple[str, np.ndarray]:
        """An output as the request asked for it: its top classes (BYTES) when it asked for a
        classification (Triton's extension), else the tensor itself."""
        if prepared.classes is None or name not in prepared.classes:
            return datatype, array
        return "BYTES", classify(array, datatype, prepared.classes[name], self._outputs[name].labels,
                                 self.spec.max_batch_size > 0)


def keep_state(group: Sequence[PreparedRequest], outputs: Sequence[dict[str, np.ndarray]], names: Sequence[str],
               batching: bool) -> None:
    """Each request's implicit state outputs (without the batch dimension), for its sequence's
    next request."""
    for prepared, out in zip(group, outputs):
        prepared.state_outputs = {n: (out[n][0] if batching else out[n]) for n in names if n in out}


def _to_model_shape(data: np.ndarray, config: TensorSpec, batching: bool, rows: int) -> np.ndarray:
    if config.reshape is None:
        return data
    return data.reshape(((rows,) if batching else ()) + config.reshape)

