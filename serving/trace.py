"""Triton's trace extension: settings (server-wide and per model), which requests a replica
traces, and the trace files.

Settings follow Triton's ``--trace-config`` and ``/v2[/models/<m>]/trace/setting``: a level
(``OFF``, or ``TIMESTAMPS`` and/or ``TENSORS``), a rate (every rate-th request is traced), a count
(traces left to take, -1 for no limit), a log frequency (traces per file; 0: one file when the
server stops) and the trace file, which only the command line sets. A model's own settings
override the server's, setting by setting; a null value clears the model's own.

A model replica's :class:`Tracer` samples requests and keeps their timestamps (and tensors, at
the TENSORS level); the ``/v2`` replica collects them, numbers them and writes Triton's JSON
trace files (:class:`TraceWriter`). A traced ensemble request's steps carry its trace's link,
and the members trace them as its children (Triton's ``parent_id``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rayinfer.protocol.errors import Code, InvalidArgError, ServingError, UnsupportedError
from rayinfer.serving import otel

DEFAULTS: dict[str, Any] = {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
                            "log_frequency": "0", "trace_file": "", "trace_mode": "triton"}
logger = logging.getLogger(__name__)

_LEVELS = ("TIMESTAMPS", "TENSORS")
_UINT32_MAX = 2**32 - 1
_INT32_MAX = 2**31 - 1
# How many trace tokens the writer remembers the ids of (traces of one request arrive within
# seconds of each other).
_KEPT_IDS = 65536
# How long a stream request's trace waits in the /v2 replica for the send stamps of its responses
# (or those stamps for their trace) before it is written without them: the client went away.
_SEND_WAIT_S = 30.0


def settings_from_flags(values: list[str]) -> dict[str, Any]:
    """The server-wide settings from tritonserver's ``--trace-config`` values (``rate=N``,
    ``level=L`` (repeatable), ``count=N``, ``mode=triton|opentelemetry``, ``triton,file=PATH``,
    ``triton,log-frequency=N``, ``opentelemetry,<setting>=<value>``); in the opentelemetry
    mode, its exporter's settings under ``"opentelemetry"``."""
    settings = dict(DEFAULTS, trace_level=list(DEFAULTS["trace_level"]))
    levels: list[str] = []
    exporter = otel.default_config()
    for value in values:
        mode, _, setting = value.partition(",") if value.startswith(("triton,", "opentelemetry,")) else ("", "", value)
        key, _, number = setting.partition("=")
        if mode not in ("", "triton", "opentelemetry"):
            raise ValueError(f"--trace-config {value}: the mode is 'triton' or 'opentelemetry'")
        if mode == "opentelemetry":
            try:
                otel.parse_setting(exporter, setting)
            except ValueError as exc:
                raise ValueError(f"--trace-config {value}: {exc}") from None
        elif key == "level":
            if number not in ("OFF", *_LEVELS):
                raise ValueError(f"--trace-config {value}: the level is OFF, TIMESTAMPS or TENSORS")
            levels = [] if number == "OFF" else [*levels, number]
        elif key == "mode":
            if number not in ("triton", "opentelemetry"):
                raise ValueError(f"--trace-config {value}: the mode is 'triton' or 'opentelemetry'")
            settings["trace_mode"] = number
        elif key == "file":
            settings["trace_file"] = os.path.abspath(number) if number else ""
        elif key in ("rate", "count", "log-frequency"):
            name = {"rate": "trace_rate", "count": "trace_count", "log-frequency": "log_frequency"}[key]
            try:
                settings[name] = _number(name, number, -1 if key == "count" else 0,
                                         _INT32_MAX if key == "count" else _UINT32_MAX, error=ValueError)
            except ValueError as exc:
                raise ValueError(f"--trace-config {value}: {exc}") from None
        else:
            raise ValueError(f"--trace-config {value}: unknown setting '{key}'")
    settings["trace_level"] = [level for level in _LEVELS if level in levels] or ["OFF"]
    if settings["trace_mode"] == "opentelemetry":
        settings["opentelemetry"] = exporter
    return settings


def _number(name: str, text: str, low: int, high: int, error: type[Exception] = InvalidArgError) -> str:
    try:
        value = int(text)
    except ValueError:
        raise error(f"Unable to parse '{name}', got: {text}") from None
    if name == "trace_count" and value < low:
        raise error(f"Unable to parse 'trace_count'. Expecting value >= {low}, got:{text}")
    if not low <= value <= high:
        raise error(f"Unable to parse '{name}', value is out of range [ {low}, {high} ], got: {text}")
    return str(value)


def parse_update(doc: dict[str, Any]) -> dict[str, Any]:
    """A settings update (HTTP body, or gRPC's settings as lists) checked as Triton checks it:
    {setting: new value, or None to clear}."""
    update: dict[str, Any] = {}
    if "trace_file" in doc:
        raise UnsupportedError("trace file location can not be updated through network protocol")
    for name, value in doc.items():
        if name not in DEFAULTS or name in ("trace_file", "trace_mode"):
            continue  # Triton reads only the settings it knows and may change
        if value is None:
            update[name] = None
        elif name == "trace_level":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ServingError("attempt to access JSON non-array as array", Code.INTERNAL)
            if "OFF" in value and len(value) > 1:
                raise InvalidArgError("Expect only one trace level 'OFF' is specified")
            levels = [level for level in _LEVELS if level in value]
            update[name] = levels or ["OFF"]
        elif name in ("trace_rate", "trace_count", "log_frequency"):
            if not isinstance(value, str):
                raise ServingError("attempt to access JSON non-string as string", Code.INTERNAL)
            update[name] = _number(name, value, -1 if name == "trace_count" else 0,
                                   _INT32_MAX if name == "trace_count" else _UINT32_MAX)
    return update


@dataclass
class TraceSettings:
    """The server-wide settings and each model's own."""

    server: dict[str, Any] = field(default_factory=lambda: dict(DEFAULTS))
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Counts the changes replicas must take (a client's update, a count spent); a replica
    # registering again with the same version keeps its own sampling state.
    version: int = 0

    def of(self, model: str = "") -> dict[str, Any]:
        """The settings in effect for ``model`` (the server's for ""), in Triton's order."""
        own = self.models.get(model, {}) if model else {}
        merged = {**self.server, **own}
        return {key: merged[key] for key in DEFAULTS}

    def update(self, model: str, update: dict[str, Any]) -> None:
        self.version += 1
        target = self.models.setdefault(model, {}) if model else self.server
        for name, value in update.items():
            if value is None:
                if model:
                    target.pop(name, None)
                else:  # the server's own setting back to its default
                    target[name] = DEFAULTS[name]
            else:
                target[name] = value

    def spend(self, model: str, traces: int) -> bool:
        """Take ``traces`` off the count in effect for ``model``; True when that spent it."""
        count = int(self.of(model)["trace_count"])
        if count <= 0:
            return False
        own = self.models.get(model, {})
        target = own if "trace_count" in own else self.server
        target["trace_count"] = str(max(0, count - traces))
        if count - traces > 0:
            return False
        self.version += 1
        return True

    @property
    def opentelemetry(self) -> dict[str, Any] | None:
        """The exporter's settings in the opentelemetry mode (None in Triton's own)."""
        return self.server.get("opentelemetry") if self.server.get("trace_mode") == "opentelemetry" else None

    def as_dict(self) -> dict[str, Any]:
        return {"server": self.server, "models": self.models, "version": self.version}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> TraceSettings:
        return cls(dict(doc["server"]), {k: dict(v) for k, v in doc["models"].items()}, int(doc.get("version", 0)))


class Trace:
    """One traced request: its timestamps and, at the TENSORS level, its tensors. ``token``
    names it to the traces of the requests it sends on (an ensemble's steps: Triton's child
    traces), which carry its :attr:`link`; ``parent`` is the token of the trace that sent it.
    ``owner``: the model whose settings (levels, file, log frequency) the trace follows, the
    sampled request's model for a trace and all its children, as in Triton."""

    __slots__ = ("stamps", "tensors", "levels", "token", "parent", "owner", "exporter", "spans", "context", "counted")

    def __init__(self, levels: tuple[str, ...], token: str, owner: str, parent: str | None = None,
                 exporter: otel.OtelTraces | None = None, context: str | None = None) -> None:
        self.stamps: list[tuple[str, int]] = []
        self.tensors: list[dict[str, Any]] = []
        self.levels = levels
        self.token = token
        self.owner = owner
        self.parent = parent
        # The opentelemetry mode: the exporter, the open spans, and the W3C traceparent of the
        # parent span (the caller's model span, or the client's span) until the spans open,
        # then of this request's model span.
        self.exporter = exporter
        self.spans: otel.Spans | None = None
        self.context = context
        # Taken off the count: sampled by the rate (not a step, not for a client's context).
        self.counted = parent is None and context is None

    @property
    def link(self) -> str:
        """What a request sent on by the traced one carries (:meth:`Tracer.child` reads it)."""
        context = self.context if self.spans is not None else ""
        return f"{self.token};{','.join(self.levels)};{self.owner};{context or ''}"

    @property
    def writes_timestamps(self) -> bool:
        """Whether the trace's timestamps go to Triton's trace file (its own mode, the
        TIMESTAMPS level), where stamps taken in another process may join them."""
        return self.exporter is None and "TIMESTAMPS" in self.levels

    @property
    def traces_tensors(self) -> bool:
        """Whether the request's tensors are kept: at the TENSORS level, in Triton's own mode
        only (Triton's opentelemetry mode exports no tensors either)."""
        return self.exporter is None and "TENSORS" in self.levels


class Tracer:
    """One model version's sampling in one replica, and the traces it took since last collected."""

    def __init__(self, model: str, version: str) -> None:
        self.model, self.version = model, version
        self._lock = threading.Lock()
        self._levels: tuple[str, ...] = ()
        self._rate = 1000
        self._left = -1
        self._seen = 0
        self._traces: list[dict[str, Any]] = []
        # Tokens are unique across replicas: this tracer's prefix and a count.
        self._prefix = os.urandom(6).hex()
        self._taken = 0
        # Whether any request may be traced (read on every request: a plain attribute).
        self.active = False
        self._version = -1
        self._exporter: otel.OtelTraces | None = None

    def configure(self, settings: dict[str, Any], version: int = 0, opentelemetry: dict[str, Any] | None = None
                  ) -> None:
        """New settings (``opentelemetry``: the exporter's, in that mode); the same version
        again (a replica registering anew) changes nothing, so that the count this replica
        spent is not given back."""
        if version == self._version:
            return
        self._version = version
        self._levels = tuple(level for level in settings["trace_level"] if level != "OFF")
        self._rate = int(settings["trace_rate"])  # 0: none by rate (a client's context still is)
        self._left = int(settings["trace_count"])
        self._exporter = otel.traces_for(opentelemetry) if opentelemetry is not None else None
        if self._exporter is not None and "TENSORS" in self._levels:
            # Triton logs this for each tensor it would have traced; here once per change.
            logger.error("Tensor level tracing is not supported by the mode: opentelemetry")
        # A client's trace context is traced whatever the rate and count (the opentelemetry mode).
        self.active = bool(self._levels) and (self._left != 0 or self._exporter is not None)

    def sample(self, client_context: str | None = None) -> Trace | None:
        """A new trace when this request is to be traced, else None. In the opentelemetry
        mode, a request with its client's trace context (``client_context``) always is."""
        if not self._levels:
            return None
        if client_context and self._exporter is not None:
            return self._new(self._levels, self.model, None, self._exporter, client_context)
        if self._left == 0 or self._rate == 0:
            return None
        self._seen += 1
        if self._seen % self._rate:
            return None
        if self._left > 0:
            self._left -= 1
            self.active = self._left != 0 or self._exporter is not None
        return self._new(self._levels, self.model, None, self._exporter)

    def child(self, link: str) -> Trace | None:
        """The trace of a request a traced request sent on (its :attr:`Trace.link`): taken
        whatever this model's own settings, with the sender's, as Triton traces an ensemble's
        steps; None for a link that is not one."""
        parent, names, owner, context = (link.split(";", 3) + ["", "", ""])[:4]
        levels = tuple(level for level in _LEVELS if level in names.split(","))
        if not (parent and levels and owner):
            return None
        # The opentelemetry mode: the caller's model span is the parent (an in-place step's
        # process exports with the ensemble's exporter).
        exporter = (self._exporter or otel.current()) if context else None
        return self._new(levels, owner, parent, exporter, context if exporter is not None else None)

    def _new(self, levels: tuple[str, ...], owner: str, parent: str | None = None,
             exporter: otel.OtelTraces | None = None, context: str | None = None) -> Trace:
        self._taken += 1
        return Trace(levels, f"{self._prefix}-{self._taken}", owner, parent, exporter, context)

    def start(self, trace: Trace, start_ns: int, received: list[tuple[str, int]]) -> None:
        """Open the trace's spans (the opentelemetry mode), so that the requests it sends on
        can name its model span; ``received``: the protocol's stamps of a client's request."""
        if trace.exporter is not None:
            trace.spans, trace.context = trace.exporter.start(self.model, start_ns, trace.context,
                                                               trace.parent is not None, received)

    def finish(self, request: Any, trace: Trace, more_stamps: list[tuple[str, int]] | None = None,
               awaits_send: bool = False) -> None:
        """The trace is done here; ``awaits_send``: its response is written by the ``/v2``
        replica (a stream's), whose send stamps join it there (:meth:`TraceWriter.sent`)."""
        entry: dict[str, Any]
        if trace.exporter is not None and trace.spans is not None:
            trace.exporter.end(trace.spans, self.model, self.version, request.id or "", trace.stamps, more_stamps or [])
            # The /v2 replica only counts it (its spans are exported from here).
            entry = {"model_name": self.model, "exported": True, "counted": trace.counted}
        else:
            stamps = trace.stamps + more_stamps if more_stamps else trace.stamps
            timestamps = sorted(stamps, key=lambda s: s[1]) if "TIMESTAMPS" in trace.levels else []
            entry = {"model_name": self.model, "model_version": int(self.version) if self.version.isdigit() else 0,
                     "request_id": request.id or "", "timestamps": timestamps, "tensors": trace.tensors,
                     "token": trace.token, "parent": trace.parent, "owner": trace.owner, "counted": trace.counted}
            if awaits_send and timestamps:
                entry["awaits_send"] = True
        with self._lock:
            self._traces.append(entry)

    def collect(self) -> list[dict[str, Any]]:
        with self._lock:
            traces, self._traces = self._traces, []
        return traces


def tensor_activity(activity: str, name: str, datatype: str, data: np.ndarray) -> dict[str, Any]:
    """A TENSORS-level entry: Triton's tensor activity with the data as comma-separated text."""
    flat = data.reshape(-1)
    text = ",".join(v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in flat.tolist())
    return {"activity": activity, "tensor": {"name": name, "data": text, "shape": ",".join(map(str, data.shape)),
                                            "dtype": datatype}}


class TraceWriter:
    """Numbers the traces replicas took and writes Triton's JSON trace files: every
    ``log_frequency`` traces to ``<file>.<n>`` (n from 0), or, with 0, all of them to ``<file>``
    when the server stops (:meth:`close`)."""

    def __init__(self) -> None:
        self._next_id = 1
        # Trace tokens -> the ids given them: a step's trace may arrive before or after its
        # ensemble's (replicas report on their own), and both must name the same id.
        self._ids: OrderedDict[str, int] = OrderedDict()
        self._pending: dict[str, list[dict[str, Any]]] = {}
        self._file_index: dict[str, int] = {}
        self._counts: dict[str, int] = {}  # traces pending per file
        self._frequency: dict[str, int] = {}  # the log frequency last in effect per file
        # A stream request's trace and the send stamps of its responses, whichever came first
        # (by token, oldest first): (when it came, the trace and its settings, or the stamps).
        self._awaiting_sends: dict[str, tuple[float, dict[str, Any], dict[str, Any]]] = {}
        self._sends: dict[str, tuple[float, list[tuple[str, int]]]] = {}

    def add(self, traces: list[dict[str, Any]], settings: dict[str, Any]) -> None:
        """Traces a replica took, written as the settings say; a stream request's
        (``awaits_send``) once the send stamps of its responses are here (:meth:`sent`)."""
        for trace in traces:
            if trace.get("awaits_send"):
                sends = self._sends.pop(trace["token"], None)
                if sends is None:
                    self._awaiting_sends[trace["token"]] = (time.monotonic(), trace, settings)
                    continue
                trace = _with_sends(trace, sends[1])
            self._add(trace, settings)
        self._expire()

    def sent(self, token: str, stamps: list[tuple[str, int]]) -> None:
        """When the responses of the stream request traced as ``token`` were written (Triton's
        GRPC_SEND_START and _END of each, on the model replica's clock), by the ``/v2`` replica."""
        waiting = self._awaiting_sends.pop(token, None)
        if waiting is None:
            self._sends[token] = (time.monotonic(), stamps)
        else:
            self._add(_with_sends(waiting[1], stamps), waiting[2])
        self._expire()

    def _expire(self, wait_s: float = _SEND_WAIT_S) -> None:
        """Write the stream traces that waited ``wait_s`` for their send stamps without them, and
        drop stamps whose trace did not come (a replica that died)."""
        before = time.monotonic() - wait_s
        while self._awaiting_sends:
            token, (since, trace, settings) = next(iter(self._awaiting_sends.items()))
            if since > before:
                break
            del self._awaiting_sends[token]
            self._add(trace, settings)
        while self._sends and next(iter(self._sends.values()))[0] <= before:
            del self._sends[next(iter(self._sends))]

    def _add(self, trace: dict[str, Any], settings: dict[str, Any]) -> None:
        path = settings["trace_file"]
        if not path:
            return
        frequency = int(settings["log_frequency"])
        self._frequency[path] = frequency
        pending = self._pending.setdefault(path, [])
        pending.extend(self._entries(trace))
        self._counts[path] = count = self._counts.get(path, 0) + 1
        if frequency > 0 and count >= frequency:
            self._flush(path)

    def _flush(self, path: str) -> None:
        """Write ``path``'s pending traces: to ``<path>.<n>`` with a log frequency, else ``<path>``."""
        if self._frequency.get(path, 0) > 0:
            index = self._file_index.get(path, 0)
            self._file_index[path] = index + 1
            _write(f"{path}.{index}", self._pending[path])
        else:
            _write(path, self._pending[path])
        self._pending[path], self._counts[path] = [], 0

    def _id(self, token: str | None) -> int:
        """The id of the trace ``token`` names (a new one for a new token or none)."""
        trace_id = self._ids.get(token) if token else None
        if trace_id is None:
            trace_id = self._next_id
            self._next_id += 1
            if token:
                self._ids[token] = trace_id
                if len(self._ids) > _KEPT_IDS:
                    self._ids.popitem(last=False)
        return trace_id

    def _entries(self, trace: dict[str, Any]) -> list[dict[str, Any]]:
        parent = trace.get("parent")
        parent_id = self._id(parent) if parent else 0  # before the child's: a parent's id is lower
        trace_id = self._id(trace.get("token"))
        entries = [{"id": trace_id, "model_name": trace["model_name"], "model_version": trace["model_version"],
                    "request_id": trace["request_id"], "parent_id": parent_id}]
        entries += [{"id": trace_id, **tensor} for tensor in trace["tensors"]]
        if trace["timestamps"]:
            entries.append({"id": trace_id, "timestamps": [{"name": n, "ns": ns} for n, ns in trace["timestamps"]]})
        return entries

    def close(self) -> None:
        """Write what is pending (the server stops), stream traces still waiting for their send
        stamps included."""
        self._expire(wait_s=float("-inf"))
        for path, pending in list(self._pending.items()):
            if pending:
                self._flush(path)


def _with_sends(trace: dict[str, Any], stamps: list[tuple[str, int]]) -> dict[str, Any]:
    """A stream request's trace with the send stamps of its responses, in time order."""
    return {**trace, "timestamps": sorted([*trace["timestamps"], *stamps], key=lambda s: s[1])}


def _write(path: str, entries: list[dict[str, Any]]) -> None:
    try:
        with open(path, "w") as file:
            json.dump(entries, file)
    except OSError as exc:  # the traces are lost; the server keeps serving
        logger.error("could not write the trace file %s: %s", path, exc)
