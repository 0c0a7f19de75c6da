"""Triton's trace extension: settings (server-wide and per model), which requests a replica
traces, and the trace files.

Settings follow Triton's ``--trace-config`` and ``/v2[/models/<m>]/trace/setting``: a level
(``OFF``, or ``TIMESTAMPS`` and/or ``TENSORS``), a rate (every rate-th request is traced), a count
(traces left to take, -1 for no limit), a log frequency (traces per file; 0: one file when the
server stops) and the trace file, which only the command line sets. A model's own settings
override the server's, setting by setting; a null value clears the model's own.

A model replica's :class:`Tracer` samples requests and keeps their timestamps (and tensors, at
the TENSORS level); the ``/v2`` replica collects them, numbers them and writes Triton's JSON
trace files (:mod:`rayinfer.serving.trace_writer`). A traced ensemble request's steps carry its
trace's link, and the members trace them as its children (Triton's ``parent_id``).
"""

from __future__ import annotations

import logging
import os
import threading
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
        replica (a stream's), whose send stamps join it there (:meth:`~rayinfer.serving.trace_writer.TraceWriter.sent`)."""
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
