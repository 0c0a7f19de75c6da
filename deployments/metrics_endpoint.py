"""Triton's metrics port: a small HTTP server inside the ``/v2`` replica, on its event loop.

Like Triton it answers every GET path (``/metrics`` by convention) with the Prometheus text
exposition. The figures come from the statistics that model replicas report to the ``/v2``
replica, so they are totals over all replicas and nodes of each model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from rayinfer.deployments import asgi
from rayinfer.protocol.errors import UnavailableError
from rayinfer.protocol.metrics import CpuFigures, CpuSampler, GpuFigures, GpuSampler

logger = logging.getLogger(__name__)

_TEXT = (b"content-type", b"text/plain; charset=utf-8")


class MetricsEndpoint:
    """Serves ``render()`` on ``address:port``; CPU and GPU figures are sampled every ``interval_s``."""

    def __init__(self, render: Callable[[CpuFigures | None, tuple[GpuFigures, ...]], Awaitable[str]],
                 address: str, port: int, interval_s: float = 2.0) -> None:
        self._render = render
        self._interval_s = interval_s
        self._sampler = CpuSampler()
        self._cpu = self._sampler.sample()
        self._gpu_sampler = GpuSampler()
        self._gpus = self._gpu_sampler.sample()
        self._sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((address, port))
        except OSError as exc:
            self._sock.close()
            raise UnavailableError(f"metrics port {address}:{port} is not available: {exc.strerror}") from None
        self._serving: asyncio.Task | None = None  # ends when the server's should_exit is set
        self._sampling: asyncio.Task | None = None
        self._server: Any = None

    def start(self) -> None:
        import uvicorn

        config = uvicorn.Config(asgi.asgi3(self._asgi), lifespan="off", access_log=False, log_config=None,
                                log_level="warning")
        server = uvicorn.Server(config)
        # The replica owns the process's signals; uvicorn must not take them over.
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        self._server = server
        self._serving = loop.create_task(server.serve(sockets=[self._sock]))
        self._sampling = loop.create_task(self._sample_forever())

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._sampling is not None:
            self._sampling.cancel()

    async def _sample_forever(self) -> None:
        try:
            while True:
                await asyncio.sleep(self._interval_s)
                self._cpu = self._sampler.sample()
                if self._gpu_sampler.device_count:  # NVML calls block: off the loop
                    try:
                        self._gpus = await asyncio.to_thread(self._gpu_sampler.sample)
                    except Exception:  # keep the last figures, and keep sampling the CPU
                        logger.exception("sampling the GPUs failed")
        finally:
            self._gpu_sampler.close()

    async def _asgi(self, scope: asgi.Scope, receive: asgi.Receive, send: asgi.Send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] not in ("GET", "HEAD"):
            await asgi.send_bytes(send, 405, b"Method Not Allowed", [_TEXT])
            return
        try:
            body = (await self._render(self._cpu, self._gpus)).encode()
        except Exception:  # a scrape must never take the replica down
            logger.exception("rendering metrics failed")
            await asgi.send_bytes(send, 500, b"metrics unavailable", [_TEXT])
            return
        await asgi.send_bytes(send, 200, body, [_TEXT])
