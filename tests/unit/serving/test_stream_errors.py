"""answer_stream's two rules for errors: a response's error_message (the stream goes on), or,
with the triton_grpc_error header, the end of the stream with the error's status."""

from __future__ import annotations

import asyncio

import pytest
from tritonclient.grpc import service_pb2 as pb

from rayinfer.protocol.errors import Code, NotFoundError, ServingError
from rayinfer.serving.stream_infer import answer_stream, ends_on_error


async def _requests(names: list[str]):
    for name in names:
        yield pb.ModelInferRequest(model_name=name)


async def _forward(request: pb.ModelInferRequest, read: tuple[int, int]):
    if request.model_name == "missing":
        raise NotFoundError("Request for unknown model: 'missing' is not found")
    if request.model_name == "fails":
        yield ServingError("the model failed", Code.INTERNAL)
        return
    yield request.model_name


def _answers(names: list[str], end_on_error: bool) -> list:
    async def run() -> list:
        return [r async for r in answer_stream(_requests(names), _forward, lambda m: f"error: {m}",
                                               lambda token, stamps: None, end_on_error)]

    return asyncio.run(run())


def test_errors_are_responses_and_the_stream_goes_on() -> None:
    assert _answers(["a", "missing", "fails", "b"], False) == [
        "a", "error: Request for unknown model: 'missing' is not found", "error: the model failed", "b"]


@pytest.mark.parametrize("names, code", [(["a", "missing", "b"], Code.NOT_FOUND), (["a", "fails", "b"], Code.INTERNAL)])
def test_with_triton_grpc_error_the_first_error_ends_the_stream(names: list[str], code: Code) -> None:
    received = []

    async def run() -> None:
        async for response in answer_stream(_requests(names), _forward, lambda m: m, lambda t, s: None, True):
            received.append(response)

    with pytest.raises(ServingError) as info:
        asyncio.run(run())
    assert info.value.code == code and received == ["a"]


def test_the_header_is_read_as_triton_reads_it() -> None:
    assert ends_on_error([(b"triton_grpc_error", b"true")]) and ends_on_error([("Triton_GRPC_Error", "True")])
    assert not ends_on_error([(b"triton_grpc_error", b"false")]) and not ends_on_error([])
