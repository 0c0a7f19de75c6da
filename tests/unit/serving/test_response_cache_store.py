"""The response cache without a server: keys, entries shared through the node's directory by two
cache objects (two replicas), the size bound with least-recently-used eviction, the statistics
ModelCore keeps for hits and misses, and --cache-config parsing."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from onnx import TensorProto

from rayinfer.adapters.loader import load_runner
from rayinfer.cluster.example_repository import add_sub_model, write_model
from rayinfer.protocol.types import InferInput, InferOutput, InferRequest, InferResponse, RequestedOutput
from rayinfer.serving.model_core import ModelCore
from rayinfer.serving.response_cache import ResponseCache, model_fingerprint, parse_cache_config


def _request(value: int, *, outputs: list[str] | None = None, request_id: str | None = None,
             **parameters: object) -> InferRequest:
    data = np.full((1, 4), value, np.int32)
    text = np.array([b"a", b"bc"], dtype=object)
    return InferRequest("m", "1", request_id, [InferInput("X", "INT32", (1, 4), data),
                                               InferInput("T", "BYTES", (2,), text)],
                        [RequestedOutput(name) for name in outputs] if outputs else None, dict(parameters))


def _response(value: int) -> InferResponse:
    return InferResponse("m", "1", [InferOutput("Y", "INT32", (1, 4), np.full((1, 4), value, np.int32)),
                                    InferOutput("S", "BYTES", (1,), np.array([b"x\0y"], dtype=object))])


def test_the_key_is_what_decides_the_response(tmp_path: Path) -> None:
    cache = ResponseCache(tmp_path, "m", "1", "f", 1 << 20)
    key = cache.key(_request(1))
    assert key == cache.key(_request(1, request_id="other", binary_data_output=True, priority=2))
    for different in (_request(2), _request(1, outputs=["Y"]), _request(1, sequence_id=3)):
        assert cache.key(different) != key


def test_two_replicas_share_entries_through_the_nodes_directory(tmp_path: Path) -> None:
    first = ResponseCache(tmp_path, "m", "1", "f", 1 << 20)
    second = ResponseCache(tmp_path, "m", "1", "f", 1 << 20)
    other_model = ResponseCache(tmp_path, "m", "1", "changed files", 1 << 20)
    request = _request(1, request_id="r9")
    key = first.key(request)
    assert first.get(key, request, "m", "1") is None
    first.put(key, _response(5))
    hit = second.get(key, request, "m", "1")
    assert hit is not None and hit.id == "r9"
    assert [o.name for o in hit.outputs] == ["Y", "S"]
    assert hit.outputs[0].data.tolist() == [[5, 5, 5, 5]] and hit.outputs[1].data.tolist() == [b"x\0y"]
    assert other_model.get(key, request, "m", "1") is None


def test_the_directory_stays_under_its_size_evicting_the_least_recently_used(tmp_path: Path) -> None:
    entry_bytes = len(open_entry(tmp_path))
    cache = ResponseCache(tmp_path / "bounded", "m", "1", "f", entry_bytes * 5)
    keys = []
    for value in range(5):
        keys.append(cache.key(_request(value)))
        if cache.put(keys[-1], _response(value)):
            cache.trim()
        entry = next((tmp_path / "bounded").rglob(keys[-1]))
        os.utime(entry, ns=(value * 10**9, value * 10**9))  # written in this order, a second apart
    assert cache.get(keys[0], _request(0), "m", "1") is not None  # used again (now): the newest
    assert cache.put(cache.key(_request(99)), _response(99))  # over the size: trim now
    cache.trim()
    total = sum(f.stat().st_size for f in (tmp_path / "bounded").rglob("*") if f.is_file())
    assert total <= entry_bytes * 5
    assert cache.get(keys[0], _request(0), "m", "1") is not None
    assert cache.get(keys[1], _request(1), "m", "1") is None  # the least recently used went first
    too_big = ResponseCache(tmp_path / "tiny", "m", "1", "f", 10)
    too_big.put(too_big.key(_request(1)), _response(1))
    assert too_big.entry_count() == 0


def open_entry(tmp_path: Path) -> bytes:
    probe = ResponseCache(tmp_path / "probe", "m", "1", "f", 1 << 20)
    probe.put("k", _response(1))
    return next((tmp_path / "probe").rglob("k")).read_bytes()


def test_the_cache_refuses_a_folder_it_does_not_own_alone(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "link").symlink_to(elsewhere)
    with pytest.raises(PermissionError):
        ResponseCache(tmp_path / "link", "m", "1", "f", 100)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(PermissionError):
        ResponseCache(shared, "m", "1", "f", 100)


def test_a_model_changed_on_disk_gets_another_fingerprint(tmp_path: Path) -> None:
    (tmp_path / "1").mkdir()
    model = tmp_path / "1" / "model.onnx"
    model.write_bytes(b"one")
    before = model_fingerprint(tmp_path, "1", "{}")
    os.utime(model, ns=(1, 1))
    assert model_fingerprint(tmp_path, "1", "{}") != before
    assert model_fingerprint(tmp_path, "1", '{"max_batch_size": 8}') != model_fingerprint(tmp_path, "1", "{}")


def test_cache_config_takes_tritons_local_form() -> None:
    assert parse_cache_config([]) == 0
    assert parse_cache_config(["local,size=1048576"]) == 1048576
    for wrong in (["redis,host=a"], ["local,size=x"], ["local"]):
        with pytest.raises(ValueError):
            parse_cache_config(wrong)


def test_model_core_answers_a_repeated_request_from_the_cache(tmp_path: Path) -> None:
    io = ('input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] }, '
          '{ name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]\n'
          'output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] }, '
          '{ name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]\n')
    write_model(tmp_path, "add_sub", 'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n' + io
                + "response_cache { enable: true }\n", add_sub_model(TensorProto.INT32))
    runner, entry = load_runner(tmp_path, "add_sub", 1)
    core = ModelCore(runner, entry.versions, cache=ResponseCache(tmp_path / "cache", "add_sub", "1", "f", 1 << 20))

    async def twice() -> list[InferResponse]:
        return [await core.infer(core.prepare(add_sub_request())) for _ in range(2)]

    first, second = asyncio.run(twice())
    assert np.array_equal(first.outputs[0].data, second.outputs[0].data)
    snapshot = core.snapshot()
    assert snapshot["execution_count"] == 1 and snapshot["response_cache"]
    assert snapshot["durations"]["cache_hit"][0] == 1 and snapshot["durations"]["cache_miss"][0] == 1
    assert snapshot["durations"]["success"][0] == 2
    core.close()


def add_sub_request() -> InferRequest:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    return InferRequest("add_sub", "1", None, [InferInput("INPUT0", "INT32", (1, 16), a),
                                               InferInput("INPUT1", "INT32", (1, 16), a)])
