"""ModelDeployment: one Serve deployment per model version.

Each replica decodes KServe v2 and gRPC inference requests, validates them, batches them in its
own dynamic batcher and runs the backend (on the event loop when executions are short, else on
the model's thread). Inference requests arrive from the front at the replica's own listener
(:mod:`replica_listener`), so a model request crosses no process boundary after HAProxy and
skips Serve's per-request machinery; the rest (metadata, readiness, config, statistics) arrives
through Serve's ingress.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from urllib.parse import unquote
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray
from ray import serve

from rayinfer.adapters.loader import load_runner
from rayinfer.adapters.model_runner import ModelRunner, PreparedRequest
from rayinfer.deployments import asgi, grpc_service
from rayinfer.deployments.batcher import DynamicBatcher
from rayinfer.deployments.names import SERVER_APP, SERVER_DEPLOYMENT
from rayinfer.deployments.replica_listener import ReplicaListener
from rayinfer.deployments.grpc_service import answer
from rayinfer.protocol.compression import compress_body, decompress_body, response_encoding
from google.protobuf.message import DecodeError

from rayinfer.protocol.errors import (
    InvalidArgError,
    NotFoundError,
    ServingError,
    UnsupportedError,
)
from rayinfer.protocol.grpc_codec import metadata_to_grpc, request_from_grpc, response_to_grpc, statistics_to_grpc
from rayinfer.protocol.http_codec import HEADER_LENGTH, error_response, request_from_http, response_to_http
from rayinfer.protocol.statistics import stats_to_json
from rayinfer.protocol.types import InferResponse
from rayinfer.repository.model_config import config_to_json
from tritonclient.grpc import service_pb2 as pb

logger = logging.getLogger(__name__)

_STATS_PUSH_INTERVAL_S = 0.5
# The replica's listener is registered with the ``/v2`` replica this often (which forgets
# a listener not registered again within a few intervals: a replica that died).
_LISTENER_REGISTER_INTERVAL_S = 2.0
# How long a replica being stopped waits for the calls its listener is answering.
_LISTENER_DRAIN_S = 10.0
# Executions that take less than this (moving average) run on the event loop itself: handing a
# short execution to a thread and back costs more than the execution (measured: 1,328 vs
# ~800 infer/s for the benchmark MLP at concurrency 8). Longer ones run on the model's thread
# so the loop keeps accepting requests.
INLINE_EXECUTION_LIMIT_S = 0.002
_OCTET = (b"content-type", b"application/octet-stream")
_JSON = (b"content-type", b"application/json")


_HEADER_LENGTH = HEADER_LENGTH.encode()
# Request headers an infer request's answer depends on.
_INFER_HEADERS = frozenset({b"content-encoding", b"accept-encoding", _HEADER_LENGTH})


def _text(value: bytes | None) -> str | None:
    return value.decode("latin-1") if value is not None else None


@serve.deployment(name="ModelDeployment")
@serve.ingress()
class ModelDeployment:
    """Serves one version of one model over KServe v2 HTTP; keeps the model loaded per replica."""

    async def __init__(
        self,
        model_repository: str,
        model_name: str,
        version: int,
        auto_complete: bool = True,
        config_override: str | None = None,
    ):
        self._runner: ModelRunner
        self._runner, entry = await asyncio.to_thread(
            load_runner, Path(model_repository), model_name, int(version), auto_complete, config_override
        )
        spec = self._runner.spec
        self._name = model_name
        self._version = str(version)
        self._versions = [str(v) for v in entry.versions]
        self._config_json = config_to_json(spec.config)
        self._metadata = self._model_metadata()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{model_name}-v{version}")
        # Unknown until measured: the first executions run on the thread.
        self._execution_s_avg = float("inf")
        batching = spec.dynamic_batching
        self._batched = batching is not None and spec.max_batch_size > 0
        if self._batched:
            self._batcher = DynamicBatcher(
                self._execute,
                max_batch_size=spec.max_batch_size,
                max_queue_delay_s=batching.max_queue_delay_us / 1e6,
                preferred_batch_sizes=batching.preferred_batch_sizes,
            )
        context = serve.get_replica_context()
        self._replica_key = f"{context.app_name}/{context.replica_id.unique_id}"
        self._app_name = context.app_name
        self._stats_pushed_at: tuple[int, int, int] | None = None
        self._server: Any = None
        # Inference calls routed by the front (HTTP infer, gRPC model RPCs) arrive here as
        # HTTP/1.1, not through Serve's ingress.
        self._listener = ReplicaListener(self.grpc_forwarded, self._direct_http)
        host = ray.util.get_node_ip_address()
        self._listener_address = (host, await self._listener.start(host))
        self._stats_task = asyncio.get_running_loop().create_task(self._report_forever())
        # Everything loaded so far (framework modules, the model) lives as long as the replica:
        # keep it out of the collector's generations so a full collection stays short.
        gc.freeze()

    def __serve_build_asgi_app__(self) -> Any:
        return asgi.asgi3(self._asgi)

    # ---- HTTP -------------------------------------------------------------------------------

    async def _asgi(self, scope: asgi.Scope, receive: asgi.Receive, send: asgi.Send) -> None:
        if scope["type"] == "lifespan":
            await asgi.handle_lifespan(receive, send)
            return
        route = scope["path"][len(scope.get("root_path", "")):].rstrip("/")
        if route.startswith("/versions/"):
            version, _, rest = route[len("/versions/"):].partition("/")
            route = "/" + rest if rest else ""
            if version != self._version:
                await asgi.send_error(send, NotFoundError(
                    f"Request for unknown model: '{self._name}' version {version} is not found"
                ))
                return
        method = scope["method"]
        if route == "/infer" and method == "POST":
            await self._http_infer(scope, receive, send)
        elif method != "GET":
            await asgi.send_error(send, NotFoundError(f"Not Found: {method} {scope['path']}"))
        elif route == "":
            await asgi.send_json(send, 200, self._metadata)
        elif route == "/ready":
            await asgi.send_empty(send, 200)
        elif route == "/config":
            await asgi.send_json(send, 200, self._config_json)
        elif route == "/stats":
            await asgi.send_json(send, 200, {"model_stats": [await self._model_stats()]})
        else:
            await asgi.send_error(send, NotFoundError(f"Not Found: {method} {scope['path']}"))

    async def _http_infer(self, scope: asgi.Scope, receive: asgi.Receive, send: asgi.Send) -> None:
        headers = {k: v for k, v in scope["headers"] if k in _INFER_HEADERS}
        status, extra, payload = await self._infer_http(headers, await asgi.read_body(receive))
        await asgi.send_bytes(send, status, payload, extra)

    async def _direct_http(
        self, path: str, headers: dict[bytes, bytes], body: bytes
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """An infer request routed by the front to this replica's listener."""
        parts = path.split("/")  # "", "v2", "models", <model>, ["versions", <version>,] "infer"
        if len(parts) not in (5, 7) or parts[-1] != "infer":
            raise NotFoundError(f"Not Found: POST {path}")
        version = parts[5] if len(parts) == 7 else ""
        if unquote(parts[3]) != self._name or (version and version != self._version):
            named = f"'{unquote(parts[3])}'" + (f" version {version}" if version else "")
            raise NotFoundError(f"Request for unknown model: {named} is not found")
        return await self._infer_http(headers, body)

    async def _infer_http(
        self, headers: dict[bytes, bytes], body: bytes
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """A v2 infer request's response: (status, headers, body), errors in Triton's form."""
        try:
            body = decompress_body(body, _text(headers.get(b"content-encoding")))
            raw_length = headers.get(_HEADER_LENGTH)
            try:
                header_length = int(raw_length) if raw_length is not None else None
            except ValueError:
                raise InvalidArgError(f"invalid Inference-Header-Content-Length '{raw_length.decode()}'") from None
            request = request_from_http(body, header_length, self._name, self._version)
            prepared = self._runner.prepare(request)
        except Exception as exc:  # rejected before it reached the model: not counted, as in Triton
            return error_response(exc)
        try:
            response = await self.infer(prepared)
            payload, json_length = response_to_http(response, request)
        except Exception as exc:  # execution failures are counted by the runner
            return error_response(exc)
        extra = [_JSON] if json_length is None else [_OCTET, (_HEADER_LENGTH, str(json_length).encode())]
        encoding = response_encoding(_text(headers.get(b"accept-encoding")))
        if encoding is not None:
            payload = compress_body(payload, encoding)
            extra.append((b"content-encoding", encoding.encode()))
        return 200, extra, payload

    # ---- gRPC (GRPCInferenceService) --------------------------------------------------------
    # The front relays the model RPCs it routes to the replica's listener (grpc_forwarded); the
    # ``/v2`` replica forwards what the front could not route (streams, compressed messages) by
    # handle; Serve's gRPC ingress calls these methods for calls addressed to this application.

    async def ModelInfer(self, request: pb.ModelInferRequest, grpc_context: Any = None) -> Any:
        return await answer(grpc_context, self.grpc_call("ModelInfer", request), pb.ModelInferResponse)

    async def ModelReady(self, request: pb.ModelReadyRequest, grpc_context: Any = None) -> Any:
        return await answer(grpc_context, self.grpc_call("ModelReady", request), pb.ModelReadyResponse)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, grpc_context: Any = None) -> Any:
        return await answer(grpc_context, self.grpc_call("ModelMetadata", request), pb.ModelMetadataResponse)

    async def ModelConfig(self, request: pb.ModelConfigRequest, grpc_context: Any = None) -> Any:
        return await answer(grpc_context, self.grpc_call("ModelConfig", request), pb.ModelConfigResponse)

    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, grpc_context: Any = None) -> Any:
        return await answer(grpc_context, self.grpc_call("ModelStatistics", request), pb.ModelStatisticsResponse)

    async def grpc_forwarded(self, method: str, payload: bytes) -> bytes:
        """``grpc_call`` for the ``/v2`` replica's forwarding: messages travel serialized (protobuf
        messages do not pickle); errors travel as ServingError. (This class is pickled by value:
        its methods may name modules, not module-level message tables.)"""
        messages = grpc_service.RPC_MESSAGES.get(method)
        if messages is None:
            raise UnsupportedError(f"unknown gRPC method '{method}' for model '{self._name}'")
        request_type, _ = messages
        try:
            request = request_type.FromString(payload)
        except DecodeError:
            raise InvalidArgError(f"malformed {method} request for model '{self._name}'") from None
        return (await self.grpc_call(method, request)).SerializeToString()

    async def grpc_call(self, method: str, request: Any) -> Any:
        """Answer one model RPC; raises ServingError (which the caller turns into a gRPC status)."""
        version = request.model_version if method == "ModelInfer" else request.version
        if version and version != self._version:
            raise NotFoundError(f"Request for unknown model: '{self._name}' version {version} is not found")
        if method == "ModelInfer":
            # A request rejected here never reaches the runner, so it is not counted (as in Triton).
            prepared = self._runner.prepare(request_from_grpc(request))
            return response_to_grpc(await self.infer(prepared))
        if method == "ModelReady":
            return pb.ModelReadyResponse(ready=True)
        if method == "ModelMetadata":
            return metadata_to_grpc(self._metadata)
        if method == "ModelConfig":
            return pb.ModelConfigResponse(config=self._runner.spec.config)
        if method == "ModelStatistics":
            return statistics_to_grpc([await self._model_stats()])
        raise NotFoundError(f"unknown RPC '{method}' for model '{self._name}'")

    # ---- inference --------------------------------------------------------------------------

    async def infer(self, prepared: PreparedRequest) -> InferResponse:
        """Run one validated request, through the dynamic batcher when the model has one."""
        if self._batched:
            result = await self._batcher.submit(prepared, prepared.rows)
        else:
            result = (await self._execute([prepared]))[0]
        if isinstance(result, ServingError):
            raise result
        return result

    async def _execute(self, batch: list[PreparedRequest]) -> list[InferResponse | ServingError]:
        """Execute on the loop when executions are known to be short, else on the model thread."""
        if self._execution_s_avg < INLINE_EXECUTION_LIMIT_S:
            results, elapsed = self._timed_execute(batch)
        else:
            loop = asyncio.get_running_loop()
            results, elapsed = await loop.run_in_executor(self._executor, self._timed_execute, batch)
        average = self._execution_s_avg
        self._execution_s_avg = elapsed if average == float("inf") else 0.8 * average + 0.2 * elapsed
        return results

    def _timed_execute(self, batch: list[PreparedRequest]) -> tuple[list[InferResponse | ServingError], float]:
        """The execution and its own duration: the hand-off to and from the model thread is not
        the model's time, and counting it would keep a busy loop from ever running inline."""
        start = time.perf_counter()
        results = self._runner.execute(batch)
        return results, time.perf_counter() - start

    # ---- metadata and statistics ------------------------------------------------------------

    def _model_metadata(self) -> dict[str, Any]:
        spec = self._runner.spec
        batch_dim = [-1] if spec.max_batch_size > 0 else []

        def tensors(specs: Any) -> list[dict[str, Any]]:
            return [{"name": t.name, "datatype": t.datatype, "shape": batch_dim + list(t.dims)} for t in specs]

        return {
            "name": self._name,
            "versions": self._versions,
            "platform": spec.platform or spec.backend,
            "inputs": tensors(spec.inputs),
            "outputs": tensors(spec.outputs),
        }

    async def _model_stats(self) -> dict[str, Any]:
        """This version's statistics summed over all replicas (via the server app when present)."""
        snapshot = self._snapshot()
        try:
            await self._push_stats(snapshot)
            merged = await self._server_handle().model_statistics.remote(self._name, self._version)
            if merged is not None:
                snapshot = merged
        except Exception as exc:  # the server app may be absent in a hand-written Serve config
            logger.debug("falling back to this replica's statistics: %s", exc)
        return stats_to_json(self._name, self._version, snapshot)

    def _server_handle(self) -> Any:
        """One handle to the ``/v2`` app for the replica's life: each new handle builds a router."""
        if self._server is None:
            self._server = serve.get_deployment_handle(SERVER_DEPLOYMENT, SERVER_APP)
        return self._server

    def _snapshot(self) -> dict[str, Any]:
        """This replica's statistics plus its requests waiting for execution (a gauge)."""
        snapshot = self._runner.stats.snapshot()
        snapshot["pending_request_count"] = self._batcher.pending_requests if self._batched else 0
        return snapshot

    @staticmethod
    def _change_key(snapshot: dict[str, Any]) -> tuple[int, int, int]:
        return (snapshot["execution_count"], snapshot["durations"]["fail"][0], snapshot["pending_request_count"])

    async def _push_stats(self, snapshot: dict[str, Any]) -> None:
        await self._server_handle().report_statistics.remote(self._replica_key, self._name, self._version, snapshot)
        self._stats_pushed_at = self._change_key(snapshot)

    async def _report_forever(self) -> None:
        """Register the listener every few seconds; push statistics when they changed."""
        registered_at = float("-inf")
        while True:
            if time.monotonic() - registered_at >= _LISTENER_REGISTER_INTERVAL_S:
                try:
                    await self._server_handle().register_listener.remote(
                        self._replica_key, self._app_name, *self._listener_address
                    )
                    registered_at = time.monotonic()
                except Exception as exc:  # the server app may not be deployed (yet)
                    logger.debug("could not register the listener: %s", exc)
            await asyncio.sleep(_STATS_PUSH_INTERVAL_S)
            snapshot = self._snapshot()
            if self._change_key(snapshot) == self._stats_pushed_at:
                continue
            try:
                await self._push_stats(snapshot)
            except Exception as exc:  # the server app may not be deployed (yet)
                logger.debug("could not publish statistics: %s", exc)

    async def __del__(self) -> None:
        """Serve stops the replica: out of the front's routes first, then drain."""
        task = getattr(self, "_stats_task", None)
        if task is not None:
            task.cancel()
        listener = getattr(self, "_listener", None)
        if listener is not None:
            try:
                await asyncio.wait_for(self._server_handle().withdraw_listener.remote(self._replica_key), 5.0)
            except Exception as exc:  # the /v2 app is gone too: nothing routes here any more
                logger.debug("could not withdraw the listener: %s", exc)
            await listener.close(_LISTENER_DRAIN_S)
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=False)
