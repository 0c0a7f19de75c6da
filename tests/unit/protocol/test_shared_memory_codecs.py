"""System shared memory without a server: the registry's rules and messages (Triton's), and both
codecs reading inputs from and writing outputs to registered regions of real POSIX shared
memory (tritonclient's own helper creates them, as a client would)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.utils.shared_memory as shm_client
from tritonclient.grpc import service_pb2 as pb

from rayinfer.protocol.errors import Code, NotFoundError, ServingError
from rayinfer.protocol.grpc_codec import request_from_grpc, response_to_grpc
from rayinfer.protocol.http_codec import request_from_http, response_to_http
from rayinfer.protocol.shared_memory import (
    RegionMissing,
    SharedMemoryRegistry,
    TensorLocation,
    decode_with_regions,
    shm_path,
)
from rayinfer.protocol.types import InferOutput, InferResponse

KEY = f"/rayinfer_unit_{os.getpid()}"


@pytest.fixture
def region() -> Iterator[object]:
    handle = shm_client.create_shared_memory_region("unit", KEY, 256)
    try:
        yield handle
    finally:
        shm_client.destroy_shared_memory_region(handle)


def _error(call, *args) -> ServingError:
    with pytest.raises(ServingError) as caught:
        call(*args)
    return caught.value


def test_registration_follows_tritons_rules(region) -> None:
    registry = SharedMemoryRegistry()
    registry.register("r", KEY, 64, 128)
    assert registry.status() == [{"name": "r", "key": KEY, "offset": 64, "byte_size": 128}]
    assert registry.status("r") == registry.status()
    duplicate = _error(registry.register, "r", KEY, 0, 8)
    assert (duplicate.code, duplicate.message) == (Code.ALREADY_EXISTS, "shared memory region 'r' already in manager")
    too_big = _error(registry.register, "big", KEY, 200, 100)
    assert (too_big.code, too_big.message) == (Code.INVALID_ARG, "failed to register shared memory region 'big': "
                                                                 "invalid args")
    missing = _error(registry.register, "x", "/rayinfer_no_such_key", 0, 8)
    assert (missing.code, missing.message) == (Code.INTERNAL, "Unable to open shared memory region: "
                                                              "'/rayinfer_no_such_key'")
    assert _error(registry.status, "nope").message == "Unable to find system shared memory region: 'nope'"
    registry.unregister("nope")  # an unknown name is no error
    registry.unregister()
    assert registry.status() == []


def test_a_key_is_one_name_never_a_path() -> None:
    assert shm_path("/abc") == "/dev/shm/abc"
    for key in ("/../etc/passwd", "a/b", "", "/", ".."):
        assert _error(shm_path, key).message == f"Unable to open shared memory region: '{key}'"


def _http_body(inputs: list[dict], outputs: list[dict] | None = None) -> bytes:
    doc: dict = {"inputs": inputs}
    if outputs is not None:
        doc["outputs"] = outputs
    return json.dumps(doc).encode()


def _shm_params(region: str, byte_size: int, offset: int = 0) -> dict:
    params = {"shared_memory_region": region, "shared_memory_byte_size": byte_size}
    if offset:
        params["shared_memory_offset"] = offset
    return params


def test_http_inputs_and_outputs_travel_through_the_region(region) -> None:
    registry = SharedMemoryRegistry()
    registry.register("in", KEY, 0, 128)
    registry.register("out", KEY, 128, 128)
    x = np.arange(16, dtype=np.int32)
    shm_client.set_shared_memory_region(region, [x], offset=16)
    body = _http_body([{"name": "X", "datatype": "INT32", "shape": [16], "parameters": _shm_params("in", 64, 16)}],
                      [{"name": "Y", "parameters": _shm_params("out", 64, 32)}])
    request = request_from_http(body, None, "m", "", registry)
    assert np.array_equal(request.inputs[0].data, x) and request.inputs[0].parameters == {}
    assert request.outputs[0].shm is not None and request.outputs[0].parameters == {}
    response = InferResponse("m", "1", [InferOutput("Y", "INT32", (16,), x * 2)])
    body, header_length = response_to_http(response, request, registry)
    assert header_length is None
    out = json.loads(body)["outputs"][0]
    assert out == {"name": "Y", "datatype": "INT32", "shape": [16]}  # no data, no parameters (Triton's form)
    assert np.array_equal(shm_client.get_contents_as_numpy(region, np.int32, [16], offset=160), x * 2)


def test_http_errors_name_the_region_or_the_tensor(region) -> None:
    registry = SharedMemoryRegistry()
    registry.register("in", KEY, 0, 64)

    def decode(params: dict, **extra) -> ServingError:
        body = _http_body([{"name": "X", "datatype": "INT32", "shape": [16], "parameters": params, **extra}])
        return _error(request_from_http, body, None, "m", "", registry)

    assert decode(_shm_params("in", 64, 8)).message == "Invalid offset + byte size for shared memory region: 'in'"
    assert decode(_shm_params("in", 64, 64)).message == "Invalid offset for shared memory region: 'in'"
    assert decode(_shm_params("in", 32)).message == "input byte size mismatch for input 'X' for model 'm'. Expected 64, got 32"
    unknown = decode(_shm_params("gone", 64))
    assert (unknown.code, unknown.message) == (Code.NOT_FOUND, "Unable to find shared memory region: 'gone'")
    both = decode(_shm_params("in", 64), data=list(range(16)))
    assert both.message.startswith("Input must set only one of the following fields") and "set 'data' " \
        "'shared_memory_region' for input 'X'" in both.message
    out_body = _http_body([{"name": "X", "datatype": "INT32", "shape": [1], "data": [1]}],
                          [{"name": "Y", "parameters": {**_shm_params("in", 8), "binary_data": True}}])
    assert _error(request_from_http, out_body, None, "m", "", registry).message == \
        "Output can't set both 'shared_memory_region' and 'binary_data'"
    small = _http_body([{"name": "X", "datatype": "INT32", "shape": [1], "data": [1]}],
                       [{"name": "Y", "parameters": _shm_params("in", 8)}])
    request = request_from_http(small, None, "m", "", registry)
    response = InferResponse("m", "1", [InferOutput("Y", "INT32", (16,), np.zeros(16, np.int32))])
    too_small = _error(response_to_http, response, request, registry)
    assert (too_small.code, too_small.message) == (
        Code.INTERNAL, "shared memory size specified with the request for output 'Y' (8 bytes) should be at least "
        "64 bytes to hold the results")


def test_grpc_mixes_raw_and_shared_inputs_and_keeps_output_positions(region) -> None:
    registry = SharedMemoryRegistry()
    registry.register("r", KEY, 0, 256)
    a, b = np.arange(4, dtype=np.float32), np.arange(4, 8, dtype=np.float32)
    shm_client.set_shared_memory_region(region, [b])
    message = pb.ModelInferRequest(model_name="m")
    message.inputs.add(name="A", datatype="FP32", shape=[4])
    message.raw_input_contents.append(a.tobytes())
    shared = message.inputs.add(name="B", datatype="FP32", shape=[4])
    shared.parameters["shared_memory_region"].string_param = "r"
    shared.parameters["shared_memory_byte_size"].int64_param = 16
    wanted = message.outputs.add(name="Y")
    wanted.parameters["shared_memory_region"].string_param = "r"
    wanted.parameters["shared_memory_byte_size"].int64_param = 16
    wanted.parameters["shared_memory_offset"].int64_param = 64
    message.outputs.add(name="Z")
    request = request_from_grpc(message, registry)
    assert np.array_equal(request.inputs[0].data, a) and np.array_equal(request.inputs[1].data, b)
    response = response_to_grpc(InferResponse("m", "1", [InferOutput("Y", "FP32", (4,), a + b),
                                                         InferOutput("Z", "FP32", (4,), a)]), request, registry)
    assert list(response.raw_output_contents) == [b"", a.tobytes()]
    assert not response.outputs[0].parameters
    assert np.array_equal(shm_client.get_contents_as_numpy(region, np.float32, [4], offset=64), a + b)


def test_a_replica_maps_a_region_when_a_request_first_names_it(region) -> None:
    home = SharedMemoryRegistry()
    home.register("r", KEY, 0, 64)

    async def fetch(name: str):
        return home.registration(name) if home.status() else None

    replica = SharedMemoryRegistry(fetch)
    shm_client.set_shared_memory_region(region, [np.full(4, 7, np.int32)])
    body = _http_body([{"name": "X", "datatype": "INT32", "shape": [4], "parameters": _shm_params("r", 16)}])
    with pytest.raises(RegionMissing):
        request_from_http(body, None, "m", "", replica)
    request = asyncio.run(decode_with_regions(replica, lambda: request_from_http(body, None, "m", "", replica)))
    assert request.inputs[0].data.tolist() == [7, 7, 7, 7]
    replica.unregister("r")  # the /v2 replica's word that it was unregistered
    home.unregister("r")
    with pytest.raises(NotFoundError, match="Unable to find shared memory region: 'r'"):
        asyncio.run(decode_with_regions(replica, lambda: request_from_http(body, None, "m", "", replica)))


def test_a_link_in_the_shared_memory_folder_is_not_followed(tmp_path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"\0" * 64)
    link = f"/dev/shm/rayinfer_unit_link_{os.getpid()}"
    os.symlink(target, link)
    try:
        error = _error(SharedMemoryRegistry().register, "l", link, 0, 64)
        assert error.message == f"Unable to open shared memory region: '{link}'"
    finally:
        os.unlink(link)


def test_an_output_goes_to_the_region_decoded_even_if_it_is_unregistered_meanwhile(region) -> None:
    registry = SharedMemoryRegistry()
    registry.register("out", KEY, 0, 64)
    body = _http_body([{"name": "X", "datatype": "INT32", "shape": [1], "data": [1]}],
                      [{"name": "Y", "parameters": _shm_params("out", 16)}])
    request = request_from_http(body, None, "m", "", registry)
    registry.unregister()
    response = InferResponse("m", "1", [InferOutput("Y", "INT32", (4,), np.arange(4, dtype=np.int32))])
    response_to_http(response, request, registry)
    assert shm_client.get_contents_as_numpy(region, np.int32, [4]).tolist() == [0, 1, 2, 3]


def test_a_fetch_overtaken_by_an_unregister_maps_nothing(region) -> None:
    replica: SharedMemoryRegistry

    async def fetch(name: str):
        replica.unregister()  # the /v2 replica's word arrives while the fetch waits
        return KEY, 0, 64

    replica = SharedMemoryRegistry(fetch)
    asyncio.run(replica.fetch("r"))
    with pytest.raises(RegionMissing):
        replica.read(TensorLocation("r", 0, 4))
