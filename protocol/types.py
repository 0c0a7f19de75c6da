"""Protocol-neutral inference request and response types shared by every front-end."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class InferInput:
    """One input tensor of a request, already decoded into a numpy array of ``shape``."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RequestedOutput:
    """An output the client asked for; ``binary`` None means the request's default; ``shm``
    (a :class:`~rayinfer.protocol.shared_memory.TensorLocation`) where to write it instead."""

    name: str
    binary: bool | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    shm: Any = None


@dataclass(slots=True)
class InferRequest:
    """A decoded inference request addressed to one model version."""

    model_name: str
    model_version: str = ""
    id: str | None = None
    inputs: list[InferInput] = field(default_factory=list)
    outputs: list[RequestedOutput] | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    # Sent on by another replica of the model to this one, which holds its sequence.
    forwarded: bool = False
    # Sent by a traced request (an ensemble's step): the sender's trace link
    # (:attr:`rayinfer.serving.trace.Trace.link`); this request is traced as its child.
    trace_parent: str | None = None

    def input_by_name(self) -> dict[str, InferInput]:
        return {tensor.name: tensor for tensor in self.inputs}


@dataclass(slots=True)
class InferOutput:
    """One output tensor of a response."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class InferResponse:
    """The result of one request."""

    model_name: str
    model_version: str
    outputs: list[InferOutput]
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


class StreamEnd(enum.Enum):
    """How a decoupled request's responses ended, where its caller must know (a BLS iterator
    gives an empty last response only when the model sent the final flag on its own)."""

    FINAL_ALONE = "the final flag came without a response"
