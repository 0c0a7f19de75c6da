"""The host's figures for Triton's ``nv_cpu_*`` and ``nv_gpu_*`` metrics: CPU utilization and
memory from /proc, each NVIDIA GPU from NVML. :mod:`metrics` renders them."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


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
