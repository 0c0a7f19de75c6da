"""Triton's Prometheus metrics: ``nv_inference_*`` and ``nv_cache_*`` from statistics snapshots,
``nv_cpu_*`` and ``nv_gpu_*`` from the host's figures (:mod:`host_figures`).

Names, help texts, label names and label order are Triton's, so dashboards and alerts written for
Triton read rayinfer unchanged. Every ``nv_inference_*`` figure comes from the same merged
snapshots as the statistics extension (``GET /v2/models/stats``), so the two always agree.
The families are prometheus_client metric families, so other collectors' families (a Python
backend's custom metrics) join them in the same text. The text is written here, in the classic
format as ``generate_latest`` writes it but with Triton's spelling of numbers (``2``, not ``2.0``).
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rayinfer.protocol.host_figures import CpuFigures, GpuFigures
from rayinfer.protocol.latency_summary import quantiles
from rayinfer.protocol.statistics import FIRST_RESPONSE_HISTOGRAM


_COUNTERS = (
    ("nv_inference_request_success", "Number of successful inference requests, all batch sizes"),
    ("nv_inference_request_failure", "Number of failed inference requests, all batch sizes"),
    ("nv_inference_count", "Number of inferences performed (does not include cached requests)"),
    ("nv_inference_exec_count", "Number of model executions performed (does not include cached requests)"),
    (
        "nv_inference_request_duration_us",
        "Cumulative inference request duration in microseconds (includes cached requests)",
    ),
    (
        "nv_inference_queue_duration_us",
        "Cumulative inference queuing duration in microseconds (includes cached requests)",
    ),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative compute input duration in microseconds (does not include cached requests)",
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration in microseconds (does not include cached requests)",
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative inference compute output duration in microseconds (does not include cached requests)",
    ),
)
_PENDING = (
    "nv_inference_pending_request_count",
    "Instantaneous number of pending requests awaiting execution per-model.",
)
# The response cache's families, for the models that use it: (name, help, duration, count or us).
_CACHE_FAMILIES = (
    ("nv_cache_num_hits_per_model", "Number of cache hits per model", "cache_hit", 0),
    ("nv_cache_num_misses_per_model", "Number of cache misses per model", "cache_miss", 0),
    ("nv_cache_hit_duration_per_model", "Total cache hit duration per model, in microseconds", "cache_hit", 1),
    ("nv_cache_miss_duration_per_model", "Total cache miss (insert+lookup) duration per model, in microseconds",
     "cache_miss", 1),
)
# Triton 2.51 splits failures by reason; rayinfer's failures are all the backend's.
_FAILURE_REASONS = ("OTHER", "BACKEND", "CANCELED", "REJECTED")
_DURATION_OF = {
    "nv_inference_request_duration_us": "success",
    "nv_inference_queue_duration_us": "queue",
    "nv_inference_compute_input_duration_us": "compute_input",
    "nv_inference_compute_infer_duration_us": "compute_infer",
    "nv_inference_compute_output_duration_us": "compute_output",
}


# Triton's latency summaries (--metrics-config summary_latencies=true): (family, help, summary).
# The help texts are Triton 2.51's, word for word.
_SUMMARIES = (
    ("nv_inference_request_summary_us",
     "Summary of inference request duration in microseconds (includes cached requests)", "request"),
    ("nv_inference_queue_summary_us",
     "Summary of inference queuing duration in microseconds (includes cached requests)", "queue"),
    ("nv_inference_compute_input_summary_us",
     "Cumulative compute input duration in microseconds (does not include cached requests)", "compute_input"),
    ("nv_inference_compute_infer_summary_us",
     "Cumulative compute inference duration in microseconds (does not include cached requests)", "compute_infer"),
    ("nv_inference_compute_output_summary_us",
     "Cumulative inference compute output duration in microseconds (does not include cached requests)",
     "compute_output"),
)
# Time to first response (Triton 2.52's family, --metrics-config histogram_latencies=true).
FIRST_RESPONSE_HELP = "Duration from request to first response in milliseconds"
# Triton 2.51's quantiles when summary_quantiles is not given.
DEFAULT_QUANTILES = (0.5, 0.9, 0.95, 0.99, 0.999)


class MetricsConfig(NamedTuple):
    """What ``--metrics-config`` asks for."""

    summary_quantiles: tuple[float, ...]  # the summaries' quantiles; empty when summary_latencies is off
    counter_latencies: bool  # the nv_inference_*_duration_us counters
    histogram_latencies: bool = False  # nv_inference_first_response_histogram_ms


def parse_metrics_config(values: Iterable[str]) -> MetricsConfig:
    """tritonserver's ``--metrics-config SETTING=VALUE`` values. ValueError names a value that is
    not understood."""
    summaries, counters, histograms = False, True, False
    wanted: tuple[float, ...] = DEFAULT_QUANTILES
    for value in values:
        key, sep, setting = value.partition("=")
        if not sep:
            raise ValueError(f"--metrics-config takes SETTING=VALUE, got '{value}'")
        key, setting = key.strip(), setting.strip().lower()
        if key in ("summary_latencies", "counter_latencies", "histogram_latencies"):
            if setting not in ("true", "false"):
                raise ValueError(f"--metrics-config {key} must be true or false, got '{setting}'")
            if key == "summary_latencies":
                summaries = setting == "true"
            elif key == "counter_latencies":
                counters = setting == "true"
            else:
                histograms = setting == "true"
        elif key == "summary_quantiles":
            # Triton's form: QUANTILE:ERROR pairs, comma-separated (the error bound is met here
            # by the buckets' 1% precision).
            try:
                wanted = tuple(sorted({float(pair.split(":")[0]) for pair in setting.split(",") if pair}))
            except ValueError:
                raise ValueError(f"--metrics-config summary_quantiles takes QUANTILE:ERROR,..., got '{setting}'") from None
            if not wanted or not all(0.0 <= q <= 1.0 for q in wanted):
                raise ValueError(f"--metrics-config summary_quantiles must lie between 0 and 1, got '{setting}'")
        else:
            raise ValueError(f"--metrics-config setting '{key}' is not supported (summary_latencies, "
                             "summary_quantiles, counter_latencies, histogram_latencies are)")
    return MetricsConfig((wanted if summaries else ()), counters, histograms)


@dataclass(frozen=True)
class MetricsOptions:
    """Where Triton's metrics port listens and what it samples and reports (tritonserver's
    ``--metrics-*``, ``--allow-cpu-metrics`` and ``--allow-gpu-metrics``)."""

    address: str
    port: int
    interval_ms: int = 2000
    cpu: bool = True
    gpu: bool = True
    # --metrics-config: the latency summaries' quantiles (empty: no summaries), the latency counters.
    summary_quantiles: tuple[float, ...] = ()
    counter_latencies: bool = True
    histogram_latencies: bool = False

    def __post_init__(self) -> None:
        if self.interval_ms <= 0:
            raise ValueError(f"the metrics interval must be a positive number of milliseconds, got {self.interval_ms}")


@dataclass(frozen=True)
class ModelFigures:
    """One model version's merged statistics snapshot and its pending requests."""

    name: str
    version: str
    snapshot: dict[str, Any]
    pending: int = 0


@dataclass(frozen=True)
class CacheFigures:
    """The response cache of the node, for Triton's server-wide cache gauges."""

    size_bytes: int
    used_bytes: int
    entries: int
    evictions: int


# Triton's server-wide cache gauges: (name, help).
_CACHE_GAUGES = (
    ("nv_cache_util", "Cache utilization [0.0 - 1.0]"),
    ("nv_cache_num_entries", "Number of responses stored in response cache"),
    ("nv_cache_num_hits", "Number of cache hits in response cache"),
    ("nv_cache_num_misses", "Number of cache misses in response cache"),
    ("nv_cache_num_lookups", "Number of cache lookups in response cache"),
    ("nv_cache_num_evictions", "Number of cache evictions in response cache"),
    ("nv_cache_lookup_duration", "Total cache lookup duration (hit and miss), in microseconds"),
    ("nv_cache_insertion_duration", "Total cache insertion duration, in microseconds"),
)


# Triton's GPU families: (name, help, type, GpuFigures field), labelled by gpu_uuid.
_GPU_FAMILIES = (
    ("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", "gauge", "utilization"),
    ("nv_gpu_memory_total_bytes", "GPU total memory, in bytes", "gauge", "memory_total_bytes"),
    ("nv_gpu_memory_used_bytes", "GPU used memory, in bytes", "gauge", "memory_used_bytes"),
    ("nv_gpu_power_usage", "GPU power usage in watts", "gauge", "power_usage_w"),
    ("nv_gpu_power_limit", "GPU power management limit in watts", "gauge", "power_limit_w"),
    ("nv_energy_consumption", "GPU energy consumption in joules since the Triton Server started", "counter",
     "energy_j"),
)


class TritonCollector:
    """A prometheus_client collector of Triton's families over one scrape's figures: it builds its
    families each time it is collected and keeps nothing between scrapes.

    Counters are declared as Triton (prometheus-cpp) declares them: each sample carries the
    family's own name, with no ``_total`` suffix, so they are built as ``Metric`` objects with
    exact sample names (``CounterMetricFamily`` would append ``_total``). Label names are written
    sorted, the order Triton's labels (``model``, ``reason``, ``version``) have.
    """

    def __init__(self, models: Sequence[ModelFigures], cpu: CpuFigures | None, gpus: Sequence[GpuFigures] = (),
                 cache: CacheFigures | None = None, summary_quantiles: tuple[float, ...] = (),
                 counter_latencies: bool = True, now_s: float | None = None,
                 histogram_latencies: bool = False) -> None:
        self._models = models
        self._histograms = histogram_latencies
        self._cpu = cpu
        self._gpus = gpus
        self._cache = cache
        self._quantiles = summary_quantiles
        self._counter_latencies = counter_latencies
        self._now_s = now_s

    def describe(self) -> Iterator[Metric]:
        """The families ``collect`` yields, so a registry refuses an extra collector that clashes with them."""
        return TritonCollector([], self._cpu, self._gpus).collect()

    def collect(self) -> Iterator[Metric]:
        yield from self._model_families()
        yield from self._cache_families()
        yield from self._cpu_families()
        yield from self._gpu_families()

    def _model_families(self) -> Iterator[Metric]:
        for metric, help_text in _COUNTERS:
            if metric in _DURATION_OF and not self._counter_latencies:
                continue
            family = Metric(metric, help_text, "counter")
            for m in self._models:
                if metric == "nv_inference_request_failure":
                    # Failures not counted under another reason are the model's own (BACKEND).
                    others = m.snapshot.get("failure_reasons", {})
                    backend = int(m.snapshot["durations"]["fail"][0]) - sum(others.values())
                    for reason in _FAILURE_REASONS:
                        labels = {"model": m.name, "reason": reason, "version": m.version}
                        family.add_sample(metric, labels, backend if reason == "BACKEND" else others.get(reason, 0))
                    continue
                family.add_sample(metric, {"model": m.name, "version": m.version}, _counter_value(metric, m.snapshot))
            yield family
        yield from self._summary_families()
        yield from self._histogram_families()
        pending = GaugeMetricFamily(*_PENDING, labels=("model", "version"))
        for m in self._models:
            pending.add_metric((m.name, m.version), m.pending)
        yield pending
        cached = [m for m in self._models if m.snapshot.get("response_cache")]
        for metric, help_text, key, field in _CACHE_FAMILIES if cached else ():
            family = Metric(metric, help_text, "counter")
            for m in cached:
                count, ns = m.snapshot["durations"].get(key, (0, 0))
                family.add_sample(metric, {"model": m.name, "version": m.version}, ns // 1000 if field else count)
            yield family

    def _summary_families(self) -> Iterator[Metric]:
        """Triton's latency summaries: cumulative count and sum, and quantiles over the last
        minute (:mod:`rayinfer.protocol.latency_summary`), per model version."""
        if not self._quantiles:
            return
        now = time.time() if self._now_s is None else self._now_s
        for metric, help_text, key in _SUMMARIES:
            family = Metric(metric, help_text, "summary")
            for m in self._models:
                summary = m.snapshot.get("summaries", {}).get(key)
                if summary is None:
                    continue
                labels = {"model": m.name, "version": m.version}
                family.add_sample(metric + "_count", labels, summary["count"])
                family.add_sample(metric + "_sum", labels, round(summary["sum_us"]))
                for q, value in quantiles(summary, self._quantiles, now).items():
                    family.add_sample(metric, {**labels, "quantile": _number(q)},
                                      value if math.isnan(value) else round(value))
            yield family

    def _histogram_families(self) -> Iterator[Metric]:
        """Triton's time to first response (--metrics-config histogram_latencies=true), per model
        version from its load: cumulative buckets (the config's ``model_metrics`` bounds, else
        Triton's), count and sum of whole milliseconds. No family when no model has one."""
        if not self._histograms:
            return
        family = Metric(FIRST_RESPONSE_HISTOGRAM, FIRST_RESPONSE_HELP, "histogram")
        for m in self._models:
            histogram = m.snapshot.get("first_response")
            if histogram is None:
                continue
            labels = {"model": m.name, "version": m.version}
            total = 0
            for bound, count in zip([*histogram["buckets"], math.inf], histogram["counts"]):
                total += count
                family.add_sample(FIRST_RESPONSE_HISTOGRAM + "_bucket", {**labels, "le": _number(bound)}, total)
            family.add_sample(FIRST_RESPONSE_HISTOGRAM + "_count", labels, total)
            family.add_sample(FIRST_RESPONSE_HISTOGRAM + "_sum", labels, histogram["sum_ms"])
        if family.samples:
            yield family

    def _cache_families(self) -> Iterator[Metric]:
        """The node's cache as a whole. Lookup time is not split into hits and misses' lookups:
        a miss's lookup and insertion are counted together (as ``cache_miss``)."""
        cache = self._cache
        if cache is None:
            return
        hits = sum(m.snapshot["durations"].get("cache_hit", (0, 0))[0] for m in self._models)
        hit_ns = sum(m.snapshot["durations"].get("cache_hit", (0, 0))[1] for m in self._models)
        misses = sum(m.snapshot["durations"].get("cache_miss", (0, 0))[0] for m in self._models)
        miss_ns = sum(m.snapshot["durations"].get("cache_miss", (0, 0))[1] for m in self._models)
        values = (cache.used_bytes / cache.size_bytes if cache.size_bytes else 0.0, cache.entries, hits, misses,
                  hits + misses, cache.evictions, hit_ns // 1000, miss_ns // 1000)
        for (name, help_text), value in zip(_CACHE_GAUGES, values):
            yield GaugeMetricFamily(name, help_text, value=value)

    def _cpu_families(self) -> Iterator[Metric]:
        cpu = self._cpu
        if cpu is None:
            return
        yield GaugeMetricFamily("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", value=cpu.utilization)
        yield GaugeMetricFamily("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes",
                                value=cpu.memory_total_bytes)
        yield GaugeMetricFamily("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes",
                                value=cpu.memory_used_bytes)

    def _gpu_families(self) -> Iterator[Metric]:
        for metric, help_text, kind, field in _GPU_FAMILIES if self._gpus else ():
            family = Metric(metric, help_text, kind)
            for gpu in self._gpus:
                value = getattr(gpu, field)
                if value is not None:  # a figure this GPU does not report has no sample
                    family.add_sample(metric, {"gpu_uuid": gpu.uuid}, value)
            yield family


def render(
    models: Sequence[ModelFigures],
    cpu: CpuFigures | None,
    gpus: Sequence[GpuFigures] = (),
    *,
    extra: Iterable[Collector] = (),
    cache: CacheFigures | None = None,
    summary_quantiles: tuple[float, ...] = (),
    counter_latencies: bool = True,
    histogram_latencies: bool = False,
) -> str:
    """The Prometheus text exposition Triton serves on its metrics port, followed by the families
    of ``extra`` prometheus_client collectors (a Python backend's custom metrics, for instance).

    Every family is collected from one fresh ``CollectorRegistry``, so an extra collector that
    describes itself and clashes with Triton's names raises ``ValueError``.
    """
    registry = CollectorRegistry()
    registry.register(TritonCollector(models, cpu, gpus, cache, summary_quantiles, counter_latencies,
                                      histogram_latencies=histogram_latencies))
    for collector in extra:
        registry.register(collector)
    return _classic_text(registry.collect())


# How the classic format declares the types it lacks, as generate_latest: (name suffix, type).
_CLASSIC_TYPES = {"info": ("_info", "gauge"), "stateset": ("", "gauge"), "gaugehistogram": ("", "histogram"),
                  "unknown": ("", "untyped")}
# OpenMetrics-only samples, which generate_latest writes after their family as gauge families of their own.
_TRAILING = ("_created", "_gcount", "_gsum")


class _Escaped(dict[Any, str]):
    """Each metric name or label as the text writes it, escaped once per text (the same names and
    labels recur in every family)."""

    def __init__(self, escape: Callable[[Any], str]) -> None:
        super().__init__()
        self._escape = escape

    def __missing__(self, key: Any) -> str:
        self[key] = escaped = self._escape(key)
        return escaped


# Each character a classic-format name may not have becomes "_", as generate_latest does by default
# (prometheus_client accepts UTF-8 names).
_METRIC_NAME = functools.partial(re.compile(r"^[0-9]|[^a-zA-Z0-9_:]").sub, "_")
_LABEL_NAME = functools.partial(re.compile(r"^[0-9]|[^a-zA-Z0-9_]").sub, "_")


def _label(label: tuple[str, str]) -> str:
    """``name="value"``, the value's backslashes, newlines and double quotes escaped."""
    value = label[1].replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
    return f'{_LABEL_NAME(label[0])}="{value}"'


def _classic_text(families: Iterable[Metric]) -> str:
    """``families`` in the classic text format (0.0.4) as ``generate_latest`` writes them, except
    that numbers are spelled as Triton (prometheus-cpp) spells them and a counter whose samples
    carry the family's own name (Triton's counters, which have no ``_total``) is declared under that
    name; any other counter is declared as its samples are named, ``<name>_total``."""
    out: list[str] = []
    names, labels = _Escaped(_METRIC_NAME), _Escaped(_label)
    for family in families:
        name, kind = family.name, family.type
        if kind == "counter" and any(sample.name != name for sample in family.samples):
            name += "_total"
        elif kind in _CLASSIC_TYPES:
            suffix, kind = _CLASSIC_TYPES[kind]
            name += suffix
        help_text = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {names[name]} {help_text}\n# TYPE {names[name]} {kind}\n")
        trailing: dict[str, list[str]] = {family.name + suffix: [] for suffix in _TRAILING}
        for sample in family.samples:
            line = names[sample.name]
            if sample.labels:
                # Label names sorted (Triton's order), a summary's quantile or a histogram's le
                # last, as Triton writes them.
                ordered = sorted(sample.labels.items(), key=lambda label: (label[0] in ("quantile", "le"), label[0]))
                line += f"{{{','.join([labels[label] for label in ordered])}}}"
            line = f"{line} {_number(sample.value)}"
            if sample.timestamp is not None:
                line += f" {int(float(sample.timestamp) * 1000):d}"
            trailing.get(sample.name, out).append(line + "\n")
        for trailing_name, lines in trailing.items():
            if lines:
                out += [f"# HELP {names[trailing_name]} {help_text}\n# TYPE {names[trailing_name]} gauge\n", *lines]
    return "".join(out)


def _number(value: float) -> str:
    """A sample's value as Triton (prometheus-cpp) writes it: an integral value as an integer
    (``2``, ``85899345920``) below 1e16, where prometheus-cpp's 16 digits turn to an exponent;
    others as Python's shortest exact spelling (``0.25``, ``1e+16``); ``+Inf``, ``-Inf``, ``NaN``."""
    if type(value) is int:
        return str(value)
    value = float(value)
    if value.is_integer() and -1e16 < value < 1e16:
        return str(int(value))
    if math.isfinite(value):
        return repr(value)
    return "NaN" if math.isnan(value) else "+Inf" if value > 0 else "-Inf"


def _counter_value(metric: str, snapshot: dict[str, Any]) -> int:
    if metric == "nv_inference_request_success":
        return int(snapshot["durations"]["success"][0])
    if metric == "nv_inference_count":
        return int(snapshot["inference_count"])
    if metric == "nv_inference_exec_count":
        return int(snapshot["execution_count"])
    return int(snapshot["durations"][_DURATION_OF[metric]][1]) // 1000
