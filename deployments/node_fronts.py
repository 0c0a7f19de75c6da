"""A front on every node that runs model replicas (``--front-on-every-node``).

The ``/v2`` replica runs the front on its own node (:mod:`front`). With a front on every node it
also runs one, through a small Ray actor of no CPU (:class:`NodeFront`), on each other node
whose model replicas registered a listener: the same ports and settings, and the same routes
(every replica of the cluster), so that a client reaching any such node is answered, by a
replica on that node through the acceptor, or relayed to one on any node. What a node's front does
not route goes to Serve's ingress on that node, which Serve runs on every node with a replica
(``proxy_location: EveryNode``).

:class:`Fronts` is what the route table publishes to: the local front first, then each node's
front that routes (a node front that does not answer within a few seconds, or whose HAProxy has
exited, is stopped and started again after a back-off: :data:`RETRY_FIRST_S`, doubled on each
failure in a row up to :data:`RETRY_MAX_S`). Which nodes need a front is looked
at in the background after each publication; a new node front is given the routes published
while it started until it has the latest, and is published to with the others from then on. A node is found by its address: the host of
the listeners its replicas registered (Ray's node IP address). Nodes sharing one address (Ray
nodes started on one machine) would share their ports and get no front of their own.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)

# How long a node front has to start (HAProxy and its acceptor), and to take new routes.
START_TIMEOUT_S = 30.0
PUBLISH_TIMEOUT_S = 5.0
# After a node front failed, how long before it is started again on that node: the first time,
# then doubled for each failure in a row (a front that routes again starts the count afresh).
RETRY_FIRST_S = 2.0
RETRY_MAX_S = 60.0
# How often the cluster's nodes are read again (sooner when a replica's address is new).
_NODES_REFRESH_S = 10.0

Endpoint = tuple[str, int, str, int]


def node_endpoint(endpoint: Endpoint | None, own_ip: str, node_ip: str) -> Endpoint | None:
    """The front's ``endpoint`` (address, port, Serve's host, Serve's port) for another node:
    an address that is the ``/v2`` replica's node's own becomes that node's; a wildcard or
    loopback address is the same on every node."""
    if endpoint is None:
        return None
    address, port, serve_host, serve_port = endpoint
    return (node_ip if address == own_ip else address, port, node_ip if serve_host == own_ip else serve_host,
            serve_port)


def front_nodes(routes: dict[str, list[tuple[str, int]]], nodes: dict[str, list[str]], own_ip: str) -> dict[str, str]:
    """Node ID -> address of each node that needs a front: its replicas are in ``routes``, it is
    not the ``/v2`` replica's node, and it is the only live node at its address (``nodes``:
    address -> live node IDs)."""
    hosts = {host for listeners in routes.values() for host, _ in listeners}
    return {ids[0]: ip for ip, ids in nodes.items() if ip in hosts and ip != own_ip and len(ids) == 1}


class NodeFront:
    """Runs the front on the node it is placed on (a Ray actor of :class:`Fronts`)."""

    def __init__(self, http: Endpoint | None, grpc: Endpoint | None, own_ip: str, options: dict[str, Any]) -> None:
        import ray

        from rayinfer.deployments.front import Front
        from rayinfer.deployments.cluster_records import cluster_front_key

        node_ip = ray.util.get_node_ip_address()
        self._front = Front(node_endpoint(http, own_ip, node_ip), node_endpoint(grpc, own_ip, node_ip), **options,
                            front_key=cluster_front_key())

    async def publish(self, routes: dict[str, list[tuple[str, int]]], sequence_keys: frozenset[str],
                      splits: dict[str, tuple[int, str, str]] | None = None) -> bool:
        """Take ``routes`` and ``splits``; answers whether this node's front still runs."""
        await self._front.publish(routes, sequence_keys, splits)
        return self._front.running

    def stop(self) -> None:
        self._front.stop()


class Fronts:
    """The local front and a front on every other node with model replicas, published to as one
    (:class:`~rayinfer.deployments.route_table.RouteTable`'s front)."""

    def __init__(self, local: Any, http: Endpoint | None, grpc: Endpoint | None, options: dict[str, Any],
                 own_ip: str | None = None) -> None:
        """``own_ip``: this node's address (default: Ray's for this process)."""
        import ray

        self.local = local
        self._http, self._grpc, self._options = http, grpc, options
        self._own_ip = own_ip or ray.util.get_node_ip_address()
        for endpoint in (http, grpc):
            if endpoint is not None and (endpoint[0].startswith("127.") or endpoint[0] == "::1"):
                logger.warning("the front on every node binds %s: each node's front answers its own machine only "
                               "(use --http-address 0.0.0.0)", endpoint[0])
        self._actors: dict[str, Any] = {}  # node ID -> its NodeFront actor
        self._ready: set[str] = set()  # nodes whose front started and took its first routes
        self._starting: dict[str, asyncio.Task] = {}
        self._failed_at: dict[str, float] = {}
        self._failures: dict[str, int] = {}  # failures in a row, by node
        self._nodes: dict[str, list[str]] = {}
        self._nodes_read_at = float("-inf")
        self._placing: asyncio.Task | None = None

    @property
    def published(self) -> dict[str, list[tuple[str, int]]]:
        return self.local.published

    @property
    def sequence_keys(self) -> frozenset[str]:
        return self.local.sequence_keys

    @property
    def running(self) -> bool:
        return self.local.running

    async def use_v2_port(self, port: int) -> None:
        """The local front only: the ``/v2`` replica's loopback port is on its machine."""
        await self.local.use_v2_port(port)

    @property
    def splits(self) -> dict[str, tuple[int, str, str]]:
        return self.local.splits

    async def publish(self, routes: dict[str, list[tuple[str, int]]],
                      sequence_keys: frozenset[str] = frozenset(),
                      splits: dict[str, tuple[int, str, str]] | None = None) -> None:
        """The local front's routes first, then every routing node front's (each within
        :data:`PUBLISH_TIMEOUT_S`); which nodes need a front is looked at in the background
        (Ray's node list is not read under the route table's lock)."""
        await self.local.publish(routes, sequence_keys, splits)
        routes, sequence_keys, splits = self.local.published, self.local.sequence_keys, self.local.splits
        ready = list(self._ready)
        results = await asyncio.gather(*(self._publish_to(node, routes, sequence_keys, splits) for node in ready))
        for node, error in zip(ready, results):
            if error is not None:
                self._fail(node, error)
        if self._placing is None or self._placing.done():
            self._placing = asyncio.get_running_loop().create_task(self._place())

    async def _place(self) -> None:
        """Start a front on each node that newly needs one; stop those of nodes that do not."""
        try:
            routes = self.local.published
            wanted = front_nodes(routes, await self._live_nodes(routes), self._own_ip)
        except Exception:  # noqa: BLE001  # looked at again on the next publication
            logger.exception("could not place the node fronts")
            return
        for node in set(self._actors) - set(wanted):
            self._stop_node(node, "it runs no model replica now")
        now = time.monotonic()
        for node, ip in wanted.items():
            if node not in self._actors and now - self._failed_at.get(node, float("-inf")) >= self.retry_delay(node):
                try:
                    self._start_node(node, ip)
                except Exception:  # noqa: BLE001  # tried again after the back-off
                    logger.exception("could not start the front on node %s (%s)", node, ip)
                    self._failed_at[node] = now
                    self._failures[node] = self._failures.get(node, 0) + 1

    async def _publish_to(self, node: str, routes: dict[str, list[tuple[str, int]]], sequence_keys: frozenset[str],
                          splits: dict[str, tuple[int, str, str]], timeout_s: float = PUBLISH_TIMEOUT_S) -> str | None:
        """None once ``node``'s front took the routes, else why it did not."""
        try:
            running = await asyncio.wait_for(self._actors[node].publish.remote(routes, sequence_keys, splits), timeout_s)
        except Exception as exc:  # noqa: BLE001  # the actor died, its node left, or it hangs
            return f"{type(exc).__name__}: {exc}"
        return None if running else "its HAProxy has exited"

    def _start_node(self, node: str, ip: str) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._actors[node] = _actor_class().options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote(self._http, self._grpc, self._own_ip, self._options)
        logger.info("starting the front on node %s (%s)", node, ip)

        async def first_routes() -> None:
            # The routes published while it started, until it has the latest: it routes (is
            # published to with the others) only from then on.
            sent: tuple[dict[str, list[tuple[str, int]]], frozenset[str], dict[str, tuple[int, str, str]]] | None = None
            while (self.local.published, self.local.sequence_keys, self.local.splits) != sent:
                sent = (self.local.published, self.local.sequence_keys, self.local.splits)
                error = await self._publish_to(node, *sent, timeout_s=START_TIMEOUT_S)  # the start too
                if node not in self._starting:
                    return  # stopped meanwhile
                if error is not None:
                    self._starting.pop(node, None)
                    self._fail(node, error)
                    return
            self._starting.pop(node, None)
            self._ready.add(node)
            self._failures.pop(node, None)
            logger.info("the front on node %s (%s) routes", node, ip)

        self._starting[node] = asyncio.get_running_loop().create_task(first_routes())

    def _fail(self, node: str, error: str) -> None:
        if node not in self._actors:
            return
        self._failures[node] = self._failures.get(node, 0) + 1
        logger.warning("the front on node %s failed (%s); starting it again in %.0f s", node, error,
                       self.retry_delay(node))
        self._failed_at[node] = time.monotonic()
        self._stop_node(node, None)

    def retry_delay(self, node: str) -> float:
        """How long after its last failure ``node``'s front is started again."""
        failures = self._failures.get(node, 0)
        return 0.0 if not failures else min(RETRY_FIRST_S * 2 ** (failures - 1), RETRY_MAX_S)

    def _stop_node(self, node: str, why: str | None) -> None:
        if why is not None:
            logger.info("stopping the front on node %s: %s", node, why)
        actor = self._actors.pop(node, None)
        self._ready.discard(node)
        task = self._starting.pop(node, None)
        if task is not None:
            task.cancel()
        if actor is not None:
            actor.stop.remote()  # then its actor ends with this handle

    async def _live_nodes(self, routes: dict[str, list[tuple[str, int]]]) -> dict[str, list[str]]:
        """Address -> live node IDs, read again every :data:`_NODES_REFRESH_S` or for a new address."""
        hosts = {host for listeners in routes.values() for host, _ in listeners}
        if time.monotonic() - self._nodes_read_at >= _NODES_REFRESH_S or not hosts <= set(self._nodes):
            import ray

            try:
                listed = await asyncio.wait_for(asyncio.to_thread(ray.nodes), PUBLISH_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001  # the GCS is briefly unreachable: keep what we had
                logger.debug("could not list Ray's nodes: %s", exc)
                return self._nodes
            nodes: dict[str, list[str]] = {}
            for entry in listed:
                if entry.get("Alive"):
                    nodes.setdefault(entry["NodeManagerAddress"], []).append(entry["NodeID"])
            self._nodes, self._nodes_read_at = nodes, time.monotonic()
        return self._nodes

    def stop(self) -> None:
        """Stop every node's front (waiting up to 5 s for them), then the local one."""
        import ray

        for task in (self._placing, *self._starting.values()):
            if task is not None:
                task.cancel()
        self._starting.clear()
        self._ready.clear()
        refs = []
        for node in list(self._actors):
            actor = self._actors.pop(node)
            refs.append(actor.stop.remote())
        if refs and ray.is_initialized():
            try:
                ray.wait(refs, num_returns=len(refs), timeout=5.0)
            except Exception:  # noqa: BLE001  # Ray is shutting down: their supervisors stop on their own
                logger.debug("could not wait for the node fronts to stop", exc_info=True)
        self.local.stop()


@functools.cache
def _actor_class() -> Any:
    """:class:`NodeFront` as a Ray actor class (made once: each new one is exported to the GCS)."""
    import ray

    return ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)(NodeFront)  # type: ignore[call-overload]
