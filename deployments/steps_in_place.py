"""An ensemble's steps run in the ensemble's own replica (parameter ``steps_in_place``).

A step sent to a member's replica costs a process hop each way: the request's encoding, a
socket write and read, the member's parse, a wake-up on each side; on small machines that is
more CPU than a small model's execution (docs/dev/benchmark-log.md, "Ensembles"). With
``steps_in_place: "true"`` in the ensemble's ``parameters``, the ensemble's replica loads its own
instance of each member that can run there, from the config the member's replicas serve, with
that member's own dynamic batcher (so the steps of many ensemble requests still batch), and
runs those steps in its process. When the ensemble batches its own requests
(``max_queue_delay_microseconds``), a step already carries the rows of the requests gathered at
the ensemble's entrance: it is executed at once, without a second wait in the member's batcher.
Its executions count in the member's statistics and metrics, beside those of the member's
replicas. Clients calling the member directly still reach the
member's replicas.

A member runs where it is when it cannot run here: an ensemble (nested), a decoupled or
sequence model, a model with a response cache, a model on GPUs, and every Python model after
the first (a replica process holds one Python model: ``pb_utils.get_model_dir``, its module
path and its custom metrics are the process's). The instance follows the member: while the
member is not served, the step fails as a remote step does; when every replica of the member
has been replaced (a reload, a new default version), the instance is loaded again from the
member's new config, and the steps go to the member's replicas meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from rayinfer.adapters.loader import load_runner
from rayinfer.deployments.names import POOL_DEPLOYMENT, deployment_version
from rayinfer.protocol.types import InferRequest, InferResponse
from rayinfer.repository.ensemble import is_ensemble
from rayinfer.repository.model_config import ModelSpec
from rayinfer.serving.model_core import ModelCore

logger = logging.getLogger(__name__)

# (model, version as the step names it)
MemberKey = tuple[str, str]
# (application, deployment) of a member version -> its served config in Triton's JSON form.
ConfigSource = Callable[[tuple[str, str]], Awaitable[str]]
_KIND_GPU = 1  # ModelInstanceGroup.KIND_GPU


@dataclass
class _Instance:
    core: ModelCore
    # The member replicas' listeners seen while this instance serves: when none of them is
    # left, the member was redeployed and this instance is loaded again.
    listeners: set[tuple[str, int]] = field(default_factory=set)
    in_flight: int = 0
    retired: bool = False


def reason_not_in_place(spec: ModelSpec, python_taken: bool) -> str | None:
    """Why a member cannot run in the ensemble's replica (None: it can)."""
    config = spec.config
    if is_ensemble(config):
        return "it is an ensemble"
    if config.model_transaction_policy.decoupled:
        return "it is decoupled"
    if spec.sequence_batching is not None:
        return "it is a sequence model"
    if config.response_cache.enable:
        return "it has a response cache"
    if any(group.kind == _KIND_GPU for group in config.instance_group):
        return "it runs on GPUs"
    if config.backend == "python" and python_taken:
        return "another Python member runs in place (a process holds one Python model)"
    return None


class InPlaceMembers:
    """The member instances an ensemble replica runs itself, by step target."""

    def __init__(self, repository: Path, config_source: ConfigSource, batched: bool = False) -> None:
        self._repository = repository
        self._config_source = config_source
        # The ensemble batches its own requests: a step's request is already a batch, executed
        # at once instead of waiting in the member's batcher too.
        self._batched = batched
        self._instances: dict[MemberKey, _Instance] = {}
        self._python: MemberKey | None = None  # the Python member running here, if any
        self._loading: dict[MemberKey, asyncio.Task] = {}

    async def load(self, key: MemberKey, route: tuple[str, str], listeners: list[tuple[str, int]],
                   spec: ModelSpec) -> None:
        """Load ``key``'s member here when it can run here; log why not otherwise (its steps
        then go to its replicas)."""
        reason = ("it is pooled (the model pool's replicas load it)" if route[1] == POOL_DEPLOYMENT
                  else reason_not_in_place(spec, self._python not in (None, key)))
        if reason is not None:
            logger.info("member '%s' does not run in place, its steps go to its replicas: %s", key[0], reason)
            return
        if await self._install(key, route, listeners) and spec.config.backend == "python":
            self._python = key

    async def _install(self, key: MemberKey, route: tuple[str, str], listeners: list[tuple[str, int]]) -> bool:
        """Load the member's instance here; False (logged) when it fails to load: the member's
        replicas serve its steps instead."""
        try:
            self._instances[key] = await self._instance(key, route, listeners)
            return True
        except Exception as exc:
            logger.warning("member '%s' could not be loaded in place, its steps go to its replicas: %s", key[0], exc)
            return False

    async def _instance(self, key: MemberKey, route: tuple[str, str], listeners: list[tuple[str, int]]) -> _Instance:
        app, deployment = route
        version = deployment_version(deployment)
        config_json = await self._config_source(route)
        runner, _ = await asyncio.to_thread(load_runner, self._repository, key[0], version, False, config_json, False)
        logger.info("member '%s' version %d runs in place (from application '%s')", key[0], version, app)
        return _Instance(ModelCore(runner, [version]), set(listeners))

    def observe(self, key: MemberKey, route: tuple[str, str], listeners: list[tuple[str, int]]) -> None:
        """The member's replicas as the ``/v2`` replica lists them now: when none of those this
        instance has seen is among them (a member reloaded, or not registered again yet), load the
        instance again in the background."""
        instance = self._instances.get(key)
        if instance is None:
            return
        current = set(listeners)
        if not instance.listeners or instance.listeners & current:
            instance.listeners |= current
            return
        self._retire(self._instances.pop(key))  # the member's replicas serve its steps meanwhile
        if key not in self._loading:
            self._loading[key] = asyncio.get_running_loop().create_task(self._reload(key, route, listeners))

    async def _reload(self, key: MemberKey, route: tuple[str, str], listeners: list[tuple[str, int]]) -> None:
        try:
            await self._install(key, route, listeners)
        finally:
            del self._loading[key]

    async def infer(self, key: MemberKey, request: InferRequest) -> InferResponse | None:
        """The step's response from the instance here (its error raised); None when the member
        has no instance here."""
        instance = self._instances.get(key)
        if instance is None:
            return None
        instance.in_flight += 1
        try:
            return await instance.core.infer(instance.core.prepare(request), batched=self._batched)
        finally:
            instance.in_flight -= 1
            if instance.retired and not instance.in_flight:
                self._close(instance.core)

    def _retire(self, instance: _Instance) -> None:
        instance.retired = True
        if not instance.in_flight:
            self._close(instance.core)

    @staticmethod
    def _close(core: ModelCore) -> None:
        """Unload off the event loop (a Python model's ``finalize`` may take its time)."""
        asyncio.get_running_loop().run_in_executor(None, core.close)

    def cores(self) -> list[ModelCore]:
        """The instances serving now (their statistics are reported as the member's)."""
        return [instance.core for instance in self._instances.values()]

    def close(self) -> None:
        """The replica stops: unload every instance."""
        for task in self._loading.values():
            task.cancel()
        for instance in self._instances.values():
            instance.core.close()
        self._instances.clear()
