"""The metrics port's HTTP server on a real socket: what it samples follows its options.

NVML needs an NVIDIA GPU, so the GPU sampler is replaced by a stand-in that reports one GPU;
the CPU figures come from this machine's /proc.
"""

from __future__ import annotations

import asyncio
import urllib.request

import pytest

from rayinfer.deployments import metrics_endpoint
from rayinfer.deployments.metrics_endpoint import MetricsEndpoint
from rayinfer.protocol.metrics import CpuFigures, GpuFigures, MetricsOptions, render


class OneGpu:
    """Stands in for NVML's sampler: one GPU; counts its samples and whether it was closed."""

    instances: list[OneGpu] = []

    def __init__(self) -> None:
        self.device_count = 1
        self.samples = 0
        self.closed = False
        OneGpu.instances.append(self)

    def sample(self) -> tuple[GpuFigures, ...]:
        self.samples += 1
        return (GpuFigures("GPU-0", 0.5, 100, 50, 20.0, 70.0, float(self.samples)),)

    def close(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> type[OneGpu]:
    OneGpu.instances.clear()
    monkeypatch.setattr(metrics_endpoint, "GpuSampler", OneGpu)
    return OneGpu


async def _scrapes(options: MetricsOptions, count: int, pause_s: float) -> tuple[list[str], list[CpuFigures | None]]:
    seen: list[CpuFigures | None] = []

    async def render_text(cpu: CpuFigures | None, gpus: tuple[GpuFigures, ...]) -> str:
        seen.append(cpu)
        return render([], cpu, gpus)

    endpoint = MetricsEndpoint(render_text, options)
    endpoint.start()
    texts = []
    try:
        url = f"http://127.0.0.1:{endpoint.port}/metrics"
        for _ in range(count):
            await asyncio.sleep(pause_s)
            texts.append(await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode()))
    finally:
        endpoint.stop()
        await asyncio.sleep(0.2)  # uvicorn closes its socket; the sampling task ends
    return texts, seen


def test_figures_are_sampled_every_interval() -> None:
    texts, seen = asyncio.run(_scrapes(MetricsOptions("127.0.0.1", 0, interval_ms=50), 3, 0.2))
    assert all("# TYPE nv_cpu_utilization gauge" in text and 'nv_gpu_utilization{gpu_uuid="GPU-0"}' in text
               for text in texts)
    assert all(cpu is not None for cpu in seen)
    assert len({id(cpu) for cpu in seen}) == 3  # a new CPU sample between scrapes 200 ms apart
    gpu = OneGpu.instances[0]
    # One sample at start, then one per 50 ms for ~0.6 s (timers on a loaded machine run late).
    assert 5 <= gpu.samples <= 25
    assert gpu.closed


@pytest.mark.parametrize("cpu, gpu", [(False, True), (True, False), (False, False)])
def test_allow_cpu_and_gpu_metrics_leave_their_families_out(cpu: bool, gpu: bool) -> None:
    texts, seen = asyncio.run(_scrapes(MetricsOptions("127.0.0.1", 0, interval_ms=50, cpu=cpu, gpu=gpu), 2, 0.1))
    for text in texts:
        assert ("nv_cpu_utilization" in text) is cpu
        assert ("nv_gpu_utilization" in text and "nv_energy_consumption" in text) is gpu
    assert all((figures is not None) is cpu for figures in seen)
    if gpu:
        assert OneGpu.instances[0].samples >= 2 and OneGpu.instances[0].closed
    else:
        assert not OneGpu.instances  # NVML is not even initialised


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="metrics interval"):
        MetricsOptions("127.0.0.1", 8002, interval_ms=0)
