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
from rayinfer.protocol.host_figures import CpuFigures, CpuSampler, GpuFigures, GpuSampler
from rayinfer.protocol.metrics import MetricsOptions

logger = logging.getLogger(__name__)

_TEXT = (b"content-type", b"text/plain; charset=utf-8")
# What the metrics port holds for its scrapers (uvicorn's limit_concurrency and keep-alive timeout).
METRICS_MAX_CONNECTIONS = 64
METRICS_KEEPALIVE_S = 5


class MetricsEndpoint:
    """Serves ``render()`` on the options' address and port; CPU and GPU figures (those the
    options allow) are sampled every ``interval_ms``."""

    def __init__(self, render: Callable[[CpuFigures | None, tuple[GpuFigures, ...]], Awaitable[str]],
                 options: MetricsOptions) -> None:
        address, port = options.address, options.port
        self._render = render
        self._interval_s = options.interval_ms / 1000
        self._sampler = CpuSampler() if options.cpu else None
        self._cpu = self._sampler.sample() if self._sampler is not None else None
        gpus = GpuSampler() if options.gpu else None
        if gpus is not None and not gpus.device_count:  # no NVML or no GPU: nothing to sample
            gpus.close()
            gpus = None
        self._gpu_sampler = gpus
        self._gpus = gpus.sample() if gpus is not None else ()
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

    @property
    def port(self) -> int:
        """The port it listens on (the one asked for, or the one given for port 0)."""
        return int(self._sock.getsockname()[1])

    def start(self) -> None:
        import uvicorn

        # Bounded as the other ports are: at most METRICS_MAX_CONNECTIONS connections (one more
        # is answered 503 and closed), idle ones closed after METRICS_KEEPALIVE_S.
        config = uvicorn.Config(asgi.asgi3(self._asgi), lifespan="off", access_log=False, log_config=None,
                                log_level="warning", limit_concurrency=METRICS_MAX_CONNECTIONS,
                                timeout_keep_alive=METRICS_KEEPALIVE_S)
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
        gpus = self._gpu_sampler
        if self._sampler is None and gpus is None:
            return  # nothing to sample
        try:
            while True:
                await asyncio.sleep(self._interval_s)
                if self._sampler is not None:
                    self._cpu = self._sampler.sample()
                if gpus is not None:  # NVML calls block: off the loop
                    try:
                        self._gpus = await asyncio.to_thread(gpus.sample)
                    except Exception:  # keep the last figures, and keep sampling the CPU
                        logger.exception("sampling the GPUs failed")
        finally:
            if gpus is not None:
                gpus.close()

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
