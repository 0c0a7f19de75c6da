"""CUDA shared memory without a GPU: the registry's rules and Triton's messages for CUDA regions
beside system ones (one namespace, status and unregister by kind), the HTTP register body, which
device a replica opens, and the error a request gets where the handle cannot be opened here.
Copying through a real IPC handle is tests/integration/test_real_gpu.py's (marked gpu)."""

from __future__ import annotations

import asyncio
import base64
import ctypes
import json
import os
from collections.abc import Iterator

import pytest
import tritonclient.utils.shared_memory as shm_client

from rayinfer.protocol.cuda_memory import CudaUnavailableError, ipc_handle, local_ordinal, open_ipc_memory
from rayinfer.protocol.errors import Code, ServingError
from rayinfer.protocol.http_codec import request_from_http
from rayinfer.protocol.shared_memory import (
    CUDA,
    SYSTEM,
    Registration,
    SharedMemoryRegistry,
    cuda_registration_from_json,
    decode_with_regions,
)

KEY = f"/rayinfer_unit_cuda_{os.getpid()}"
HANDLE = bytes(range(64))


def _has_cuda_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.fixture
def registry() -> Iterator[SharedMemoryRegistry]:
    handle = shm_client.create_shared_memory_region("unit", KEY, 64)
    try:
        registry = SharedMemoryRegistry()
        registry.register("host", KEY, 0, 64)
        registry.register_cuda("gpu", HANDLE, 0, 256)
        yield registry
    finally:
        shm_client.destroy_shared_memory_region(handle)


def _error(call, *args) -> ServingError:
    with pytest.raises(ServingError) as caught:
        call(*args)
    return caught.value


def test_status_and_unregister_keep_to_their_kind(registry) -> None:
    assert registry.status(kind=CUDA) == [{"name": "gpu", "device_id": 0, "byte_size": 256}]
    assert registry.status() == [{"name": "host", "key": KEY, "offset": 0, "byte_size": 64}]
    assert registry.status("gpu", CUDA) == registry.status(kind=CUDA)
    wrong = _error(registry.status, "gpu", SYSTEM)
    assert (wrong.code, wrong.message) == (
        Code.NOT_FOUND, "The region named 'gpu' is registered as CUDA shared memory, not system shared memory")
    assert _error(registry.status, "host", CUDA).message == \
        "The region named 'host' is registered as system shared memory, not CUDA shared memory"
    assert _error(registry.status, "nope", CUDA).message == "Unable to find cuda shared memory region: 'nope'"
    registry.unregister("gpu", SYSTEM)  # the other kind's name: no error, nothing forgotten
    registry.unregister(kind=SYSTEM)
    assert registry.status() == [] and registry.status(kind=CUDA) != []
    registry.unregister(kind=CUDA)
    assert registry.status(kind=CUDA) == []


def test_one_namespace_and_a_handle_of_the_right_size(registry) -> None:
    for call, args in ((registry.register_cuda, ("host", HANDLE, 0, 8)), (registry.register, ("gpu", KEY, 0, 8))):
        duplicate = _error(call, *args)
        assert (duplicate.code, duplicate.message) == (Code.ALREADY_EXISTS, f"shared memory region '{args[0]}' "
                                                                            "already in manager")
    short = _error(registry.register_cuda, "short", HANDLE[:6], 0, 8)
    assert (short.code, short.message) == (Code.INVALID_ARG,
                                           "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t")
    assert _error(registry.register_cuda, "negative", HANDLE, -1, 8).message == \
        "failed to register shared memory region 'negative': invalid args"
    assert _error(registry.register_cuda, "", HANDLE, 0, 8).message == \
        "'region name' is necessary to register cuda shared memory region"
    assert registry.registration("gpu") == Registration("", 0, 256, 0, HANDLE)
    assert registry.registration("gpu").kind == CUDA and registry.registration("host").kind == SYSTEM


def test_the_http_register_body_carries_the_handle_in_base64() -> None:
    encoded = base64.b64encode(HANDLE).decode()
    doc = {"raw_handle": {"b64": encoded}, "device_id": 1, "byte_size": 64}
    assert cuda_registration_from_json(doc) == (HANDLE, 1, 64)
    errors = {  # Triton's messages where it has one
        "Shared memory register request has no 'raw_handle' field": {"device_id": 0, "byte_size": 64},
        "Unable to parse 'b64': expected a JSON string in 'raw_handle'": {**doc, "raw_handle": "AAAA"},
        "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t": {**doc, "raw_handle": {"b64": "AAAA"}},
        "Unable to parse 'byte_size': expected a JSON unsigned integer": {"raw_handle": {"b64": encoded}, "device_id": 0},
        "Unable to parse 'device_id': expected a JSON unsigned integer": {**doc, "device_id": -1},
    }
    for message, body in errors.items():
        assert _error(cuda_registration_from_json, body).message == message
    assert _error(cuda_registration_from_json, {**doc, "raw_handle": {"b64": "not base64!"}}).message == \
        "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"


def test_a_replica_opens_the_device_the_client_named_as_it_numbers_it(monkeypatch) -> None:
    assert local_ordinal(2, visible="1,2") == 1
    assert local_ordinal(3, visible="3") == 0
    assert local_ordinal(1, visible="0") == 0  # not listed: opened through the visible one (peer access)
    assert local_ordinal(1, visible="GPU-8d1f") == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert local_ordinal(2) == 2  # no CUDA_VISIBLE_DEVICES: the driver's numbering
    with pytest.raises(CudaUnavailableError, match=r"no GPU is visible to this process \(CUDA_VISIBLE_DEVICES=''\)"):
        local_ordinal(0, visible="")  # Ray's setting for a replica without GPUs


def test_the_driver_gets_every_byte_of_the_handle() -> None:
    handle = bytes([0, 7] * 32)  # zero bytes inside, as real handles have
    assert bytes(ipc_handle(handle)) == handle


@pytest.mark.skipif(_has_cuda_driver(), reason="shows the error of a node without the CUDA driver")
def test_a_request_naming_a_cuda_region_where_no_driver_is_gets_an_error_naming_it() -> None:
    error = _error(open_ipc_memory, "gpu", HANDLE, 0, 64)
    assert error.code == Code.INVALID_ARG
    assert error.message.startswith("Unable to open CUDA shared memory region 'gpu' on GPU 0: no CUDA driver on "
                                    "this node (libcuda.so.1")
    home = SharedMemoryRegistry()
    home.register_cuda("gpu", HANDLE, 0, 64)

    async def fetch(name: str):
        return home.registration(name)

    replica = SharedMemoryRegistry(fetch)
    params = {"shared_memory_region": "gpu", "shared_memory_byte_size": 16}
    body = json.dumps({"inputs": [{"name": "X", "datatype": "INT32", "shape": [4], "parameters": params}]}).encode()
    with pytest.raises(ServingError) as caught:
        asyncio.run(decode_with_regions(replica, lambda: request_from_http(body, None, "m", "", replica)))
    assert caught.value.message == error.message
    window = {"shared_memory_region": "gpu", "shared_memory_byte_size": 16, "shared_memory_offset": 64}
    late = json.dumps({"inputs": [{"name": "X", "datatype": "INT32", "shape": [4], "parameters": window}]}).encode()
    assert _error(request_from_http, late, None, "m", "", replica).message == \
        "Invalid offset for shared memory region: 'gpu'"  # checked before any device is touched
