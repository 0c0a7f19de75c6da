"""The model pool's replica keeping within --pool-max-models, without Ray: its class with
stand-in hosted models (HostedModel.load replaced), so that loads, unloads and requests can be
interleaved at will. The real thing: tests/integration/test_model_pool.py."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

from rayinfer.deployments import pool as pool_module
from rayinfer.deployments.pool import PoolDeployment
from rayinfer.protocol.errors import UnavailableError
from waiting import wait_until_async



class Pool(PoolDeployment.func_or_class):  # type: ignore[misc, valid-type]
    """The replica's class, less its Serve shutdown (an ``async def __del__``, which Python's
    own finalizer would call and never await)."""

    def __del__(self) -> None:
        pass


class _Stats:
    def __init__(self) -> None:
        self.last_inference_ms = 0
        self.durations = {"success": [0, 0], "fail": [0, 0]}


class _StandIn:
    """What the pool reads of a HostedModel."""

    def __init__(self, app: str) -> None:
        self.app_name = app
        self.handle_calls = 0
        self.busy_calls = 0
        self.closed = False
        self.core = type("Core", (), {"name": app, "version": "1"})()
        self.core.executor = type("Executor", (), {"stats": _Stats()})()

    @property
    def busy(self) -> bool:
        return bool(self.handle_calls or self.busy_calls)

    @property
    def last_inference_s(self) -> float:
        return 0.0

    async def report(self) -> None:
        pass

    async def close(self) -> None:
        self.closed = True


def _pool(monkeypatch, max_models: int, load_s: float = 0.02, fail: set[str] | None = None) -> Any:
    """A pool replica's object holding ``max_models`` at most, whose loads take ``load_s``."""
    loads: list[str] = []

    async def load(repository, model, version, options, *, replica_key, app_name, deployment, server,
                   stats_key=None):
        loads.append(app_name)
        await asyncio.sleep(load_s)  # a load's own time, for requests and changes to overlap it
        if fail and app_name in fail:
            raise RuntimeError(f"{app_name} cannot be read")
        return _StandIn(app_name)

    monkeypatch.setattr(pool_module.HostedModel, "load", load)
    replica = object.__new__(Pool)
    replica._replica_id, replica._replica_key, replica._deployment = "r1", "rayinfer-pool/r1", "PoolDeployment"
    replica._server = None
    for name in ("_specs", "_hosted", "_failures", "_used", "_loading", "_waiting", "_load_errors", "_stats",
                 "_locks", "_registered_at"):
        setattr(replica, name, {})
    replica._evicted, replica._background = set(), set()
    replica._max_models, replica._load_timeout_s, replica._loads = max_models, 5.0, 0
    replica._changing, replica._publishing = asyncio.Lock(), asyncio.Lock()
    replica._load_limit = asyncio.Semaphore(4)
    replica._scale_up_rpm, replica._replicas, replica._rates = 0.0, 1, pool_module.RequestRates()
    replica.loads = loads

    async def nothing(*args: Any) -> None:
        pass

    replica._publish_report = nothing
    replica._register = nothing
    replica._publish_resident = lambda: None
    return replica


def _config(*apps: str, max_models: int) -> dict[str, Any]:
    return {"models": {app: [app, 1, {"repository": "/repo"}] for app in apps}, "max_models": max_models}


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


def test_past_max_models_the_least_recently_used_idle_version_is_unloaded(monkeypatch):
    async def scenario() -> None:
        replica = _pool(monkeypatch, 2)
        await replica.reconfigure(_config("a", "b", "c", max_models=2))
        assert len(replica._hosted) == 2 and len(replica._evicted) == 1
        busy = replica._hosted[next(iter(replica._hosted))]
        busy.busy_calls = 1  # a request in flight: never unloaded
        unloaded = next(iter(replica._evicted))
        assert (await replica._resident(unloaded)).app_name == unloaded
        await asyncio.gather(*list(replica._background))  # the unload down to max_models follows the load
        assert busy.app_name in replica._hosted and unloaded in replica._hosted
        assert len(replica._hosted) == 2

    run(scenario())


def test_a_version_loaded_again_for_a_request_is_not_unloaded_before_the_request_has_it(monkeypatch):
    """Two requests at once for two unloaded versions, room for one: each request gets its
    version (neither load unloads the other's before its request has it)."""
    async def scenario() -> None:
        replica = _pool(monkeypatch, 1)
        await replica.reconfigure(_config("a", "b", "c", max_models=1))
        unloaded = sorted(replica._evicted)[:2]
        got = await asyncio.gather(*(replica._resident(app) for app in unloaded))
        assert [hosted.app_name for hosted in got] == unloaded

    run(scenario())


def test_a_failed_load_again_fails_its_requests_and_the_next_request_tries_again(monkeypatch):
    async def scenario() -> None:
        replica = _pool(monkeypatch, 1)
        await replica.reconfigure(_config("a", "b", max_models=1))
        unloaded = next(iter(replica._evicted))
        broken = {unloaded}
        monkeypatch.setattr(pool_module.HostedModel, "load", _failing_then_working(broken))
        with pytest.raises(UnavailableError, match="could not be loaded again: .* cannot be read"):
            await replica._resident(unloaded)
        assert unloaded not in replica._failures  # not failed for good
        broken.clear()
        assert (await replica._resident(unloaded)).app_name == unloaded

    run(scenario())


def test_a_version_unloaded_from_the_server_while_it_loads_again_does_not_come_back(monkeypatch):
    async def scenario() -> None:
        replica = _pool(monkeypatch, 1, load_s=0.1)
        await replica.reconfigure(_config("a", "b", max_models=1))
        unloaded = next(iter(replica._evicted))
        other = next(app for app in ("a", "b") if app != unloaded)
        request = asyncio.create_task(replica._resident(unloaded))
        await wait_until_async(lambda: unloaded in replica.loads[2:], "its load again to begin")
        await replica.reconfigure(_config(other, max_models=1))
        with pytest.raises(UnavailableError):
            await request
        assert unloaded not in replica._hosted and unloaded not in replica._specs

    run(scenario())


def _failing_then_working(broken: set[str]) -> Any:
    async def load(repository, model, version, options, *, replica_key, app_name, deployment, server,
                   stats_key=None):
        await asyncio.sleep(0.01)  # a load's own time
        if app_name in broken:
            raise RuntimeError(f"{app_name} cannot be read")
        return _StandIn(app_name)

    return load



def test_a_busy_version_held_elsewhere_is_loaded_here_and_kept_while_busy(monkeypatch):
    """--pool-scale-up-rpm: another replica's report says version ``b`` gets 5,000 requests a
    minute there (two copies' worth at 2,000); this replica, which unloaded ``b``, loads it
    again and keeps it over ``a``, its own idle version."""
    async def scenario() -> None:
        replica = _pool(monkeypatch, 1)
        await replica.reconfigure({**_config("a", "b", max_models=1), "scale_up_rpm": 2000, "replicas": 2})
        await replica._resident("a")
        await asyncio.gather(*list(replica._background))
        assert set(replica._hosted) == {"a"} and replica._evicted == {"b"}
        digests = replica.hosting_report()["evicted"]
        other = {"loaded": {"b": digests["b"]}, "evicted": {}, "failed": {}, "rpm": {"b": 5000.0},
                 "at": pool_module.time.time()}
        monkeypatch.setattr(pool_module, "read_every_report",
                            lambda: {"r0": other, "r1": replica.hosting_report()})
        await replica._spread()
        await wait_until_async(lambda: "b" in replica._hosted, "the busy version to load here")
        await asyncio.gather(*list(replica._background))
        assert set(replica._hosted) == {"b"}  # the idle one made room
        other["rpm"] = {"b": 100.0}  # no longer busy: nothing more loads
        before = list(replica.loads)
        await replica._spread()
        assert replica.loads == before

    run(scenario())


def test_without_a_budget_or_a_second_replica_nothing_is_spread(monkeypatch):
    async def scenario() -> None:
        replica = _pool(monkeypatch, 0)
        await replica.reconfigure({**_config("a", "b", max_models=0), "scale_up_rpm": 2000, "replicas": 2})
        monkeypatch.setattr(pool_module, "read_every_report", lambda: pytest.fail("reports read"))
        await replica._spread()
        replica._max_models, replica._replicas = 1, 1
        await replica._spread()

    run(scenario())


def test_a_replica_full_of_busy_versions_adds_no_copy(monkeypatch):
    """Room for one, and the version it holds is busy too: loading a copy of the other busy one
    would push it out (and it would come back the next round), so nothing loads."""
    async def scenario() -> None:
        replica = _pool(monkeypatch, 1)
        await replica.reconfigure({**_config("a", "b", max_models=1), "scale_up_rpm": 2000, "replicas": 2})
        await replica._resident("a")
        await asyncio.gather(*list(replica._background))
        digests = {**replica.hosting_report()["evicted"], **replica.hosting_report()["loaded"]}
        other = {"loaded": {"a": digests["a"], "b": digests["b"]}, "evicted": {}, "failed": {},
                 "rpm": {"a": 5000.0, "b": 5000.0}, "at": pool_module.time.time()}
        monkeypatch.setattr(pool_module, "read_every_report",
                            lambda: {"r0": other, "r1": replica.hosting_report()})
        before = list(replica.loads)
        await replica._spread()
        assert replica.loads == before and set(replica._hosted) == {"a"}

    run(scenario())


def test_reports_published_at_once_land_newest_last(monkeypatch):
    """Two reports put at once, the first one's put held until the second was asked for: Ray's
    store ends with the newer (the index reads it, and an older one would stand until the next
    change)."""
    stored: list[bytes] = []
    first_started, release_first = threading.Event(), threading.Event()

    def put(replica: str, value: bytes) -> None:
        if not first_started.is_set():
            first_started.set()
            release_first.wait(10)
        stored.append(value)

    class CountedLock(asyncio.Lock):
        """The pool's publishing lock, counting the publishes that asked for their turn."""

        asked = 0

        async def acquire(self) -> bool:
            self.asked += 1
            return await super().acquire()

    async def scenario() -> None:
        replica = _pool(monkeypatch, 2)
        del replica._publish_report  # the class's own
        replica._publishing = lock = CountedLock()
        monkeypatch.setattr(pool_module, "write_report", put)
        replica._specs = {app: (app, 1, {"repository": "/repo"}) for app in ("a", "b")}
        replica._hosted["a"] = _StandIn("a")
        first = asyncio.create_task(replica._publish_report())
        await wait_until_async(first_started.is_set, "the first put to start")
        replica._hosted["b"] = _StandIn("b")
        second = asyncio.create_task(replica._publish_report())
        await wait_until_async(lambda: lock.asked == 2, "the second publish to ask for its turn")
        release_first.set()
        await asyncio.gather(first, second)
        assert sorted(json.loads(stored[-1])["loaded"]) == ["a", "b"]

    run(scenario())
