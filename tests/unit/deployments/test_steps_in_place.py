"""An ensemble's members run in its replica (steps_in_place): which members can, and an
instance that follows its member's replicas, with a real ONNX Runtime session and no Ray."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from onnx import TensorProto

from rayinfer.cluster.example_repository import SIMPLE_CONFIG, add_sub_model, write_model
from rayinfer.deployments.names import POOL_DEPLOYMENT
from rayinfer.deployments.steps_in_place import InPlaceMembers, reason_not_in_place
from rayinfer.protocol.errors import InvalidArgError
from rayinfer.protocol.types import InferInput, InferRequest
from rayinfer.repository.model_config import ModelConfig, config_to_json, read_config, spec_from_config
from waiting import wait_until_async


def spec(text: str):
    return spec_from_config(text_format.Parse(text, ModelConfig()), Path("repo/m/config.pbtxt"))


PYTHON = 'name: "m" backend: "python" max_batch_size: 8 input [ { name: "I" data_type: TYPE_INT32 dims: [ 1 ] } ] ' \
         'output [ { name: "O" data_type: TYPE_INT32 dims: [ 1 ] } ]'


@pytest.mark.parametrize("extra, reason", [
    ('model_transaction_policy { decoupled: true }', "it is decoupled"),
    ('sequence_batching { }', "it is a sequence model"),
    ('response_cache { enable: true }', "it has a response cache"),
    ('instance_group [ { kind: KIND_GPU } ]', "it runs on GPUs"),
])
def test_members_that_keep_to_their_replicas(extra: str, reason: str):
    assert reason_not_in_place(spec(f"{PYTHON} {extra}"), python_taken=False) == reason


def test_one_python_member_per_process_and_no_nested_ensembles():
    assert reason_not_in_place(spec(PYTHON), python_taken=False) is None
    assert "another Python member runs in place" in reason_not_in_place(spec(PYTHON), python_taken=True)
    assert reason_not_in_place(spec(SIMPLE_CONFIG), python_taken=True) is None
    ensemble = PYTHON.replace('backend: "python"', 'platform: "ensemble"')
    assert reason_not_in_place(spec(ensemble), python_taken=False) == "it is an ensemble"


def test_a_pooled_member_keeps_to_the_pool(tmp_path: Path, caplog):
    """A member the model pool hosts is not loaded in place (its route is the pool's): its steps
    go to the pool, and the log says why."""
    async def config_source(route: tuple[str, str]) -> str:
        raise AssertionError("a pooled member's config is not read")

    async def scenario() -> None:
        members = InPlaceMembers(tmp_path, config_source)
        await members.load(("simple", ""), ("simple", POOL_DEPLOYMENT), [("10.0.0.1", 1000)], spec(SIMPLE_CONFIG))
        assert members.cores() == []

    with caplog.at_level(logging.INFO, logger="rayinfer.deployments.steps_in_place"):
        asyncio.run(scenario())
    assert "member 'simple' does not run in place, its steps go to its replicas: it is pooled" in caplog.text


def request(a: np.ndarray) -> InferRequest:
    return InferRequest("simple", "", inputs=[InferInput("INPUT0", "INT32", a.shape, a),
                                              InferInput("INPUT1", "INT32", a.shape, a)])


def test_an_instance_serves_steps_and_is_loaded_again_when_its_member_is_redeployed(tmp_path: Path):
    write_model(tmp_path, "simple", SIMPLE_CONFIG, add_sub_model(TensorProto.INT32))
    served = json.dumps(config_to_json(read_config(tmp_path / "simple")))
    asked: list[tuple[str, str]] = []

    async def config_source(route: tuple[str, str]) -> str:
        asked.append(route)
        return served

    async def scenario() -> None:
        members = InPlaceMembers(tmp_path, config_source)
        key, route = ("simple", ""), ("simple", "simple_v1")
        assert await members.infer(key, request(np.ones((1, 16), np.int32))) is None  # not loaded: remote
        await members.load(key, route, [("10.0.0.1", 1000)], spec(SIMPLE_CONFIG))
        a = np.arange(32, dtype=np.int32).reshape(2, 16)
        response = await members.infer(key, request(a))
        np.testing.assert_array_equal(response.outputs[0].data, 2 * a)
        with pytest.raises(InvalidArgError):  # the member's own checks: a step's bad input fails as remotely
            await members.infer(key, request(np.ones((9, 16), np.int32)))
        first = members.cores()[0]
        members.observe(key, route, [("10.0.0.1", 1000), ("10.0.0.2", 1000)])  # scaled up: same instance
        assert members.cores() == [first] and len(asked) == 1
        members.observe(key, route, [("10.0.0.3", 1000)])  # every replica replaced: a new instance
        assert await members.infer(key, request(a)) is None  # meanwhile its replicas serve the steps
        await wait_until_async(lambda: len(members.cores()) == 1, "the instance to be loaded again")
        assert members.cores()[0] is not first and len(asked) == 2
        np.testing.assert_array_equal((await members.infer(key, request(a))).outputs[1].data, 0 * a)
        members.close()
        assert members.cores() == []

    asyncio.run(scenario())


def test_a_batched_ensembles_steps_run_at_once_past_the_members_batcher(tmp_path: Path):
    """The ensemble batched its requests (max_queue_delay_microseconds): a step carries their rows
    and runs at once; without that, it waits in the member's batcher (a minute here)."""
    waiting = SIMPLE_CONFIG + "dynamic_batching { max_queue_delay_microseconds: 60000000 }\n"
    write_model(tmp_path, "simple", waiting, add_sub_model(TensorProto.INT32))
    served = json.dumps(config_to_json(read_config(tmp_path / "simple")))

    async def config_source(route: tuple[str, str]) -> str:
        return served

    async def scenario() -> None:
        key, route = ("simple", ""), ("simple", "simple_v1")
        batched, unbatched = InPlaceMembers(tmp_path, config_source, batched=True), InPlaceMembers(tmp_path, config_source)
        for members in (batched, unbatched):
            await members.load(key, route, [("10.0.0.1", 1000)], spec(waiting))
        a = np.arange(48, dtype=np.int32).reshape(3, 16)
        response = await asyncio.wait_for(batched.infer(key, request(a)), 30)
        np.testing.assert_array_equal(response.outputs[0].data, 2 * a)
        snapshot = batched.cores()[0].snapshot()
        assert (snapshot["execution_count"], snapshot["inference_count"]) == (1, 3)
        step = asyncio.ensure_future(unbatched.infer(key, request(a)))
        core = unbatched.cores()[0]
        await wait_until_async(lambda: core.snapshot()["pending_request_count"] == 1, "the step to wait in the batcher")
        assert not step.done()
        step.cancel()
        for members in (batched, unbatched):
            members.close()

    asyncio.run(scenario())
