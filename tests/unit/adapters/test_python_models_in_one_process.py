"""Many Python models in one process (a pool replica): each model's calls see its own folder and
its own BLS client, whatever thread or loop runs them, and a process's own metric families
count once however many of its models report them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import sys
from pathlib import Path

import numpy as np
import pytest

from rayinfer.adapters.loader import load_runner
from rayinfer.cluster.model_files import write_python_model
from rayinfer.adapters.python_backend import bls, model_context
from rayinfer.adapters.python_backend import triton_python_backend_utils as pb_utils
from rayinfer.protocol.types import InferInput, InferRequest, InferResponse
from rayinfer.serving.model_core import ModelCore
from rayinfer.serving.statistics_store import StatisticsStore

IO = ('input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
      'output [ { name: "DIR" data_type: TYPE_STRING dims: [ 1 ] }, '
      '{ name: "CLIENT" data_type: TYPE_STRING dims: [ 1 ] } ]\n')

# Answers its folder as initialize and execute saw it, and the name of the BLS client its calls use.
WHO_AM_I = '''import numpy as np
import triton_python_backend_utils as pb_utils
from rayinfer.adapters.python_backend import bls

class TritonPythonModel:
    def initialize(self, args):
        self.at_start = pb_utils.get_model_dir()
        self.family = pb_utils.MetricFamily("pooled_calls", "calls", pb_utils.MetricFamily.COUNTER)
        self.metric = self.family.Metric(labels={"model": args["model_name"]})

    {kind}def execute(self, requests):
        self.metric.increment(1)
        seen = pb_utils.get_model_dir() + "|" + self.at_start
        client = bls.client().name
        return [pb_utils.InferenceResponse([
            pb_utils.Tensor("DIR", np.array([seen.encode()], dtype=np.object_)),
            pb_utils.Tensor("CLIENT", np.array([client.encode()], dtype=np.object_))]) for _ in requests]
'''


class NamedClient:
    """A BLS client that only says whose it is."""

    def __init__(self, name: str) -> None:
        self.name = name


def write(root: Path, name: str, asynchronous: bool) -> None:
    write_python_model(root, name, f'name: "{name}"\nbackend: "python"\n{IO}',
                       WHO_AM_I.replace("{kind}", "async " if asynchronous else ""))


def ask(core: ModelCore) -> tuple[str, str]:
    request = InferRequest(core.name, inputs=[InferInput("IN", "INT32", (1,), np.array([1], dtype=np.int32))])
    [answer] = list(core.execute_here(request))
    assert isinstance(answer, InferResponse), answer
    return tuple(output.data.reshape(-1)[0].decode() for output in answer.outputs)


@pytest.fixture(autouse=True)
def shared_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as a pool replica, for the test only (what it loads is the process's until then)."""
    monkeypatch.setattr(model_context, "_shared", True)
    monkeypatch.setattr(model_context, "_last", None)
    monkeypatch.setattr(model_context, "_loaded", [])


def test_each_model_sees_its_own_folder_and_client_and_its_folders_stay_off_sys_path(tmp_path: Path) -> None:
    names = {"plain": False, "coroutine": True, "third": False}
    for name, asynchronous in names.items():
        write(tmp_path, name, asynchronous)
    path_before = list(sys.path)

    async def load(name: str) -> ModelCore:
        with bls.loading_with(NamedClient(f"client of {name}")):
            runner, _ = await asyncio.to_thread(load_runner, tmp_path, name, 1)
        return ModelCore(runner, [1])

    async def load_all() -> list[ModelCore]:
        return list(await asyncio.gather(*(load(name) for name in names)))  # loaded at once, as the pool does

    cores = asyncio.run(load_all())
    try:
        for _ in range(2):
            for core in reversed(cores):
                folder = str(tmp_path / core.name)
                assert ask(core) == (f"{folder}|{folder}", f"client of {core.name}")
        assert sys.path == path_before  # nothing to import beside model.py: no folder added
        # Outside any model's call (a thread a model started itself), no model is the process's:
        # a BLS call says so instead of calling as another model.
        assert model_context.current() is None
        with pytest.raises(pb_utils.TritonModelException, match="outside the model's own calls"):
            bls.client()
        # A thread started in a model's context is the model's.
        with model_context.entered(cores[0].executor.adapter.context):
            seen = contextvars.copy_context().run(lambda: concurrent.futures.ThreadPoolExecutor(1).submit(
                contextvars.copy_context().run, pb_utils.get_model_dir).result())
        assert seen == str(tmp_path / cores[0].name)

        # The process's one family rides on the oldest model's statistics only (a change is
        # pushed once, not once per model); it counts once (3 models x 2 calls).
        [carrier] = [core for core in cores if "custom_metrics" in core.snapshot()]
        store = StatisticsStore()
        for core in cores:
            store.report(f"replica-1/{core.name}", core.name, "1", core.snapshot())
        [family] = store.custom_metrics()
        assert family["name"] == "pooled_calls"
        assert {m["labels"]["model"]: m["value"] for m in family["metrics"]} == {name: 2.0 for name in names}
        # A second process's report adds to it.
        other = {**carrier.snapshot(), "custom_metrics_process": "another process"}
        store.report("replica-2/plain", "plain", "1", other)
        [family] = store.custom_metrics()
        assert {m["labels"]["model"]: m["value"] for m in family["metrics"]} == {name: 4.0 for name in names}
        # That model unloaded, another one carries them.
        carrier.close()
        cores.remove(carrier)
        assert sorted("custom_metrics" in core.snapshot() for core in cores) == [False, True]
    finally:
        for core in cores:
            core.close()


THREAD_NAME = '''import threading
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        name = threading.current_thread().name.encode()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("DIR", np.array([name], dtype=np.object_)),
                                            pb_utils.Tensor("CLIENT", np.array([b""], dtype=np.object_))])
                for _ in requests]
'''


def test_a_model_kept_off_the_loop_executes_on_its_thread_however_short(tmp_path: Path) -> None:
    """Short executions run on the replica's loop, except a model's whose calls to other models
    could wait on that loop (a pooled Python model's): those always run on its own thread."""
    write_python_model(tmp_path, "who", f'name: "who"\nbackend: "python"\n{IO}', THREAD_NAME)

    async def threads(inline: bool) -> set[str]:
        core = ModelCore(load_runner(tmp_path, "who", 1)[0], [1])
        core.inline_executions = inline
        core._execution_s_avg = 0.0  # measured short
        request = InferRequest("who", inputs=[InferInput("IN", "INT32", (1,), np.array([1], dtype=np.int32))])
        try:
            return {(await core.infer(core.prepare(request))).outputs[0].data.reshape(-1)[0].decode() for _ in range(20)}
        finally:
            core.close()

    assert "MainThread" in asyncio.run(threads(True))  # measured short: on the loop's thread
    assert asyncio.run(threads(False)) == {"who-v1_0"}


# Finds its own tests as Triton's python_unittest models do: by importing its module by its file's name.
OWN_TESTS = '''import unittest
import numpy as np
import triton_python_backend_utils as pb_utils

WHO = "{name}"

class {name}Tests(unittest.TestCase):
    def test_one(self):
        self.assertEqual(WHO, "{name}")

class TritonPythonModel:
    def execute(self, requests):
        import model
        tests = unittest.defaultTestLoader.loadTestsFromModule(model).countTestCases()
        named = unittest.defaultTestLoader.loadTestsFromName("{name}Tests", model).countTestCases()
        who = f"{{model.WHO}} {{tests}} {{named}}".encode()
        return [pb_utils.InferenceResponse([pb_utils.Tensor("DIR", np.array([who], dtype=np.object_)),
                                            pb_utils.Tensor("CLIENT", np.array([b""], dtype=np.object_))])
                for _ in requests]
'''


def test_each_model_imports_its_own_module_by_its_files_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``import model`` in a pooled model is the model's own module (Triton's stub gives each
    model a process, and ``unittest.main('model')`` relies on it), whichever was loaded first."""
    monkeypatch.delitem(sys.modules, "model", raising=False)
    for name in ("First", "Second"):
        write_python_model(tmp_path, name, f'name: "{name}"\nbackend: "python"\n{IO}', OWN_TESTS.format(name=name))
    cores = [ModelCore(load_runner(tmp_path, name, 1)[0], [1]) for name in ("First", "Second")]
    try:
        for core in (*cores, *reversed(cores)):
            assert ask(core)[0] == f"{core.name} 1 1"
        with pytest.raises(AttributeError, match="no Python model of this pool replica is running here"):
            sys.modules["model"].WHO
    finally:
        for core in cores:
            core.close()
