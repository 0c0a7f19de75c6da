"""An ensemble replica's view of its members: their routes, specs, readiness, and the step calls.

A step's request goes to the listener of a replica of the member version, as the front sends a
client's request there (the v2 binary tensor extension over a kept HTTP/1.1 connection: one
process hop; a Ray handle call costs about 5 ms here), or by deployment handle
(``ModelDeployment.bls_infer``, numpy arrays in Ray's serialization) when the member has no
listener registered. Either way it takes that model's own path (validation, batcher,
statistics): the member an ensemble reaches is the deployment clients reach. The ``/v2`` replica
names the application serving each member and its replicas' listeners; both are kept for a
second. Calls run on the replica's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import ray
from google.protobuf import json_format
from ray import serve

from rayinfer.deployments.model_handles import model_handle
from rayinfer.deployments.names import SERVER_APP, SERVER_DEPLOYMENT
from rayinfer.deployments.steps_in_place import InPlaceMembers
from rayinfer.protocol.errors import ModelConfigError, ServingError, UnavailableError, as_serving_error
from rayinfer.protocol.listener_client import ListenerClient
from rayinfer.protocol.types import InferRequest, InferResponse
from rayinfer.repository.ensemble import check_members, decoupled_members, parse_ensemble
from rayinfer.repository.model_config import CONFIG_FILENAME, ModelConfig, ModelSpec, spec_from_config
from rayinfer.repository.scanner import scan_model
from rayinfer.serving.ensemble import EnsembleExecutor
from rayinfer.transport.router import Replica, VersionSplit, choose_replica, choose_version

logger = logging.getLogger(__name__)

_ROUTE_TTL_S = 1.0
# How long a loading ensemble waits for a member that is still loading (a Serve config deploys
# all applications at once; ``rayinfer serve`` deploys members first).
MEMBER_WAIT_S = 120.0


class EnsembleMembers:
    """Routes and calls an ensemble's members from its replica."""

    def __init__(self, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        """``headers``: sent with each step to a member's listener (a restricted group's header)."""
        self._host = ray.util.get_node_ip_address() if ray.is_initialized() else ""  # listeners' host on this node
        self._routes: dict[tuple[str, str], tuple[float, tuple[str, str] | None]] = {}
        # (model, version) -> (when read, (application, deployment), its replicas' listeners)
        self._targets: dict[tuple[str, str], tuple[float, tuple[str, str], list[tuple[str, int]]]] = {}
        self._replicas: dict[tuple[str, str], list[Replica]] = {}  # the same listeners, as the router takes them
        self._handles: dict[tuple[str, str], Any] = {}
        # model -> (when read, its rollout's split of version-less steps, or None)
        self._splits: dict[str, tuple[float, VersionSplit | None]] = {}
        self._server: Any = None
        self._client = ListenerClient(headers)
        # The members this replica runs itself (parameter steps_in_place), when it does.
        self.in_place: InPlaceMembers | None = None

    async def call(self, request: InferRequest) -> InferResponse:
        """One step: the member's response, or its error (raised). It goes to a replica's listener
        (one hop, as a client's request from the front), or by handle when none is registered."""
        key = (request.model_name, request.model_version or await self._split_version(request.model_name))
        target = self._targets.get(key)
        if target is None or time.monotonic() - target[0] >= _ROUTE_TTL_S:
            app, deployment, listeners = await self._server_handle().member_listeners.remote(*key)
            target = self._targets[key] = (time.monotonic(), (app, deployment), [tuple(a) for a in listeners])
            # The router's view of them, built once per read: on this node when their host is this node's.
            self._replicas[key] = [Replica(a, node=a[0]) for a in target[2]]
            if self.in_place is not None:
                self.in_place.observe(key, target[1], target[2])
        if self.in_place is not None:
            response = await self.in_place.infer(key, request)
            if response is not None:
                return response
        if target[2]:
            # By the router's rules: a replica on this node first (no load is known here).
            address = choose_replica(self._replicas[key], node=self._host).key  # type: ignore[union-attr]
            try:
                return await self._client.infer(address, request)
            except UnavailableError as exc:  # the replica went away: by handle, routes read again
                logger.info("step to '%s' by handle: %s", request.model_name, exc.message)
                self._client.forget(address)
                self._targets.pop(key, None)
        return await self._handle(target[1]).bls_infer.remote(request)

    async def _split_version(self, model: str) -> str:
        """The version a version-less step to ``model`` goes to: one picked by its rollout's
        split, or "" (the model's default)."""
        cached = self._splits.get(model)
        if cached is None or time.monotonic() - cached[0] >= _ROUTE_TTL_S:
            _, split = await self._server_handle().model_routes.remote(model, "")
            cached = self._splits[model] = (time.monotonic(), split[0] if split is not None else None)
        return choose_version("", cached[1], "")

    async def stream(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        """A step to a decoupled member, by streaming handle: its responses as they come."""
        route = await self._route(request.model_name, request.model_version, strict=True)
        assert route is not None
        async for result in self._handle(route).options(stream=True).bls_stream.remote(request):
            if isinstance(result, ServingError):
                raise result
            if result is not None:  # None ends every stream (ModelDeployment.bls_stream)
                yield result

    async def ready(self, model: str, version: str) -> bool:
        """Whether the member version is served and says it is ready."""
        try:
            route = await self._route(model, version, strict=False)
            return route is not None and bool(await self._handle(route).model_ready.remote())
        except Exception as exc:  # a replica going away: not ready now
            logger.debug("member '%s' is not ready: %s", model, exc)
            return False

    async def spec(self, model: str, version: str, deadline: float, repository: Path = Path()) -> ModelSpec:
        """The member's spec as its replica completed it (auto-complete included), waiting until
        ``deadline`` for a member that is still loading; Triton's error if it is not served.
        ``repository``: where the member's folder is (its files, a sequence model's initial state
        for one, are read from there)."""
        while (route := await self._server_handle().member_route.remote(model, version)) is None:
            if time.monotonic() >= deadline:
                raise ModelConfigError(f"model '{model}' is still loading")
            await asyncio.sleep(0.5)  # the poll interval: Serve tells of a member's start only by its status
        config = ModelConfig()
        json_format.Parse(await self.config_json(tuple(route)), config)
        return spec_from_config(config, repository / model / CONFIG_FILENAME)

    async def config_json(self, route: tuple[str, str]) -> str:
        """A member version's config as its replicas serve it, in Triton's JSON form."""
        return await self._handle(route).model_config_json.remote()

    async def run_in_place(self, repository: Path, specs: dict[tuple[str, str], ModelSpec],
                           batched: bool = False) -> None:
        """Load here the members that can run in this replica (parameter steps_in_place);
        ``batched``: the ensemble batches its own requests (its steps run at once)."""
        self.in_place = InPlaceMembers(repository, self.config_json, batched)
        for key, spec in specs.items():
            app, deployment, listeners = await self._server_handle().member_listeners.remote(*key)
            await self.in_place.load(key, (app, deployment), [tuple(a) for a in listeners], spec)

    def close(self) -> None:
        """The replica stops: unload the members running here."""
        if self.in_place is not None:
            self.in_place.close()

    async def _route(self, model: str, version: str, *, strict: bool) -> tuple[str, str] | None:
        key = (model, version)
        cached = self._routes.get(key)
        if cached is not None and cached[1] is not None and time.monotonic() - cached[0] < _ROUTE_TTL_S:
            return cached[1]
        route = await self._server_handle().model_route.remote(model, version, strict)
        self._routes[key] = (time.monotonic(), tuple(route) if route is not None else None)
        return self._routes[key][1]

    def _handle(self, route: tuple[str, str]) -> Any:
        handle = self._handles.get(route)
        if handle is None:
            handle = self._handles[route] = model_handle(route)
        return handle

    def _server_handle(self) -> Any:
        if self._server is None:
            self._server = serve.get_deployment_handle(SERVER_DEPLOYMENT, SERVER_APP)
        return self._server


async def load_ensemble(repository: Path, model_name: str, version: int, config_override: str | None,
                        members: EnsembleMembers, wait_s: float = MEMBER_WAIT_S) -> tuple[EnsembleExecutor, Any]:
    """The executor of an ensemble version, its steps checked against its members' configs;
    :class:`ModelConfigError` naming the step when a member is missing or does not fit."""
    model_dir = Path(repository) / model_name
    entry = scan_model(model_dir, config_override)
    if entry.error is not None or entry.config is None:
        raise ModelConfigError(entry.error or f"{model_dir}: cannot be read")
    spec = spec_from_config(entry.config, model_dir / CONFIG_FILENAME)
    plan = parse_ensemble(entry.config, model_dir)
    deadline = time.monotonic() + wait_s
    specs: dict[tuple[str, str], ModelSpec] = {}
    for step in plan.steps:
        key = (step.model_name, step.model_version)
        if key in specs:
            continue
        try:
            specs[key] = await members.spec(*key, deadline, Path(repository))
        except Exception as exc:
            raise ModelConfigError(
                f"ensemble '{model_name}': {step.label} cannot run: {as_serving_error(exc).message}"
            ) from None
    check_members(plan, spec, specs, model_dir)
    decoupled = decoupled_members(specs)
    if decoupled:  # it streams its members' responses: decoupled itself, as its config reports
        spec.config.model_transaction_policy.decoupled = True
    executor = EnsembleExecutor(spec, plan, version, members.call, members.ready, members.stream, decoupled)
    if plan.steps_in_place:
        await members.run_in_place(Path(repository), specs, batched=executor.batch_delay_s is not None)
    return executor, entry
