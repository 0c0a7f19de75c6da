"""``triton_python_backend_utils``: the module a Triton ``model.py`` imports as ``pb_utils``.

The same names and behaviour as Triton's Python backend, for models that run inside a rayinfer
replica (no stub process): tensors are numpy arrays (BYTES as object arrays of ``bytes``),
requests come in as :class:`InferenceRequest` and answers go back as :class:`InferenceResponse`.
"""

from __future__ import annotations

import enum
import json
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from rayinfer.adapters.python_backend import bls as _bls
from rayinfer.adapters.python_backend import model_context as _model_context

# Re-exported: a model reaches every name through this module.
from rayinfer.adapters.python_backend.auto_complete import ModelConfig as ModelConfig
from rayinfer.adapters.python_backend.errors import TritonError as TritonError
from rayinfer.adapters.python_backend.errors import TritonModelException as TritonModelException
from rayinfer.adapters.python_backend.model_metrics import Metric as Metric
from rayinfer.adapters.python_backend.model_metrics import MetricFamily as MetricFamily
from rayinfer.adapters.python_backend.model_metrics import metrics_snapshot as metrics_snapshot
from rayinfer.protocol.dtypes import (
    BF16 as _BF16,
    numpy_dtype as _numpy_dtype,
    serialize_bytes_tensor as _serialize,
    wire_datatype as _wire_datatype,
)
from rayinfer.protocol.errors import ServingError as _ServingError

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2

# TRITONSERVER_DataType numbers, as Triton's pb_utils uses them.
_TYPE_NUMBERS = {
    "BOOL": 1, "UINT8": 2, "UINT16": 3, "UINT32": 4, "UINT64": 5, "INT8": 6, "INT16": 7, "INT32": 8,
    "INT64": 9, "FP16": 10, "FP32": 11, "FP64": 12, "BYTES": 13, "BF16": 14,
}
_NUMBER_TYPES = {number: name for name, number in _TYPE_NUMBERS.items()}
_CONFIG_TO_NUMPY = {
    "TYPE_BOOL": np.bool_, "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64, "TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}

_logger = logging.getLogger("triton_python_backend_utils")


class Tensor:
    """A named tensor; its data is a numpy array (BYTES: an object array of ``bytes``)."""

    def __init__(self, name: str, data: Any) -> None:
        _typed("Tensor", "name", name, str)
        _typed("Tensor", "data", data, np.ndarray)
        if data.dtype.kind in ("U", "S"):
            data = np.array([_to_bytes(v) for v in data.reshape(-1)], dtype=object).reshape(data.shape)
        self._name = name
        self._data = data

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        if self._data.dtype == _BF16:  # numpy has no bfloat16: Triton's models use DLPack for it
            raise TritonModelException("Tensor dtype is BF16 and cannot be converted to NumPy. Use to_dlpack() and "
                                       "from_dlpack() instead.")
        return self._data

    def shape(self) -> list[int]:
        return list(self._data.shape)

    def triton_dtype(self) -> int:
        return _TYPE_NUMBERS[_wire_datatype(self._data.dtype)]

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self) -> Any:
        if self._data.dtype == object:
            raise TritonModelException(f"tensor '{self._name}': BYTES tensors have no DLPack form")
        if self._data.dtype == _BF16:  # numpy cannot export bfloat16 through DLPack; torch can
            torch = _torch_for_bf16(self._name)
            return torch.utils.dlpack.to_dlpack(torch.from_numpy(self._data.view(np.int16)).view(torch.bfloat16))
        return self._data.__dlpack__()

    @classmethod
    def from_dlpack(cls, name: str, capsule: Any) -> Tensor:
        """A tensor from a DLPack capsule or an object with ``__dlpack__`` (numpy, torch CPU
        tensors, ...); a bfloat16 one becomes a BF16 tensor."""
        _typed("Tensor.from_dlpack", "name", name, str)
        if name == "":
            raise TritonModelException("Tensor name cannot be an empty string.")
        if type(capsule).__name__ != "PyCapsule" and not (hasattr(capsule, "__dlpack__")
                                                         and hasattr(capsule, "__dlpack_device__")):
            raise TritonModelException("Provided tensor is not supported. Tensor must be a DLPack capsule or have "
                                       "`__dlpack__` and `__dlpack_device__` attributes")
        if str(getattr(capsule, "dtype", "")) == "torch.bfloat16":
            return cls(name, capsule.detach().cpu().contiguous().view(_torch_for_bf16(name).int16).numpy().view(_BF16))
        try:
            return cls(name, np.from_dlpack(capsule))
        except (BufferError, TypeError, AttributeError):
            torch = _torch_for_bf16(name)  # a capsule numpy cannot read: bfloat16 among them
            tensor = torch.utils.dlpack.from_dlpack(capsule)
            if tensor.dtype != torch.bfloat16:
                return cls(name, tensor.cpu().numpy())
            return cls(name, tensor.cpu().contiguous().view(torch.int16).numpy().view(_BF16))

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={self.shape()}, dtype={self._data.dtype})"


def _typed(call: str, argument: str, value: Any, kind: type | tuple[type, ...]) -> None:
    """TypeError, as Triton's typed bindings raise it, when ``value`` is not a ``kind`` (None is not)."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds + ((np.integer,) if int in kinds else ())):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise TypeError(f"{call}(): argument '{argument}' must be {names}, not {type(value).__name__}")


def _typed_items(call: str, argument: str, values: Any, kind: type) -> None:
    """TypeError unless ``values`` is a list or tuple; TypeError for an item not a ``kind``,
    but None, which Triton refuses as an empty tensor (TritonModelException, by the caller)."""
    _typed(call, argument, values, (list, tuple))
    for value in values:
        if value is not None:
            _typed(call, f"{argument}[]", value, kind)


def _to_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode("utf-8")


def _torch_for_bf16(name: str) -> Any:
    """torch, which carries BF16 tensors through DLPack (numpy cannot)."""
    try:
        import torch
    except ImportError:
        raise TritonModelException(f"tensor '{name}': BF16 tensors go through DLPack with torch, which is not "
                                   "installed in this environment") from None
    return torch


def _checked_parameters(parameters: dict[str, Any] | str | None) -> dict[str, Any]:
    """A request's or response's parameters as Triton's Python API takes them: a dict (or its
    JSON text) with str keys and bool, int or str values; anything else raises Triton's message."""
    if parameters is None:
        return {}
    if isinstance(parameters, str):
        parameters = json.loads(parameters)
    if not isinstance(parameters, dict):
        raise TritonModelException(f"Expect dict, got {type(parameters)}")
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(f"Expect parameters keys to have type str, found type {type(key)}")
        if not isinstance(value, (bool, int, str)):
            raise TritonModelException(f"Expect parameters values to have type bool/int/str, found type {type(value)}")
    return dict(parameters)


class InferenceResponse:
    """A model's answer to one request: output tensors, or an error."""

    def __init__(self, output_tensors: Sequence[Tensor] | None = None, error: TritonError | None = None,
                 parameters: dict[str, Any] | str | None = None) -> None:
        _typed_items("InferenceResponse", "output_tensors", [] if output_tensors is None and error is not None
                     else output_tensors, Tensor)
        if any(t is None for t in output_tensors or ()):
            raise TritonModelException("Output tensor for inference response should not be empty.")
        if error is not None and not isinstance(error, TritonError):
            raise TypeError(f"InferenceResponse(): argument 'error' must be TritonError, not {type(error).__name__}")
        self._outputs = list(output_tensors or [])
        self._error = error
        self._parameters = _checked_parameters(parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return json.dumps(self._parameters)


class InferenceResponseSender:
    """Sends the responses to one request (``request.get_response_sender()``): any number
    before the final flag from a decoupled model; exactly one from a non-decoupled model (the
    final flag with it or after it). Triton's rules and messages; nothing after the final flag.
    A decoupled model's ``send`` waits while ``--max-queued-responses`` of its responses are not
    taken yet, and raises TritonModelException once the request is cancelled meanwhile."""

    def __init__(self, send: Any, cancelled: Any = None, decoupled: bool = True) -> None:
        self._send = send
        self._cancelled = cancelled
        self._decoupled = decoupled
        self._sent = 0
        self._closed = False
        self._lock = threading.Lock()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException("Unable to send response. Unsupported flag provided.")
        if flags == 0 and response is None:
            raise TritonModelException("Inference Response object must be provided when the response flags is set "
                                       "to zero.")
        with self._lock:
            if not self._decoupled:
                if response is not None and self._sent:
                    raise TritonModelException("Unable to send response. Non-decoupled model cannot send more than "
                                               "one response.")
                if response is None and self._sent == 0:
                    raise TritonModelException("Unable to send response. Non-decoupled model cannot send complete "
                                               "final before sending a response.")
            if self._closed:
                raise TritonModelException("Unable to send response. Response sender has been closed.")
            self._sent += response is not None
            self._closed = bool(flags)
            try:  # waits while --max-queued-responses of them are not taken yet (rayinfer's bound)
                self._send(response, self._closed)
            except _ServingError as exc:  # the request was cancelled meanwhile, or cannot wait here
                raise TritonModelException(exc.message) from None

    def close(self) -> None:
        """The request has its answer otherwise (``execute`` returned it): nothing more may be sent."""
        with self._lock:
            self._closed = True

    def is_cancelled(self) -> bool:
        """Whether the client cancelled the request (as ``request.is_cancelled()``)."""
        return bool(self._cancelled is not None and self._cancelled())


class InferenceTrace:
    """A request's trace, as ``request.trace()`` gives it. Passed as ``trace=`` to a BLS
    request, that request is traced as a child of the model's request when that one is traced."""

    def __init__(self, link: str | None = None) -> None:
        self._link = link

    def get_context(self, mode: str = "opentelemetry") -> str | None:
        """The trace's OpenTelemetry context as JSON (``{"traceparent": ...}``, the request's
        model span) in the server's opentelemetry trace mode; None otherwise, as in Triton."""
        context = self._link.split(";", 3)[3] if self._link and self._link.count(";") >= 3 else ""
        return json.dumps({"traceparent": context}) if context and mode == "opentelemetry" else None


class InferenceRequest:
    """A request as ``execute`` receives it."""

    def __init__(self, inputs: Sequence[Tensor] = (), requested_output_names: Sequence[str] = (),
                 request_id: str = "", correlation_id: int | str = 0, flags: int = 0, timeout: int = 0,
                 parameters: dict[str, Any] | str | None = None, model_name: str = "",
                 model_version: int = -1, trace: InferenceTrace | None = None, **unknown: Any) -> None:
        if unknown:  # as a typed binding refuses a keyword it does not have
            raise TypeError(f"InferenceRequest(): unexpected keyword argument '{next(iter(unknown))}'")
        _typed_items("InferenceRequest", "inputs", inputs, Tensor)
        _typed_items("InferenceRequest", "requested_output_names", requested_output_names, str)
        if any(name is None for name in requested_output_names):
            raise TypeError("InferenceRequest(): argument 'requested_output_names' must hold str, not NoneType")
        for argument, value, kind in (("request_id", request_id, str), ("correlation_id", correlation_id, (int, str)),
                                      ("flags", flags, int), ("timeout", timeout, int), ("model_name", model_name, str),
                                      ("model_version", model_version, int)):
            _typed("InferenceRequest", argument, value, kind)
        if any(t is None for t in inputs):
            raise TritonModelException(f"Input tensor for request with id '{request_id}' and model name "
                                       f"'{model_name}' should not be empty.")
        self._inputs = list(inputs)
        self._outputs = list(requested_output_names)
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._flags = flags
        self._timeout = timeout
        self._parameters = _checked_parameters(parameters)
        self.model_name = model_name
        self.model_version = model_version
        self._sender: InferenceResponseSender | None = None
        self._sender_taken = False  # the model asked for the sender (it may answer through it)
        self._sender_factory: Any = None  # makes a non-decoupled request's sender from it (the backend's)
        self._answer: Any = None  # a non-decoupled request's answer through the sender (the backend's)
        self._cancelled: Any = None  # set by the backend: says whether the client cancelled
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        self._trace = trace

    def set_release_flags(self, flags: int) -> None:
        """``TRITONSERVER_REQUEST_RELEASE_RESCHEDULE``: run this request again in a later batch
        (a model with ``sequence_batching { iterative_sequence: true }``; a decoupled model sets
        it before ``execute`` returns, any other returns None as the request's response)."""
        self._release_flags = int(flags)

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def requested_output_names(self) -> list[str]:
        return self._outputs

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def timeout(self) -> int:
        return self._timeout

    def parameters(self) -> str:
        return json.dumps(self._parameters)

    def is_cancelled(self) -> bool:
        return bool(self._cancelled is not None and self._cancelled())

    def trace(self) -> InferenceTrace:
        return self._trace if self._trace is not None else InferenceTrace()

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            if self._sender_factory is None:
                raise TritonModelException("a response sender is given only to the requests the server passes to "
                                           "execute")
            self._sender = self._sender_factory(self)
        self._sender_taken = True
        return self._sender

    def exec(self, decoupled: bool = False) -> Any:
        """BLS: send this request to ``model_name``; its InferenceResponse (an error inside it),
        or with ``decoupled=True`` an iterator of its responses."""
        return _bls.execute_decoupled(self) if decoupled else _bls.execute(self)

    async def async_exec(self, decoupled: bool = False) -> Any:
        """``exec`` for ``async def execute``."""
        return await (_bls.execute_decoupled_async(self) if decoupled else _bls.execute_async(self))


class Logger:
    """Triton's model logger; lines go to the replica's log."""

    class LogLevel(enum.IntEnum):
        INFO = 0
        WARNING = 1
        ERROR = 2
        VERBOSE = 3

    # As Triton's binding exports them: ``Logger.INFO`` is ``Logger.LogLevel.INFO``.
    INFO = LogLevel.INFO
    WARNING = LogLevel.WARNING
    ERROR = LogLevel.ERROR
    VERBOSE = LogLevel.VERBOSE

    _LEVELS = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.DEBUG}

    # (stacklevel 2: the line names the model's file and line, as Triton's does)
    @staticmethod
    def log(message: str, level: LogLevel = LogLevel.INFO) -> None:
        _typed("Logger.log", "message", message, str)
        if not isinstance(level, Logger.LogLevel):  # a plain int is not a level, as in Triton
            raise TypeError(f"Logger.log(): argument 'level' must be Logger.LogLevel, not {type(level).__name__}")
        _logger.log(Logger._LEVELS[int(level)], "%s", message, stacklevel=2)

    @staticmethod
    def log_info(message: str) -> None:
        _typed("Logger.log_info", "message", message, str)
        _logger.info("%s", message, stacklevel=2)

    @staticmethod
    def log_warn(message: str) -> None:
        _typed("Logger.log_warn", "message", message, str)
        _logger.warning("%s", message, stacklevel=2)

    log_warning = log_warn

    @staticmethod
    def log_error(message: str) -> None:
        _typed("Logger.log_error", "message", message, str)
        _logger.error("%s", message, stacklevel=2)

    @staticmethod
    def log_verbose(message: str) -> None:
        _typed("Logger.log_verbose", "message", message, str)
        _logger.debug("%s", message, stacklevel=2)


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("input", []) if t.get("name") == name), None)


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in model_config.get("output", []) if t.get("name") == name), None)


def triton_string_to_numpy(triton_type_string: str) -> type:
    """``TYPE_FP32`` -> ``numpy.float32`` (``TYPE_STRING``: ``numpy.object_``)."""
    return _CONFIG_TO_NUMPY[triton_type_string]


def numpy_to_triton_type(data_type: Any) -> int | None:
    try:
        return _TYPE_NUMBERS[_wire_datatype(np.dtype(data_type))]
    except Exception:
        return None


def triton_to_numpy_type(data_type: int) -> type | None:
    name = _NUMBER_TYPES.get(int(data_type))
    if name is None or name == "BF16":
        return None
    return np.object_ if name == "BYTES" else _numpy_dtype(name).type


def serialize_byte_tensor(input_tensor: np.ndarray) -> np.ndarray | None:
    """BYTES elements, each prefixed with its 4-byte length, as a uint8 array (as Triton's)."""
    if input_tensor.size == 0:
        return None
    flat = np.array([_to_bytes(v) for v in input_tensor.reshape(-1)], dtype=object)
    return np.frombuffer(_serialize(flat), dtype=np.uint8)


def deserialize_bytes_tensor(encoded_tensor: bytes | np.ndarray) -> np.ndarray:
    """The inverse of :func:`serialize_byte_tensor`: a 1-D object array of ``bytes``."""
    buffer = encoded_tensor.tobytes() if isinstance(encoded_tensor, np.ndarray) else bytes(encoded_tensor)
    values, offset = [], 0
    while offset < len(buffer):
        length = int.from_bytes(buffer[offset:offset + 4], "little")
        values.append(buffer[offset + 4:offset + 4 + length])
        offset += 4 + length
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def load_model(model_name: str, config: str = "", files: dict[str, bytes] | None = None) -> None:
    """Load (or reload) a model, as the repository API does (the server runs in explicit mode);
    ``config`` is a JSON config, ``files`` maps ``file:<version>/<name>`` to the file's bytes."""
    parameters: dict[str, Any] = dict(files or {})
    if config:
        parameters["config"] = config
    _bls.model_control("load_model", model_name, parameters)


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    _bls.model_control("unload_model", model_name, bool(unload_dependents))


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    return bool(_bls.model_control("is_model_ready", model_name, str(model_version or "")))


def get_model_dir() -> str:
    """The running model's folder (``<repository>/<model>``; :mod:`.model_context`)."""
    context = _model_context.current()
    return context.model_dir if context is not None else ""

