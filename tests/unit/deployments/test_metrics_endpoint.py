"""The metrics port's HTTP server on a real socket: what it samples follows its options."""

from __future__ import annotations

import asyncio
import urllib.request

from rayinfer.deployments.metrics_endpoint import MetricsEndpoint
from rayinfer.protocol.metrics import CpuFigures, GpuFigures, MetricsOptions, render


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
        await asyncio.sleep(0.2)  # uvicorn closes its socket
    return texts, seen


def test_cpu_figures_are_sampled_every_interval() -> None:
    texts, seen = asyncio.run(_scrapes(MetricsOptions("127.0.0.1", 0, interval_ms=50), 3, 0.2))
    assert all("# TYPE nv_cpu_utilization gauge" in text for text in texts)
    assert all(cpu is not None for cpu in seen)
    assert len({id(cpu) for cpu in seen}) == 3  # a new sample between scrapes 200 ms apart


def test_allow_cpu_metrics_false_leaves_the_cpu_families_out() -> None:
    texts, seen = asyncio.run(_scrapes(MetricsOptions("127.0.0.1", 0, cpu=False, gpu=False), 2, 0.1))
    assert seen == [None, None]
    assert not any("nv_cpu_" in text or "nv_gpu_" in text for text in texts)
