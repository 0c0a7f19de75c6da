"""Triton's Prometheus metrics: ``nv_inference_*`` from statistics snapshots, ``nv_cpu_*`` from
/proc and ``nv_gpu_*`` from NVML.

Names, help texts, label names and label order are Triton's, so dashboards and alerts written for
Triton read rayinfer unchanged. Every ``nv_inference_*`` figure comes from the same merged
snapshots as the statistics extension (``GET /v2/models/stats``), so the two always agree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

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
class MetricsOptions:
    """Where Triton's metrics port listens and what it samples (tritonserver's ``--metrics-*``,
    ``--allow-cpu-metrics`` and ``--allow-gpu-metrics``)."""

    address: str
    port: int
    interval_ms: int = 2000
    cpu: bool = True
    gpu: bool = True

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
class CpuFigures:
    utilization: float
    memory_total_bytes: int
    memory_used_bytes: int


@dataclass(frozen=True)
class GpuFigures:
    """One NVIDIA GPU, from NVML; a figure the device does not report is None."""

    uuid: str
    utilization: float | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    power_usage_w: float | None
    power_limit_w: float | None
    energy_j: float | None  # since the server started


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


def render(models: list[ModelFigures], cpu: CpuFigures | None, gpus: tuple[GpuFigures, ...] = ()) -> str:
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
    for metric, help_text, kind, field in _GPU_FAMILIES if gpus else ():
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}"]
        for gpu in gpus:
            value = getattr(gpu, field)
            if value is not None:
                lines.append(f'{metric}{{gpu_uuid="{_escape(gpu.uuid)}"}} {value!r}')
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


class GpuSampler:
    """This node's NVIDIA GPUs through NVML (``pynvml``, from the ``gpu`` extra's nvidia-ml-py), as
    Triton reports them; no figures where NVML, its driver or a GPU is missing. NVML does not
    apply CUDA_VISIBLE_DEVICES, so the process itself needs no GPU of its own."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._devices: list[tuple[str, Any]] = []
        self._energy_start: dict[str, float] = {}
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except Exception as exc:  # ImportError, or NVMLError when there is no driver
            logger.debug("no GPU metrics: %s", exc)
            return
        self._nvml = pynvml
        for index in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = pynvml.nvmlDeviceGetUUID(handle)
            except pynvml.NVMLError as exc:  # this device only (lost, or no permission)
                logger.warning("no metrics for GPU %d: %s", index, exc)
                continue
            self._devices.append((uuid.decode() if isinstance(uuid, bytes) else uuid, handle))
        for uuid, handle in self._devices:
            energy_mj = self._read(pynvml.nvmlDeviceGetTotalEnergyConsumption, handle)
            if energy_mj is not None:
                self._energy_start[uuid] = energy_mj

    @property
    def device_count(self) -> int:
        return len(self._devices)

    def close(self) -> None:
        if self._nvml is not None:
            self._devices = []
            self._nvml.nvmlShutdown()
            self._nvml = None

    def _read(self, query: Any, handle: Any) -> Any:
        try:
            return query(handle)
        except self._nvml.NVMLError:  # not supported by this device (power, energy on older GPUs)
            return None

    def sample(self) -> tuple[GpuFigures, ...]:
        nvml = self._nvml
        figures: list[GpuFigures] = []
        for uuid, handle in self._devices:
            rates = self._read(nvml.nvmlDeviceGetUtilizationRates, handle)
            memory = self._read(nvml.nvmlDeviceGetMemoryInfo, handle)
            power_mw = self._read(nvml.nvmlDeviceGetPowerUsage, handle)
            limit_mw = self._read(nvml.nvmlDeviceGetPowerManagementLimit, handle)
            energy_mj = self._read(nvml.nvmlDeviceGetTotalEnergyConsumption, handle)
            start_mj = self._energy_start.get(uuid)
            figures.append(GpuFigures(
                uuid=uuid,
                utilization=rates.gpu / 100.0 if rates is not None else None,
                memory_total_bytes=int(memory.total) if memory is not None else None,
                memory_used_bytes=int(memory.used) if memory is not None else None,
                power_usage_w=power_mw / 1000.0 if power_mw is not None else None,
                power_limit_w=limit_mw / 1000.0 if limit_mw is not None else None,
                energy_j=(energy_mj - start_mj) / 1000.0 if energy_mj is not None and start_mj is not None else None,
            ))
        return tuple(figures)
