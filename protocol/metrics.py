"""Triton's Prometheus metrics (``nv_inference_*``, ``nv_cpu_*``) rendered from statistics snapshots.

Names, help texts, label names and label order are Triton's, so dashboards and alerts written for
Triton read rayinfer unchanged. Every figure comes from the same merged snapshots as the
statistics extension (``GET /v2/models/stats``), so the two always agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
# Triton 2.51 splits failures by reason; rayinfer's failures are all the backend's.
_FAILURE_REASONS = ("OTHER", "BACKEND", "CANCELED", "REJECTED")
_DURATION_OF = {
    "nv_inference_request_duration_us": "success",
    "nv_inference_queue_duration_us": "queue",
    "nv_inference_compute_input_duration_us": "compute_input",
    "nv_inference_compute_infer_duration_us": "compute_infer",
    "nv_inference_compute_output_duration_us": "compute_output",
}


@dataclass(frozen=True)
class ModelFigures:
    """One model version's merged statistics snapshot and its pending requests."""

    name: str
    version: str
    snapshot: dict[str, Any]
    pending: int = 0


@dataclass(frozen=True)
class CpuFigures:
    utilization: float
    memory_total_bytes: int
    memory_used_bytes: int


def render(models: list[ModelFigures], cpu: CpuFigures | None) -> str:
    """The Prometheus text exposition Triton serves on its metrics port."""
    lines: list[str] = []
    for metric, help_text in _COUNTERS:
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} counter"]
        for m in models:
            if metric == "nv_inference_request_failure":
                failed = m.snapshot["durations"]["fail"][0]
                for reason in _FAILURE_REASONS:
                    value = failed if reason == "BACKEND" else 0
                    lines.append(f'{metric}{{model="{_escape(m.name)}",reason="{reason}",version="{m.version}"}} {value}')
                continue
            lines.append(f"{metric}{_labels(m)} {_counter_value(metric, m.snapshot)}")
    metric, help_text = _PENDING
    lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge"]
    lines += [f"{metric}{_labels(m)} {m.pending}" for m in models]
    if cpu is not None:
        for metric, help_text, value in (
            ("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", repr(cpu.utilization)),
            ("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", str(cpu.memory_total_bytes)),
            ("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", str(cpu.memory_used_bytes)),
        ):
            lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge", f"{metric} {value}"]
    return "\n".join(lines) + "\n"


def _counter_value(metric: str, snapshot: dict[str, Any]) -> int:
    if metric == "nv_inference_request_success":
        return int(snapshot["durations"]["success"][0])
    if metric == "nv_inference_count":
        return int(snapshot["inference_count"])
    if metric == "nv_inference_exec_count":
        return int(snapshot["execution_count"])
    return int(snapshot["durations"][_DURATION_OF[metric]][1]) // 1000


def _labels(m: ModelFigures) -> str:
    return f'{{model="{_escape(m.name)}",version="{m.version}"}}'


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class CpuSampler:
    """System-wide CPU utilization between calls and memory use, from /proc (Linux), as Triton."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc
        self._last: tuple[int, int] | None = None

    def sample(self) -> CpuFigures | None:
        try:
            fields = (self._proc / "stat").read_text().splitlines()[0].split()[1:]
            meminfo = {}
            for line in (self._proc / "meminfo").read_text().splitlines():
                key, _, rest = line.partition(":")
                value = rest.split()
                if len(value) == 2 and value[1] == "kB":  # "MemTotal:  1000 kB"
                    meminfo[key] = int(value[0]) * 1024
        except (OSError, IndexError, ValueError):
            return None
        ticks = [int(v) for v in fields[:8]]
        idle = ticks[3] + ticks[4]  # idle + iowait
        total = sum(ticks)
        utilization = 0.0
        if self._last is not None and total > self._last[1]:
            utilization = 1.0 - (idle - self._last[0]) / (total - self._last[1])
        self._last = (idle, total)
        mem_total = meminfo.get("MemTotal", 0)
        mem_used = mem_total - meminfo.get("MemAvailable", meminfo.get("MemFree", 0))
        return CpuFigures(max(0.0, min(1.0, utilization)), mem_total, mem_used)
