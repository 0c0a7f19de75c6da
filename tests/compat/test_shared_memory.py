"""Triton's system shared memory extension through unmodified tritonclient, over HTTP and gRPC:
regions created with tritonclient's own helper, registered, used for inputs and outputs of
``simple`` (as Triton's simple_*_shm_client examples do), their status, Triton's errors, and an
unregistered region refused by the model replica that had mapped it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

A = np.arange(16, dtype=np.int32).reshape(1, 16)
B = np.ones((1, 16), dtype=np.int32)
NBYTES = A.nbytes  # 64


def _key(name: str) -> str:
    return f"/rayinfer_test_{os.getpid()}_{name}"


@pytest.fixture
def regions(proto: tuple[Any, Any]) -> Iterator[dict[str, Any]]:
    """An input region holding A then B, and an output region, both registered."""
    _, client = proto
    client.unregister_system_shared_memory()
    handles = {"input": shm.create_shared_memory_region("input_data", _key("input"), 2 * NBYTES),
               "output": shm.create_shared_memory_region("output_data", _key("output"), 2 * NBYTES)}
    shm.set_shared_memory_region(handles["input"], [A, B])
    try:
        client.register_system_shared_memory("input_data", _key("input"), 2 * NBYTES)
        client.register_system_shared_memory("output_data", _key("output"), 2 * NBYTES)
        yield handles
    finally:
        client.unregister_system_shared_memory()
        for handle in handles.values():
            shm.destroy_shared_memory_region(handle)


def _infer(module: Any, client: Any, input_region: str = "input_data", output_byte_size: int = NBYTES,
           input_offset: int = 0) -> Any:
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_shared_memory(input_region, NBYTES, offset=input_offset)
    inputs[1].set_shared_memory(input_region, NBYTES, offset=NBYTES)
    outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory("output_data", output_byte_size)
    outputs[1].set_shared_memory("output_data", NBYTES, offset=NBYTES)
    return client.infer("simple", inputs, outputs=outputs)


def _status(client: Any) -> dict[str, dict[str, Any]]:
    status = client.get_system_shared_memory_status(**({} if isinstance(client.get_system_shared_memory_status(),
                                                                        list) else {"as_json": True}))
    if isinstance(status, list):
        return {r["name"]: {k: r[k] for k in ("key", "offset", "byte_size")} for r in status}
    return {name: {"key": r["key"], "offset": int(r.get("offset", 0)), "byte_size": int(r["byte_size"])}
            for name, r in status.get("regions", {}).items()}


def _error(call: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(InferenceServerException) as caught:
        call(*args, **kwargs)
    return str(caught.value)


def test_inputs_and_outputs_travel_through_shared_memory(proto: tuple[Any, Any], regions: dict[str, Any]) -> None:
    module, client = proto
    result = _infer(module, client)
    output0 = result.get_output("OUTPUT0")
    shape = output0["shape"] if isinstance(output0, dict) else list(output0.shape)
    assert [int(d) for d in shape] == [1, 16]
    sums = shm.get_contents_as_numpy(regions["output"], np.int32, [1, 16])
    differences = shm.get_contents_as_numpy(regions["output"], np.int32, [1, 16], offset=NBYTES)
    np.testing.assert_array_equal(sums, A + B)
    np.testing.assert_array_equal(differences, A - B)
    assert _status(client) == {"input_data": {"key": _key("input"), "offset": 0, "byte_size": 2 * NBYTES},
                               "output_data": {"key": _key("output"), "offset": 0, "byte_size": 2 * NBYTES}}


def test_an_unregistered_region_is_refused_and_its_name_can_be_reused(proto: tuple[Any, Any],
                                                                       regions: dict[str, Any]) -> None:
    module, client = proto
    _infer(module, client)  # the model replica maps the region
    client.unregister_system_shared_memory("input_data")
    assert "Unable to find shared memory region: 'input_data'" in _error(_infer, module, client)
    other = shm.create_shared_memory_region("other", _key("other"), 2 * NBYTES)
    try:
        shm.set_shared_memory_region(other, [A * 10, B * 3])
        client.register_system_shared_memory("input_data", _key("other"), 2 * NBYTES)
        _infer(module, client)
        np.testing.assert_array_equal(shm.get_contents_as_numpy(regions["output"], np.int32, [1, 16]), A * 10 + B * 3)
    finally:
        client.unregister_system_shared_memory("input_data")
        shm.destroy_shared_memory_region(other)


def test_wrong_registrations_and_windows_get_tritons_errors(proto: tuple[Any, Any], regions: dict[str, Any]) -> None:
    module, client = proto
    assert "shared memory region 'input_data' already in manager" in _error(
        client.register_system_shared_memory, "input_data", _key("input"), NBYTES)
    assert f"Unable to open shared memory region: '{_key('missing')}'" in _error(
        client.register_system_shared_memory, "missing", _key("missing"), NBYTES)
    assert "failed to register shared memory region 'too_big': invalid args" in _error(
        client.register_system_shared_memory, "too_big", _key("input"), 4 * NBYTES)
    assert "Unable to find system shared memory region: 'missing'" in _error(
        client.get_system_shared_memory_status, "missing")
    assert "Invalid offset + byte size for shared memory region: 'input_data'" in _error(
        _infer, module, client, input_offset=NBYTES + 8)
    assert ("shared memory size specified with the request for output 'OUTPUT0' (32 bytes) should be at least "
            "64 bytes to hold the results") in _error(_infer, module, client, output_byte_size=32)
    _infer(module, client)  # the server still serves


def test_cuda_shared_memory_is_refused_without_gpus(proto: tuple[Any, Any]) -> None:
    module, client = proto
    http = module.__name__.endswith("http")
    status = client.get_cuda_shared_memory_status(**({} if http else {"as_json": True}))
    assert status in ([], {})
    message = _error(client.register_cuda_shared_memory, "gpu_region", "AAAAAAAA", 0, 64)
    assert "failed to register CUDA shared memory region: 'gpu_region', GPUs not supported" in message
    metadata = client.get_server_metadata()
    extensions = metadata["extensions"] if isinstance(metadata, dict) else list(metadata.extensions)
    assert "system_shared_memory" in extensions and "cuda_shared_memory" not in extensions
