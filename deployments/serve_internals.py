"""Every use rayinfer makes of Ray Serve's (and Ray's) private API, in one place, for the one Ray version it
is written against (:data:`RAY_VERSION`, pinned in pyproject.toml). :func:`ray_version_problem`
is checked as the CLI starts and as the ``/v2`` application is built, and says what to do.

- :func:`serve_client` and :func:`serve_details`: Serve's controller client
  (``ray.serve.context._get_global_client``), for the controller's details (application and
  replica states) and its handle cache.
- :func:`delete_application`: ``serve.delete`` without waiting (its private ``_blocking``).
- :func:`new_handle`: a deployment handle of the caller's own (``DeploymentHandle``'s
  constructor), which routes on the event loop it is first used on.
- :func:`replica_id`: the unique id of the replica the code runs in.
- :func:`publish_multiplexed_models`: the model ids a replica holds, for Serve's routing of
  handle calls that carry a multiplexed model id (what ``@serve.multiplexed`` reports).
- :func:`kv_get` and :func:`kv_put`: Ray's key-value store in the GCS (``internal_kv``).
- :func:`pending_resource_shapes`: the resources of the tasks and actors waiting for resources
  the cluster does not have free (the GCS's pending demand, as ``ray status`` shows it, read
  with ``ray.autoscaler.v2.sdk.get_cluster_status``).
- :func:`actor_death`: why an actor died, as Ray's GCS recorded it (a call of ``__ray_ready__``,
  the method Ray gives every actor).
- :func:`with_code_version`: a deployment's code version (``options(version=..., _internal=True)``).
- :func:`stop_orphaned_serve_haproxy`: Serve's HAProxy processes left behind by a Ray node that
  is gone (Serve starts them without tying them to its proxy's life).
- :func:`reuse_replica_classes`: Serve's controller callback, below.

One Ray actor class per Serve replica name in Serve's controller, reused by every deployment.
Ray Serve's controller builds the Ray actor class of a deployment's replicas
(``ServeReplica:<app>:<deployment>``, Serve's ``ReplicaActor`` under that name) each time it
creates the deployment's info: every deploy, so every model load. Each class gets a new function
id, and Ray keeps every class a process has seen for the life of the process: the controller
keeps the class it built and its method metadata, and each process that takes a handle to one of
its replicas (Serve's proxy, the controller again when it stops one) loads the class from GCS
and keeps that copy too. A model unloaded and loaded 40 times left 40 classes in each, about
0.25 MiB per load with GCS's copies (docs/dev/benchmark-log.md, "Reload churn").

Serve calls :func:`reuse_replica_classes` in its controller as it starts, being named by
``RAY_SERVE_CONTROLLER_CALLBACK_IMPORT_PATH`` (rayinfer's Ray environment). From then on the
controller builds the class of a replica name once and gives it to every later deployment of
that name: the classes are the same but for their identity (what differs between two deployments
reaches the replica through its constructor and the actor's options), so the function id stays
and no process loads the class again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from typing import Any

logger = logging.getLogger(__name__)

RAY_VERSION = "2.60.0"
_SERVE_HAPROXY_CONFIG = "/tmp/haproxy-serve/haproxy.cfg"  # Serve's default RAY_SERVE_HAPROXY_CONFIG_FILE_LOC


def ray_version_problem() -> str | None:
    """What is wrong with the installed Ray for rayinfer, or None."""
    import ray

    if ray.__version__ == RAY_VERSION:
        return None
    return (f"rayinfer needs Ray {RAY_VERSION} (found {ray.__version__}): it uses Ray Serve internals "
            f"(rayinfer.deployments.serve_internals) written for that version. Install it with "
            f"pip install 'ray[serve]=={RAY_VERSION}' on every node.")


def serve_client(required: bool = True) -> Any:
    """Serve's controller client of this process; None when Serve has not started (and not ``required``)."""
    from ray.serve.context import _get_global_client

    return _get_global_client(raise_if_no_controller_running=required)


def serve_details() -> dict[str, Any] | None:
    """Serve's details (``serve status`` as a dict: applications, deployments, replicas) from
    its controller; None when Serve has not started."""
    client = serve_client(required=False)
    return None if client is None else client.get_serve_details()


def delete_application(name: str, wait: bool) -> None:
    """Delete a Serve application; ``wait``: until it is gone."""
    from ray import serve

    serve.delete(name, _blocking=wait)


def new_handle(app: str, deployment: str) -> Any:
    """A handle to ``deployment`` of ``app`` that is the caller's own: it routes on the event loop
    it is first used on (``serve.get_deployment_handle`` gives a replica its shared handle, which
    routes on the replica's loop)."""
    from ray.serve.handle import DeploymentHandle

    return DeploymentHandle(deployment, app)


def replica_id(context: Any) -> str:
    """The unique id of the replica of ``context`` (``serve.get_replica_context()``)."""
    return str(context.replica_id.unique_id)


def publish_multiplexed_models(context: Any, model_ids: list[str]) -> None:
    """Tell Serve's controller which multiplexed model ids the replica of ``context`` holds, so
    that Serve's router sends a handle call with one of them to a replica that holds it first
    (as ``@serve.multiplexed`` does for the models it loaded; not blocking)."""
    from ray.serve._private.common import RequestRoutingInfo
    from ray.serve.context import _get_global_client

    _get_global_client().record_request_routing_info(
        RequestRoutingInfo(replica_id=context.replica_id, multiplexed_model_ids=list(model_ids)))


def kv_get(key: bytes, namespace: str) -> bytes | None:
    """A value of Ray's key-value store (blocking: a GCS round trip; Ray must be connected)."""
    from ray.experimental.internal_kv import _internal_kv_get

    return _internal_kv_get(key, namespace=namespace)


def kv_put(key: bytes, value: bytes, namespace: str, overwrite: bool = True) -> None:
    """Store a value in Ray's key-value store (``overwrite`` False: keep one already there)."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key, value, overwrite=overwrite, namespace=namespace)


def kv_keys(prefix: bytes, namespace: str) -> list[bytes]:
    """The keys of Ray's key-value store that start with ``prefix`` (blocking: a GCS round trip)."""
    from ray.experimental.internal_kv import _internal_kv_list

    return list(_internal_kv_list(prefix, namespace=namespace))


def kv_delete(key: bytes, namespace: str) -> None:
    """Remove a value from Ray's key-value store (none there: nothing happens)."""
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(key, namespace=namespace)


def pending_resource_shapes(timeout_s: int = 2) -> list[tuple[dict[str, float], int]]:
    """The resource shapes ({resource: amount}) of the tasks and actors that wait for resources
    the cluster does not have free, each with how many wait (a GCS round trip, about 3 ms; Ray
    must be connected; raises when the GCS does not answer within ``timeout_s``). An actor whose
    resources were granted and whose worker is starting is not among them."""
    import ray
    from ray.autoscaler.v2.sdk import get_cluster_status

    status = get_cluster_status(ray.get_runtime_context().gcs_address, timeout=timeout_s)
    return [({name: float(amount) for name, amount in request.bundle.items() if amount}, int(request.count))
            for demand in status.resource_demands.ray_task_actor_demand
            for request in demand.bundles_by_count if request.count > 0]


async def actor_death(actor: Any, timeout_s: float) -> str | None:
    """Why ``actor`` (a Ray actor handle) died, as Ray recorded it: its exit type and detail (a
    signal, an exit code, a raised exception, the memory monitor). None while it answers; a
    message saying so when it does not answer within ``timeout_s``."""
    import asyncio

    import ray

    try:
        await asyncio.wait_for(actor.__ray_ready__.remote(), timeout_s)
    except ray.exceptions.RayActorError as exc:
        return " ".join(str(exc).split())
    except asyncio.TimeoutError:
        return f"it did not answer Ray within {timeout_s:g} s (it hangs, or Ray cannot reach its node)"
    return None


async def shutdown_cached_handles() -> None:
    """Shut down the deployment handles Serve cached in this process (their routers' loops)."""
    await serve_client().shutdown_cached_handles_async()


def stop_orphaned_serve_haproxy(wait_s: float = 5.0) -> list[int]:
    """Stop the HAProxy processes Serve's proxies started (``haproxy -f <Serve's HAProxy config
    folder>/<node>/haproxy.cfg``) whose proxy is gone, in this network namespace; their PIDs.
    After ``ray stop --force`` they keep Serve's ports (9000, 9001, 8404, ...), and the next
    Serve on the machine cannot start. A HAProxy whose parent is a live Ray process, or that runs
    as another user, is left alone."""
    folder = os.path.dirname(os.environ.get("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", _SERVE_HAPROXY_CONFIG))
    own_netns = _netns("self")
    stopped = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        argv = _cmdline(pid)
        if not argv or not argv[0].endswith(b"haproxy") or b"-f" not in argv[:-1]:
            continue
        config = argv[argv.index(b"-f") + 1].decode(errors="replace")
        if not config.startswith(folder + os.sep) or _netns(str(pid)) != own_netns or not _ours(pid):
            continue
        parent = _cmdline(_parent(pid))
        if parent and parent[0].startswith(b"ray::"):
            continue  # its proxy (a Ray actor) runs
        logger.warning("stopping Serve's HAProxy (pid %d, %s) left by a Ray node that is gone", pid, config)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
        stopped.append(pid)
    deadline = time.monotonic() + wait_s
    for pid in stopped:
        while _cmdline(pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # not our child: no wait() to block on, so its exit is polled (once, at start)
        if _cmdline(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    return stopped


def _ours(pid: int) -> bool:
    """Whether a process runs as this process's user (another user's is never signalled)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def _cmdline(pid: int) -> list[bytes]:
    """A live process's arguments ([] when it is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            if stat.read().rpartition(b")")[2].split()[0] == b"Z":
                return []
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().split(b"\0")[:-1]
    except (OSError, IndexError):
        return []


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rpartition(b")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _netns(pid: str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return ""


def with_code_version(deployment: Any, version: str) -> Any:
    """``deployment`` with code ``version``: Serve reconfigures, not restarts, its replicas
    when only their user_config changes (``version`` left Serve's public options)."""
    return deployment.options(version=version, _internal=True)


def reuse_replica_classes() -> None:
    """Make Serve's deployment info give every deployment of a replica name the same actor class."""
    from ray.serve._private.deployment_info import DeploymentInfo

    build = DeploymentInfo.__dict__.get("actor_def")
    if not isinstance(build, property) or build.fget is None:
        logger.warning("this Ray Serve builds replica classes in an unknown way: each deployment keeps its own")
        return
    if getattr(build.fget, "reuses_replica_classes", False):
        return
    classes: dict[str, Any] = {}

    def actor_def(info: DeploymentInfo) -> Any:
        shared = classes.get(info.actor_name)
        if shared is None:
            shared = classes[info.actor_name] = build.fget(info)
        return shared

    actor_def.reuses_replica_classes = True  # type: ignore[attr-defined]  # marks the installed getter
    DeploymentInfo.actor_def = property(actor_def, doc=build.__doc__)
