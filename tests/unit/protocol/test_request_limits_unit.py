"""Limits on what a client sends, without a server: inflating with a bound, element counts
that overflow, 'data' nested too deeply, raw binary requests, and a real replica listener
refusing bodies over its limit while they arrive."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib

import numpy as np
import pytest

from rayinfer.transport.replica_listener import ReplicaListener
from rayinfer.protocol.compression import decompress_body, inflate
from rayinfer.protocol.dtypes import element_count
from rayinfer.protocol.errors import InvalidArgError
from rayinfer.protocol.http_codec import raw_request, request_from_http
from rayinfer.protocol.limits import BodyTooLarge


def test_inflate_stops_at_the_limit_without_inflating_the_rest():
    data = gzip.compress(b"\0" * 10_000_000)
    assert inflate(data, 31, 10_000_000) == b"\0" * 10_000_000
    assert inflate(data, 31, 9_999_999) is None
    with pytest.raises(BodyTooLarge, match="Decompressed request body size exceeds the maximum allowed value of 100 "
                                           r"bytes. Use --http-max-input-size to increase the limit."):
        decompress_body(data, "gzip", 100)


def test_inflate_takes_gzip_members_in_a_row_and_refuses_truncated_data():
    assert inflate(gzip.compress(b"ab") + gzip.compress(b"cd"), 31, 10) == b"abcd"
    assert decompress_body(zlib.compress(b"xyz"), "deflate") == b"xyz"
    with pytest.raises(InvalidArgError, match="failed to decompress the gzip request body: the compressed data ends"):
        decompress_body(gzip.compress(b"abc" * 100)[:-12], "gzip")
    with pytest.raises(InvalidArgError, match="bytes after the end of the compressed data"):
        decompress_body(zlib.compress(b"xyz") + b"junk", "deflate")


def test_element_counts_and_byte_sizes_past_64_bits_are_refused_with_tritons_messages():
    assert element_count([3, 4], "x", "FP32") == 12
    with pytest.raises(InvalidArgError) as info:
        element_count([4294967296, 4294967296], "x", "INT8")
    assert info.value.message == ("invalid shape for input 'x': shape [4294967296,4294967296] causes total element "
                                  "count to exceed maximum size of 9223372036854775807")
    with pytest.raises(InvalidArgError) as info:
        element_count([4, 2**60 + 2], "x", "FP32")
    assert info.value.message == ("byte size overflow for input 'x': element count (4611686018427387912) * data type "
                                  "size (4) exceeds maximum allowed size (9223372036854775807)")


@pytest.mark.parametrize("data", [[1, 2, 3, 4], [[1, 2], [3, 4]], [[[1, 2], [3, 4]]], [[1], [2, [3, 4]]]])
def test_data_nested_any_way_is_flattened_as_triton_reads_it(data):
    body = json.dumps({"inputs": [{"name": "x", "datatype": "INT32", "shape": [2, 2], "data": data}]}).encode()
    assert request_from_http(body, None, "m").inputs[0].data.tolist() == [[1, 2], [3, 4]]


@pytest.mark.parametrize("datatype, value, prefix", [("INT32", 1, "Unable to parse 'data': "), ("BYTES", "a", "")])
def test_data_nested_100_arrays_deep_is_refused_with_tritons_message(datatype, value, prefix):
    def nested(depth):
        data = [value]
        for _ in range(depth - 1):
            data = [data]
        return json.dumps({"inputs": [{"name": "x", "datatype": datatype, "shape": [1], "data": data}]}).encode()

    assert request_from_http(nested(99), None, "m").inputs[0].data.reshape(-1).tolist() == [
        value if datatype == "INT32" else value.encode()]
    with pytest.raises(InvalidArgError) as info:
        request_from_http(nested(100), None, "m")
    assert info.value.message == prefix + "JSON nesting depth exceeds maximum allowed limit (100)"


def test_raw_binary_requests_take_name_type_and_shape_from_the_config():
    row = np.arange(6, dtype=np.float32)
    request = raw_request(row.tobytes(), "m", "1", [("IN", "FP32", (-1,))], batching=True)
    assert request.inputs[0].shape == (1, 6) and request.parameters == {"binary_data_output": True}
    np.testing.assert_array_equal(request.inputs[0].data, row[None, :])
    text = raw_request(b"hello", "m", "1", [("T", "BYTES", (1,))], batching=False)
    assert text.inputs[0].shape == (1,) and text.inputs[0].data.tolist() == [b"hello"]
    with pytest.raises(InvalidArgError, match="can not be deduced because there are more than one variable-sized"):
        raw_request(b"", "m", "1", [("IN", "FP32", (-1, -1))], batching=False)


def test_the_listener_refuses_a_body_over_its_limit_while_it_arrives():
    async def http(method, path, headers, body):
        return 200, [], b"read %d bytes" % len(body)

    async def grpc(method, payload):
        raise AssertionError("no gRPC here")

    async def call(head: bytes, body: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # Over the listener's port as the front sends it: with the server's front key.
        writer.write(head.replace(b"\r\n", b"\r\nrayinfer-front-key: %b\r\n" % (b"0f" * 32), 1) + body)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(4096), 5)
        writer.close()
        return answer

    async def run() -> None:
        nonlocal port
        listener = ReplicaListener(grpc, http, max_input_size=1000, front_key="0f" * 32)
        port = await listener.start("127.0.0.1")
        ok = await call(b"POST /v2/models/m/infer HTTP/1.1\r\ncontent-length: 1000\r\n\r\n", b"a" * 1000)
        assert ok.endswith(b"read 1000 bytes")
        announced = await call(b"POST /v2/models/m/infer HTTP/1.1\r\ncontent-length: 1001\r\n\r\n", b"a" * 10)
        chunked = await call(b"POST /v2/models/m/infer HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n",
                             b"400\r\n" + b"a" * 1024 + b"\r\n")
        for answer, size in ((announced, " of 1001 bytes"), (chunked, "")):
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400 ") and b"connection: close" in head
            assert json.loads(body) == {"error": f"Request JSON size{size} exceeds the maximum allowed value of 1000 "
                                                 "bytes. Use --http-max-input-size to increase the limit."}
        await listener.close(1.0)

    port = 0
    asyncio.run(run())
