"""Python models of the test repository that call other models (BLS) or control them: Triton's
bls_sync, bls_async and bls_decoupled examples in this project's own words, a model calling
itself, and pb_utils' model control."""

from __future__ import annotations

BLS_MODELS: dict[str, tuple[str, str]] = {}

# Triton's bls_sync: the inputs go to the model named by MODEL_NAME; its outputs, or its error
# as this request's error.
BLS_MODELS["py_bls"] = ("""name: "py_bls"
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] },
        { name: "MODEL_NAME" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] }, { name: "OUTPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
""", '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            model_name = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME").as_numpy()[0].decode()
            inputs = [pb_utils.get_input_tensor_by_name(request, name) for name in ("INPUT0", "INPUT1")]
            bls_request = pb_utils.InferenceRequest(
                model_name=model_name, inputs=inputs, requested_output_names=["OUTPUT0", "OUTPUT1"],
                trace=request.trace())
            bls_response = bls_request.exec()
            if bls_response.has_error():
                responses.append(pb_utils.InferenceResponse(error=bls_response.error()))
                continue
            responses.append(pb_utils.InferenceResponse([
                pb_utils.get_output_tensor_by_name(bls_response, "OUTPUT0"),
                pb_utils.get_output_tensor_by_name(bls_response, "OUTPUT1"),
            ]))
        return responses
''')

# Triton's bls_async: two requests to py_add_sub in flight at once from an async execute.
BLS_MODELS["py_bls_async"] = ("""name: "py_bls_async"
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
""", '''import asyncio

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            in1 = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            forward = pb_utils.InferenceRequest(
                model_name="py_add_sub", requested_output_names=["OUTPUT0"],
                inputs=[pb_utils.Tensor("INPUT0", in0), pb_utils.Tensor("INPUT1", in1)])
            backward = pb_utils.InferenceRequest(
                model_name="py_add_sub", requested_output_names=["OUTPUT1"], model_version=1,
                inputs=[pb_utils.Tensor("INPUT0", in1), pb_utils.Tensor("INPUT1", in0)])
            first, second = await asyncio.gather(forward.async_exec(), backward.async_exec())
            for answer in (first, second):
                if answer.has_error():
                    raise pb_utils.TritonModelException(answer.error().message())
            responses.append(pb_utils.InferenceResponse([
                pb_utils.get_output_tensor_by_name(first, "OUTPUT0"),
                pb_utils.Tensor("OUTPUT1", pb_utils.get_output_tensor_by_name(second, "OUTPUT1").as_numpy()),
            ]))
        return responses
''')

# Triton's bls_decoupled: every response of the decoupled py_repeat, summed; with the request
# parameter "async" the call is async_exec(decoupled=True).
BLS_MODELS["py_bls_stream"] = ("""name: "py_bls_stream"
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]
""", '''import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            bls_request = pb_utils.InferenceRequest(
                model_name="py_repeat", requested_output_names=["OUT"],
                inputs=[pb_utils.get_input_tensor_by_name(request, "IN")])
            if json.loads(request.parameters()).get("async"):
                answers = await bls_request.async_exec(decoupled=True)
            else:
                answers = bls_request.exec(decoupled=True)
            total, count = 0, 0
            for answer in answers:
                if answer.has_error():
                    raise pb_utils.TritonModelException(answer.error().message())
                if answer.output_tensors():  # the last response is the empty final one
                    total += int(pb_utils.get_output_tensor_by_name(answer, "OUT").as_numpy()[0])
                    count += 1
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("SUM", np.array([total], dtype=np.int32)),
                pb_utils.Tensor("COUNT", np.array([count], dtype=np.int32)),
            ]))
        return responses
''')

# A model calling itself: TOTAL = DEPTH + DEPTH-1 + ... + 1, one BLS call per level, with
# dynamic batching (the execution making a call holds the model).
BLS_MODELS["py_bls_self"] = ("""name: "py_bls_self"
backend: "python"
max_batch_size: 8
input [ { name: "DEPTH" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "TOTAL" data_type: TYPE_INT32 dims: [ 1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 20000 }
""", '''import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            depth = pb_utils.get_input_tensor_by_name(request, "DEPTH").as_numpy()
            total = depth.copy()
            if int(depth[0, 0]) > 0:
                inner = pb_utils.InferenceRequest(model_name="py_bls_self", requested_output_names=["TOTAL"],
                                                  inputs=[pb_utils.Tensor("DEPTH", depth - 1)]).exec()
                if inner.has_error():
                    raise pb_utils.TritonModelException(inner.error().message())
                total += pb_utils.get_output_tensor_by_name(inner, "TOTAL").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("TOTAL", total.astype(np.int32))]))
        return responses
''')

# pb_utils model control: ACTION "load" / "unload" / "ready" on MODEL; READY is
# is_model_ready(MODEL) afterwards, a failed load or unload the request's error.
BLS_MODELS["py_control"] = ("""name: "py_control"
backend: "python"
input [ { name: "ACTION" data_type: TYPE_STRING dims: [ 1 ] }, { name: "MODEL" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "READY" data_type: TYPE_BOOL dims: [ 1 ] } ]
""", '''import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            action = pb_utils.get_input_tensor_by_name(request, "ACTION").as_numpy()[0].decode()
            model = pb_utils.get_input_tensor_by_name(request, "MODEL").as_numpy()[0].decode()
            try:
                if action == "load":
                    pb_utils.load_model(model_name=model)
                elif action == "unload":
                    pb_utils.unload_model(model_name=model)
            except pb_utils.TritonModelException as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(exc.message())))
                continue
            ready = pb_utils.is_model_ready(model_name=model)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("READY", np.array([ready]))]))
        return responses
''')
