"""The metrics port's HTTP server on a real socket: what it samples follows its options.

NVML needs an NVIDIA GPU, so the GPU sampler is replaced by a stand-in that reports one GPU;
the CPU figures come from this machine's /proc, through a sampler that counts its samples.
"""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.request
from collections.abc import Callable

import pytest

from rayinfer.deployments import metrics_endpoint
from rayinfer.deployments.metrics_endpoint import MetricsEndpoint
from rayinfer.protocol.host_figures import CpuFigures, CpuSampler, GpuFigures
from rayinfer.protocol.metrics import MetricsOptions, render
from waiting import wait_until_async


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


class CountedCpu(CpuSampler):
    """This machine's CPU sampler, counting its samples."""

    instances: list[CountedCpu] = []

    def __init__(self) -> None:
        super().__init__()
        self.samples = 0
        CountedCpu.instances.append(self)

    def sample(self) -> CpuFigures | None:
        self.samples += 1
        return super().sample()


@pytest.fixture(autouse=True)
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> type[OneGpu]:
    OneGpu.instances.clear()
    CountedCpu.instances.clear()
    monkeypatch.setattr(metrics_endpoint, "GpuSampler", OneGpu)
    monkeypatch.setattr(metrics_endpoint, "CpuSampler", CountedCpu)
    return OneGpu


def _accepts_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
    except OSError:
        return False
    return True


def _sampled_again(samplers: list[CountedCpu | OneGpu]) -> Callable[[], bool]:
    """A condition: every one of ``samplers`` has sampled since this call."""
    marks = [sampler.samples for sampler in samplers]
    return lambda: all(sampler.samples > mark for sampler, mark in zip(samplers, marks))


async def _scrapes(options: MetricsOptions, count: int) -> tuple[list[str], list[CpuFigures | None], float]:
    """``count`` scrapes, each after every sampler in use sampled again; the texts, the CPU
    figures each render was given, and the seconds from creating the endpoint to its end."""
    seen: list[CpuFigures | None] = []

    async def render_text(cpu: CpuFigures | None, gpus: tuple[GpuFigures, ...]) -> str:
        seen.append(cpu)
        return render([], cpu, gpus)

    started = time.monotonic()
    endpoint = MetricsEndpoint(render_text, options)
    samplers = [*CountedCpu.instances, *OneGpu.instances]  # those the options allow
    endpoint.start()
    texts = []
    try:
        url = f"http://127.0.0.1:{endpoint.port}/metrics"
        await wait_until_async(lambda: _accepts_connections(endpoint.port), "uvicorn to listen", interval_s=0.01)
        for _ in range(count):
            await wait_until_async(_sampled_again(samplers), "every sampler's next sample")
            texts.append(await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode()))
    finally:
        endpoint.stop()
        this = asyncio.current_task()
        await wait_until_async(lambda: asyncio.all_tasks() == {this},
                               "the endpoint's server and sampling tasks to end (uvicorn closes its socket)")
    return texts, seen, time.monotonic() - started


def test_figures_are_sampled_every_interval() -> None:
    texts, seen, elapsed_s = asyncio.run(_scrapes(MetricsOptions("127.0.0.1", 0, interval_ms=50), 3))
    assert all("# TYPE nv_cpu_utilization gauge" in text and 'nv_gpu_utilization{gpu_uuid="GPU-0"}' in text
               for text in texts)
    assert all(cpu is not None for cpu in seen)
    assert len({id(cpu) for cpu in seen}) == 3  # each scrape came after a new CPU sample
    gpu = OneGpu.instances[0]
    # One sample at start, then one per scrape at least; and never more often than every 50 ms
    # (a loaded machine only makes timers late, so this bound cannot fail on a slow run).
    assert 1 + 3 <= gpu.samples <= 2 + elapsed_s / 0.05
    assert gpu.closed


@pytest.mark.parametrize("cpu, gpu", [(False, True), (True, False), (False, False)])
def test_allow_cpu_and_gpu_metrics_leave_their_families_out(cpu: bool, gpu: bool) -> None:
    texts, seen, _ = asyncio.run(_scrapes(MetricsOptions("127.0.0.1", 0, interval_ms=50, cpu=cpu, gpu=gpu), 2))
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


def test_connections_past_the_bound_are_refused_and_scrapes_go_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients that open connections and send nothing hold at most METRICS_MAX_CONNECTIONS; one
    more is answered 503 at once, and a scrape works again once they are gone."""
    monkeypatch.setattr(metrics_endpoint, "METRICS_MAX_CONNECTIONS", 4)

    async def main() -> tuple[bytes, str]:
        async def render_text(cpu: CpuFigures | None, gpus: tuple[GpuFigures, ...]) -> str:
            return render([], cpu, gpus)

        endpoint = MetricsEndpoint(render_text, MetricsOptions("127.0.0.1", 0, 100, True, False))
        endpoint.start()
        idle: list[socket.socket] = []
        try:
            await wait_until_async(lambda: _accepts_connections(endpoint.port), "uvicorn to listen", interval_s=0.01)
            idle = [socket.create_connection(("127.0.0.1", endpoint.port), timeout=5) for _ in range(4)]
            await wait_until_async(lambda: len(endpoint._server.server_state.connections) == 4,
                                   "uvicorn to hold the four idle connections", interval_s=0.01)

            def refused() -> bytes:
                with socket.create_connection(("127.0.0.1", endpoint.port), timeout=5) as extra:
                    extra.sendall(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
                    return extra.recv(1 << 16)

            answer = await asyncio.to_thread(refused)
            for sock in idle:
                sock.close()
            idle = []
            url = f"http://127.0.0.1:{endpoint.port}/metrics"
            await wait_until_async(lambda: not endpoint._server.server_state.connections,
                                   "uvicorn to drop the closed connections", interval_s=0.01)
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
            return answer, text
        finally:
            for sock in idle:
                sock.close()
            endpoint.stop()
            this = asyncio.current_task()
            await wait_until_async(lambda: asyncio.all_tasks() == {this}, "the endpoint's tasks to end")

    answer, text = asyncio.run(main())
    assert answer.startswith(b"HTTP/1.1 503")
    assert "nv_cpu_utilization" in text
