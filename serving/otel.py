"""Triton's ``opentelemetry`` trace mode: traced requests become OpenTelemetry spans, which each
replica exports itself over OTLP/HTTP (no hop through the ``/v2`` replica).

As in Triton, a request's trace is three spans: ``InferRequest`` (the protocol's events:
``HTTP_RECV_START`` / ``_END`` or ``GRPC_WAITREAD_START`` / ``_END``, ``INFER_RESPONSE_COMPLETE``,
and the send's), a span named after the model (``REQUEST_START``, ``QUEUE_START``,
``REQUEST_END``; attributes ``triton.model_name``, ``triton.model_version`` and, when the request
has an id, ``triton.request_id``) and its ``compute`` span (``COMPUTE_START``,
``COMPUTE_INPUT_END``, ``COMPUTE_OUTPUT_START``, ``COMPUTE_END``). An ensemble step's or a BLS
request's model span is a child of its caller's model span. A client's W3C ``traceparent``
header (HTTP) or metadata (gRPC) makes the ``InferRequest`` span a child of the client's span,
and such a request is traced whatever the rate and count, as in Triton.

Settings (``--trace-config opentelemetry,<setting>=<value>``): ``url`` (default
``http://localhost:4318/v1/traces``), ``resource=<key>=<value>`` (repeatable; also read from
``OTEL_RESOURCE_ATTRIBUTES``), ``bsp_max_queue_size``, ``bsp_schedule_delay`` (ms) and
``bsp_max_export_batch_size`` (Triton's batch span processor settings and defaults).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_URL = "http://localhost:4318/v1/traces"
_BSP = {"bsp_max_queue_size": 2048, "bsp_schedule_delay": 5000, "bsp_max_export_batch_size": 512}
# Traces take perf_counter timestamps (monotonic); spans take the wall clock's.
_EPOCH_OFFSET_NS = time.time_ns() - time.perf_counter_ns()
_ROOT = "InferRequest"
_MODEL_EVENTS = ("REQUEST_START", "QUEUE_START", "REQUEST_END")
_COMPUTE_EVENTS = ("COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END")


def default_config() -> dict[str, Any]:
    return {"url": DEFAULT_URL, "resource": {}, **_BSP}


def parse_setting(config: dict[str, Any], setting: str) -> None:
    """One ``--trace-config opentelemetry,<setting>`` into ``config`` (raises ValueError)."""
    key, _, value = setting.partition("=")
    if key == "url":
        config["url"] = value if "://" in value else f"http://{value}"
    elif key == "resource":
        name, equals, attribute = value.partition("=")
        if not name or not equals:
            raise ValueError("a resource is <key>=<value>")
        config["resource"][name] = attribute
    elif key in _BSP:
        try:
            config[key] = int(value)
        except ValueError:
            raise ValueError(f"'{key}' takes an integer, got: {value}") from None
        if config[key] < 0:
            raise ValueError(f"'{key}' must not be negative")
    else:
        raise ValueError(f"unknown opentelemetry setting '{key}'")


def epoch_ns(perf_ns: int) -> int:
    return perf_ns + _EPOCH_OFFSET_NS


class Spans:
    """The open spans of one traced request: its model span, and its ``InferRequest`` span
    when the request came from a client rather than from a traced caller."""

    __slots__ = ("model", "root")

    def __init__(self, model: Any, root: Any) -> None:
        self.model = model
        self.root = root


class OtelTraces:
    """One process's tracer provider and OTLP/HTTP exporter (``span_exporter``: another
    exporter, as tests give one)."""

    def __init__(self, config: dict[str, Any], span_exporter: Any = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if span_exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            span_exporter = OTLPSpanExporter(endpoint=config["url"])
        # Resource.create reads OTEL_RESOURCE_ATTRIBUTES too; the flags' attributes win.
        resource = Resource.create({"service.name": "triton-inference-server", **config["resource"]})
        self.provider = TracerProvider(resource=resource)
        queue_size = max(1, config["bsp_max_queue_size"])
        self.provider.add_span_processor(BatchSpanProcessor(
            span_exporter, max_queue_size=queue_size, schedule_delay_millis=max(1, config["bsp_schedule_delay"]),
            max_export_batch_size=min(queue_size, max(1, config["bsp_max_export_batch_size"]))))
        self._tracer = self.provider.get_tracer("rayinfer")
        self._propagator = TraceContextTextMapPropagator()

    def start(self, model: str, start_ns: int, parent: str | None, from_caller: bool,
              received: list[tuple[str, int]]) -> tuple[Spans, str]:
        """Open a request's spans: under its caller's model span (``from_caller``: ``parent``
        is that span's traceparent), else an ``InferRequest`` span, under the client's span
        when ``parent`` is the client's traceparent, with the protocol's ``received`` events.
        Returns them and the model span's traceparent (for the requests it sends on)."""
        from opentelemetry import trace

        context = self._propagator.extract({"traceparent": parent}) if parent else None
        root = None
        if not from_caller:
            root_start = received[0][1] if received else start_ns
            root = self._tracer.start_span(_ROOT, context=context, start_time=epoch_ns(root_start))
            for name, ns in received:
                root.add_event(name, timestamp=epoch_ns(ns))
            context = trace.set_span_in_context(root)
        span = self._tracer.start_span(model, context=context, start_time=epoch_ns(start_ns))
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(span))
        return Spans(span, root), carrier.get("traceparent", "")

    def end(self, spans: Spans, model: str, version: str, request_id: str, stamps: list[tuple[str, int]],
            sent: list[tuple[str, int]]) -> None:
        """Close a request's spans with its timestamps (``sent``: the protocol's send events)."""
        from opentelemetry import trace

        at = dict(stamps)
        model_span = spans.model
        model_span.set_attributes({"triton.model_name": model,
                                   "triton.model_version": int(version) if version.isdigit() else -1})
        if request_id:
            model_span.set_attribute("triton.request_id", request_id)
        for name in _MODEL_EVENTS:
            if name in at:
                model_span.add_event(name, timestamp=epoch_ns(at[name]))
        if "COMPUTE_START" in at:
            compute = self._tracer.start_span("compute", context=trace.set_span_in_context(model_span),
                                              start_time=epoch_ns(at["COMPUTE_START"]))
            for name in _COMPUTE_EVENTS:
                if name in at:
                    compute.add_event(name, timestamp=epoch_ns(at[name]))
            compute.end(end_time=epoch_ns(at.get("COMPUTE_END", at["COMPUTE_START"])))
        end = at.get("REQUEST_END", max(ns for _, ns in stamps))
        model_span.end(end_time=epoch_ns(end))
        if spans.root is not None:
            spans.root.add_event("INFER_RESPONSE_COMPLETE", timestamp=epoch_ns(end))
            for name, ns in sent:
                spans.root.add_event(name, timestamp=epoch_ns(ns))
            spans.root.end(end_time=epoch_ns(sent[-1][1] if sent else end))

    def close(self) -> None:
        """Export what is pending, then stop."""
        self.provider.shutdown()


_lock = threading.Lock()
_traces: tuple[str, OtelTraces] | None = None


def traces_for(config: dict[str, Any]) -> OtelTraces:
    """This process's exporter for ``config`` (one per process; a new config replaces it)."""
    global _traces
    key = json.dumps(config, sort_keys=True)
    with _lock:
        if _traces is None or _traces[0] != key:
            if _traces is not None:
                _traces[1].close()
            _traces = (key, OtelTraces(config))
        return _traces[1]


def current() -> OtelTraces | None:
    """The exporter this process has, if any (a traced caller's step runs in a process whose
    own model is configured)."""
    return _traces[1] if _traces is not None else None
