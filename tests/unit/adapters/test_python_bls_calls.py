"""BLS without Ray: a model's requests to models through the BlsClient seam, served by the
serving core's ``execute_here`` (the path a model's call to itself takes in a replica)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rayinfer.adapters.loader import load_runner
from rayinfer.adapters.python_backend import bls
from rayinfer.adapters.python_backend import triton_python_backend_utils as pb_utils
from rayinfer.protocol.errors import NotFoundError, ServingError
from rayinfer.protocol.types import InferInput, InferRequest, InferResponse
from rayinfer.serving.model_core import ModelCore

IO = ('input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
      'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n')

DOUBLE = '''import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy() * 2)]) for r in requests]
'''

CALLER = '''import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            target = request.parameters()
            call = pb_utils.InferenceRequest(model_name=__import__("json").loads(target)["target"],
                                             inputs=[pb_utils.get_input_tensor_by_name(request, "IN")],
                                             requested_output_names=["OUT"])
            answer = await call.async_exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=answer.error()))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.get_output_tensor_by_name(answer, "OUT")]))
        return responses
'''


class InProcessClient:
    """The BlsClient seam served by ModelCores in this process."""

    def __init__(self, cores: dict[str, ModelCore]) -> None:
        self.cores = cores

    def stream(self, request: InferRequest) -> Iterator[InferResponse | ServingError]:
        core = self.cores.get(request.model_name)
        if core is None:
            raise NotFoundError(f"Request for unknown model: '{request.model_name}' is not found")
        return core.execute_here(request)

    def infer(self, request: InferRequest) -> InferResponse:
        result = next(iter(self.stream(request)))
        if isinstance(result, ServingError):
            raise result
        return result

    async def infer_async(self, request: InferRequest) -> InferResponse:
        return await asyncio.to_thread(self.infer, request)


def write(root: Path, name: str, code: str) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "python"\n{IO}')
    (root / name / "1" / "model.py").write_text(code)


def request(model: str, value: int, **parameters) -> InferRequest:
    return InferRequest(model, inputs=[InferInput("IN", "INT32", (1,), np.array([value], dtype=np.int32))],
                        parameters=parameters)


@pytest.fixture
def cores(tmp_path: Path):
    write(tmp_path, "double", DOUBLE)
    write(tmp_path, "caller", CALLER)

    async def build() -> dict[str, ModelCore]:
        return {name: ModelCore(load_runner(tmp_path, name, 1)[0], [1]) for name in ("double", "caller")}

    built = asyncio.run(build())
    bls.set_client(InProcessClient(built))
    yield built
    bls.set_client(None)
    for core in built.values():
        core.close()


def test_async_exec_answers_with_the_target_models_outputs(cores) -> None:
    [answer] = list(cores["caller"].execute_here(request("caller", 21, target="double")))
    assert answer.outputs[0].data.tolist() == [42]


def test_an_unknown_target_is_an_error_in_the_response_with_its_code(cores) -> None:
    [answer] = list(cores["caller"].execute_here(request("caller", 1, target="nope")))
    assert isinstance(answer, ServingError) and "'nope' is not found" in answer.message
    response = bls.to_inference_response(NotFoundError("gone"))
    assert response.has_error() and response.error().code() == pb_utils.TritonError.NOT_FOUND


def test_exec_outside_a_server_is_an_error_response() -> None:
    bls.set_client(None)
    call = pb_utils.InferenceRequest(model_name="x", inputs=[pb_utils.Tensor("IN", np.zeros(1, np.int32))])
    answer = call.exec()
    assert answer.has_error() and "need a running rayinfer server" in answer.error().message()
    with pytest.raises(pb_utils.TritonModelException, match="need a running rayinfer server"):
        pb_utils.is_model_ready("x")


def test_a_request_for_another_model_keeps_its_version_parameters_and_outputs() -> None:
    call = pb_utils.InferenceRequest(model_name="m", model_version=3, requested_output_names=["B"],
                                     inputs=[pb_utils.Tensor("A", np.array([b"x"], dtype=object))],
                                     parameters={"k": 1}, timeout=5)
    converted = bls.to_infer_request(call)
    assert (converted.model_name, converted.model_version) == ("m", "3")
    assert [o.name for o in converted.outputs] == ["B"] and converted.parameters == {"k": 1, "timeout": 5}
    assert converted.inputs[0].datatype == "BYTES"
    assert bls.to_infer_request(pb_utils.InferenceRequest(model_name="m")).model_version == ""
    # trace=request.trace(): the BLS request carries the traced request's link (None: not traced)
    untraced = pb_utils.InferenceRequest(model_name="m")
    assert untraced.trace().get_context() is None
    assert bls.to_infer_request(pb_utils.InferenceRequest(model_name="m", trace=untraced.trace())).trace_parent is None
    traced = pb_utils.InferenceRequest(model_name="m", trace=pb_utils.InferenceTrace("t-1;TIMESTAMPS;ens"))
    assert bls.to_infer_request(pb_utils.InferenceRequest(model_name="m", trace=traced.trace())).trace_parent == \
        "t-1;TIMESTAMPS;ens"


# Decoupled: IN responses; the final flag comes with the last one when the request's "flag"
# parameter is "with", else on its own after them.
REPEAT = '''import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            count = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            alone = __import__("json").loads(request.parameters()).get("flag") != "with"
            for i in range(count):
                last = i == count - 1 and not alone
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([i], np.int32))]),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0)
            if alone:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


def test_a_decoupled_calls_iteration_ends_with_the_response_that_carries_the_final_flag(tmp_path: Path) -> None:
    """As Triton's iterator: an empty last response only when the model sent the flag on its own."""
    write(tmp_path, "repeat", REPEAT)
    (tmp_path / "repeat" / "config.pbtxt").write_text(
        f'name: "repeat"\nbackend: "python"\nmodel_transaction_policy {{ decoupled: true }}\n{IO}')

    async def build() -> ModelCore:
        return ModelCore(load_runner(tmp_path, "repeat", 1)[0], [1])

    core = asyncio.run(build())
    bls.set_client(InProcessClient({"repeat": core}))
    try:
        def outputs(count: int, flag: str) -> list:
            call = pb_utils.InferenceRequest(model_name="repeat", parameters={"flag": flag},
                                             inputs=[pb_utils.Tensor("IN", np.array([count], np.int32))])
            return [[t.as_numpy().tolist() for t in r.output_tensors()] for r in call.exec(decoupled=True)]

        assert outputs(2, "with") == [[[0]], [[1]]]
        assert outputs(2, "alone") == [[[0]], [[1]], []]
        assert outputs(0, "alone") == [[]]
    finally:
        bls.set_client(None)
        core.close()
