"""Python models written the way Triton's own test models are: a ``unittest`` run inside
``execute`` (its result the model's output), BLS calls from a model, a batch whose requests
fail one by one, an ``async def execute`` whose requests overlap, and a decoupled BLS call the
caller cancels. Loaded by their tests (tests/compat/test_python_qa.py), not at start."""

from __future__ import annotations

QA_MODELS: dict[str, tuple[str, str]] = {}

# Runs the model's own unittest classes when called with no inputs, as Triton's python_unittest
# models do (``unittest.main('model', exit=False)``, which reads sys.argv and imports the model's
# module by its file's name). The "tests" parameter names the test classes to run (all by
# default); REPORT holds the runner's text, for the test's message. "exit": the model calls
# sys.exit() instead.
QA_MODELS["qa_unittest"] = ("""name: "qa_unittest"
backend: "python"
max_batch_size: 0
output [ { name: "OUTPUT0" data_type: TYPE_FP16 dims: [ 1 ] }, { name: "REPORT" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
""", '''import io
import json
import sys
import unittest

import numpy as np
import triton_python_backend_utils as pb_utils


class ArgumentValidation(unittest.TestCase):
    """Triton's bindings are typed: a wrong argument is a TypeError, an empty tensor Triton's own error."""

    def test_infer_request_args(self):
        tensor = pb_utils.Tensor("INPUT0", np.array([[1, 2]], dtype=np.int32))
        with self.assertRaises(pb_utils.TritonModelException) as caught:
            pb_utils.InferenceRequest(inputs=[None], model_name="my_model", requested_output_names=["out"])
        self.assertIn("Input tensor for request with id '' and model name 'my_model' should not be empty.",
                      str(caught.exception))
        for wrong in ({"inputs": None}, {"model_name": None}, {"requested_output_names": [None]},
                      {"requested_output_names": None}, {"correleation_id": None}, {"request_id": None},
                      {"model_version": None}, {"flags": None}):
            arguments = {"inputs": [tensor], "model_name": "my_model", "requested_output_names": ["out"], **wrong}
            with self.assertRaises(TypeError, msg=str(wrong)):
                pb_utils.InferenceRequest(**arguments)
        pb_utils.InferenceRequest(requested_output_names=[], inputs=[], model_name="my_model")

    def test_infer_response_args(self):
        with self.assertRaises(pb_utils.TritonModelException):
            pb_utils.InferenceResponse(output_tensors=[None])
        with self.assertRaises(TypeError):
            pb_utils.InferenceResponse(output_tensors=None)
        pb_utils.InferenceResponse(output_tensors=[])
        pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.zeros(2, np.float32))])

    def test_tensor_args(self):
        array = np.array([[1, 2]], dtype=np.int32)
        for arguments in ((None, array), ("OUTPUT0", None), ("", None)):
            with self.assertRaises(TypeError, msg=repr(arguments)):
                pb_utils.Tensor(*arguments)
        with self.assertRaises(pb_utils.TritonModelException):
            pb_utils.Tensor.from_dlpack("OUTPUT0", None)
        with self.assertRaises(pb_utils.TritonModelException):
            pb_utils.Tensor.from_dlpack("", None)

    def test_log_args(self):
        logger = pb_utils.Logger
        for level in (None, 1):
            with self.assertRaises(TypeError):
                logger.log("Invalid Level", level)
        for log in (logger.log_info, logger.log_warn, logger.log_error, logger.log_verbose):
            with self.assertRaises(TypeError):
                log(None)
        logger.log("Level unspecified")


class CustomMetrics(unittest.TestCase):
    """pb_utils.MetricFamily and Metric by Triton's rules (what the metrics port shows is
    checked by the test, which can wait for the replica's report)."""

    def test_counter_and_gauge(self):
        self.families = []
        for kind in (pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE):
            family = pb_utils.MetricFamily(name=f"qa_metric_{int(kind)}", description="end to end", kind=kind)
            self.families.append(family)
            metric = family.Metric(labels={"example1": "label1"})
            self.assertEqual(metric.value(), 0.0)
            metric.increment(2023.0)
            self.assertEqual(metric.value(), 2023.0)
            if kind == pb_utils.MetricFamily.COUNTER:
                for call in (lambda: metric.increment(-23.5), lambda: metric.set(999.9)):
                    with self.assertRaises(pb_utils.TritonModelException):
                        call()
            else:
                metric.increment(-23.5)
                self.assertEqual(metric.value(), 1999.5)
                metric.set(999.9)
                self.assertEqual(metric.value(), 999.9)
            with self.assertRaises(pb_utils.TritonModelException):
                metric.observe(0.05)
        QaState.kept += self.families  # the test reads them on the metrics port

    def test_histogram(self):
        family = pb_utils.MetricFamily("qa_histogram", "histogram end to end", pb_utils.MetricFamily.HISTOGRAM)
        metric = family.Metric(labels={"example1": "label1"}, buckets=[0.1, 1.0, 2.5, 5.0, 10.0])
        for call in (metric.value, lambda: metric.increment(2023.0), lambda: metric.set(999.9)):
            with self.assertRaises(pb_utils.TritonModelException):
                call()
        for value in (0.05, 1.5, 6.0):
            metric.observe(value)
        for wrong in ({}, {"buckets": None}, {"buckets": [2.5, 0.1, 1.0, 10.0, 5.0]}, {"buckets": [1, 1, 2, 5, 5]}):
            with self.assertRaises(pb_utils.TritonModelException, msg=str(wrong)):
                family.Metric(labels={}, **wrong)
        family.Metric(labels={}, buckets=[])
        QaState.kept.append(family)

    def test_same_name(self):
        first = pb_utils.MetricFamily("qa_same_name", "first description", pb_utils.MetricFamily.COUNTER)
        with self.assertRaises(pb_utils.TritonModelException):
            pb_utils.MetricFamily("qa_same_name", "first description", pb_utils.MetricFamily.GAUGE)
        second = pb_utils.MetricFamily("qa_same_name", "second description", pb_utils.MetricFamily.COUNTER)
        one, two = first.Metric(labels={"k": "v"}), second.Metric(labels={"k": "v"})
        one.increment(7.5)
        self.assertEqual(two.value(), 7.5)  # the same labels share one value
        del first
        with self.assertRaises(pb_utils.TritonModelException) as caught:
            one.increment(1)
        self.assertIn("Invalid metric operation as the corresponding 'MetricFamily' has been deleted.",
                      str(caught.exception))
        two.increment(1)
        QaState.kept.append(second)


class BlsCalls(unittest.TestCase):
    """BLS requests to models that reschedule their requests, and one with a large tensor."""

    def test_rescheduled(self):
        request = pb_utils.InferenceRequest(model_name="iter_countdown", requested_output_names=["OUT"],
                                            inputs=[pb_utils.Tensor("IN", np.array([3], np.int32))])
        response = request.exec()
        self.assertFalse(response.has_error(), response.error() and response.error().message())
        self.assertEqual(pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()[0], 3)

    def test_rescheduled_decoupled(self):
        request = pb_utils.InferenceRequest(model_name="iter_stream", requested_output_names=["OUT"],
                                            inputs=[pb_utils.Tensor("IN", np.array([3], np.int32))])
        seen = []
        for response in request.exec(decoupled=True):
            self.assertFalse(response.has_error(), response.error() and response.error().message())
            if response.output_tensors():
                seen.append(int(pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()[0]))
        self.assertEqual(seen, [2, 1, 0])

    def test_not_iterative(self):
        request = pb_utils.InferenceRequest(model_name="iter_not_iterative", requested_output_names=["OUT"],
                                            inputs=[pb_utils.Tensor("IN", np.array([3], np.int32))])
        response = request.exec()
        self.assertTrue(response.has_error())

    def test_large_tensor(self):
        array = np.random.rand(1, 64 * 1024 * 1024).astype(np.float32)  # 256 MiB, past any message limit
        request = pb_utils.InferenceRequest(model_name="qa_identity_fp32", requested_output_names=["OUTPUT0"],
                                            inputs=[pb_utils.Tensor("INPUT0", array)])
        response = request.exec()
        self.assertFalse(response.has_error(), response.error() and response.error().message())
        self.assertTrue(np.array_equal(pb_utils.get_output_tensor_by_name(response, "OUTPUT0").as_numpy(), array))


class QaState:
    kept = []  # metric families the tests leave for the metrics port


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            parameters = json.loads(request.parameters())
            if parameters.get("exit"):
                sys.exit(int(parameters["exit"]))
            names = parameters.get("tests")
            stream = io.StringIO()
            test = unittest.main("model", defaultTest=names.split(",") if names else None, exit=False,
                                 testRunner=unittest.TextTestRunner(stream=stream))
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", np.array([test.result.wasSuccessful()], dtype=np.float16)),
                pb_utils.Tensor("REPORT", np.array([stream.getvalue().encode()], dtype=object))]))
        return responses
''')

QA_MODELS["qa_identity_fp32"] = ("""name: "qa_identity_fp32"
backend: "python"
max_batch_size: 64
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU } ]
""", '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0")
                                                            .as_numpy())]) for r in requests]
''')

# Requests 0 and 2 of each batch get an error (request 0 with its outputs too); the others
# their input back (Triton's execute_error model as its lifecycle test uses it).
QA_MODELS["qa_batch_error"] = ("""name: "qa_batch_error"
backend: "python"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
dynamic_batching { preferred_batch_size: [ 3 ] max_queue_delay_microseconds: 5000000 }
instance_group [ { kind: KIND_CPU } ]
""", '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for index, request in enumerate(requests):
            out = pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(request, "IN").as_numpy())
            error = pb_utils.TritonError("An error occurred during execution")
            if index == 0:
                responses.append(pb_utils.InferenceResponse([out], error))
            elif index == 2:
                responses.append(pb_utils.InferenceResponse(error=error))
            else:
                responses.append(pb_utils.InferenceResponse([out]))
        return responses
''')

# An async decoupled model that waits WAIT_SECONDS per row, then answers each request once.
QA_MODELS["qa_async_decoupled"] = ("""name: "qa_async_decoupled"
backend: "python"
max_batch_size: 8
model_transaction_policy { decoupled: true }
input [ { name: "WAIT_SECONDS" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "DUMMY_OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
""", '''import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        waits = [asyncio.sleep(float(w)) for r in requests
                 for w in pb_utils.get_input_tensor_by_name(r, "WAIT_SECONDS").as_numpy().reshape(-1)]
        await asyncio.gather(*waits)
        for request in requests:
            rows = pb_utils.get_input_tensor_by_name(request, "WAIT_SECONDS").as_numpy().shape[0]
            request.get_response_sender().send(
                pb_utils.InferenceResponse([pb_utils.Tensor("DUMMY_OUT", np.zeros((rows, 1), np.float32))]),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
''')

# An async decoupled model whose requests each make a decoupled BLS call to qa_async_decoupled
# (which sends its one response with the final flag), as Triton's async_execute_decouple_bls
# does; it answers with the number of responses the call's iteration gave.
QA_MODELS["qa_async_decoupled_bls"] = ("""name: "qa_async_decoupled_bls"
backend: "python"
max_batch_size: 8
model_transaction_policy { decoupled: true }
input [ { name: "WAIT_SECONDS" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "DUMMY_OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
""", '''import asyncio

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def _one(self, request):
        call = pb_utils.InferenceRequest(model_name="qa_async_decoupled", requested_output_names=["DUMMY_OUT"],
                                         inputs=[pb_utils.get_input_tensor_by_name(request, "WAIT_SECONDS")])
        count = sum(1 for _ in await call.async_exec(decoupled=True))  # iterated as Triton's model does
        request.get_response_sender().send(
            pb_utils.InferenceResponse([pb_utils.Tensor("DUMMY_OUT", np.array([[count]], np.float32))]),
            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    async def execute(self, requests):
        await asyncio.gather(*[self._one(r) for r in requests])
        return None
''')

# A model whose readiness check is named is_model_ready (as in Triton's readiness test models)
# and says it is not ready.
QA_MODELS["qa_is_model_ready"] = ("""name: "qa_is_model_ready"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 8 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 8 ] } ]
""", '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0")
                                                            .as_numpy())]) for r in requests]

    def is_model_ready(self):
        return False
''')

# Decoupled: sends INPUT back every DELAY ms until MAX_RESPONSE_COUNT responses, or until the
# request is cancelled (then an error with code CANCELLED), unless IGNORE_CANCEL.
QA_MODELS["qa_until_cancelled"] = ("""name: "qa_until_cancelled"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "MAX_RESPONSE_COUNT" data_type: TYPE_INT32 dims: [ 1 ] },
        { name: "DELAY" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "IGNORE_CANCEL" data_type: TYPE_BOOL dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
""", '''import threading
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.send, args=(request,), daemon=True).start()
        return None

    def send(self, request):
        value = pb_utils.get_input_tensor_by_name(request, "INPUT")
        count = int(pb_utils.get_input_tensor_by_name(request, "MAX_RESPONSE_COUNT").as_numpy()[0])
        delay = int(pb_utils.get_input_tensor_by_name(request, "DELAY").as_numpy()[0])
        ignore = bool(pb_utils.get_input_tensor_by_name(request, "IGNORE_CANCEL").as_numpy()[0])
        sender = request.get_response_sender()
        for sent in range(1, count + 1):
            if not ignore and request.is_cancelled():
                error = pb_utils.TritonError(message="request has been cancelled", code=pb_utils.TritonError.CANCELLED)
                sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if sent == count else 0
            try:
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", value.as_numpy())]), flags=flags)
            except pb_utils.TritonModelException:  # the call was cancelled and is gone
                return
            time.sleep(delay / 1000)  # the model's pace (DELAY), so that its caller's cancel() comes between sends
''')

# Calls qa_until_cancelled by decoupled BLS and cancels the call once the sum of its responses
# reaches MAX_SUM; answers the sum, whether the callee said it was cancelled, and what cancel()
# after the end and a second time did.
QA_MODELS["qa_bls_cancel"] = ("""name: "qa_bls_cancel"
backend: "python"
max_batch_size: 0
input [ { name: "MAX_SUM" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "IGNORE_CANCEL" data_type: TYPE_BOOL dims: [ 1 ] } ]
output [ { name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "IS_CANCELLED" data_type: TYPE_BOOL dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
""", '''import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            max_sum = int(pb_utils.get_input_tensor_by_name(request, "MAX_SUM").as_numpy()[0])
            ignore = pb_utils.get_input_tensor_by_name(request, "IGNORE_CANCEL").as_numpy()
            inputs = [pb_utils.Tensor("INPUT", np.array([1], np.int32)),
                      pb_utils.Tensor("MAX_RESPONSE_COUNT", np.array([20], np.int32)),
                      pb_utils.Tensor("DELAY", np.array([50], np.int32)), pb_utils.Tensor("IGNORE_CANCEL", ignore)]
            stream = pb_utils.InferenceRequest(model_name="qa_until_cancelled", inputs=inputs,
                                               requested_output_names=["OUTPUT"]).exec(decoupled=True)
            total, cancelled, error = 0, False, None
            for response in stream:
                if response.has_error():
                    if response.error().code() == pb_utils.TritonError.CANCELLED:
                        cancelled = True
                    else:
                        error = response.error()
                    break
                if not response.output_tensors():  # the final flag, sent alone
                    continue
                total += int(pb_utils.get_output_tensor_by_name(response, "OUTPUT").as_numpy()[0])
                if total >= max_sum:
                    stream.cancel()
            stream.cancel()  # after the end: nothing happens
            outputs = [pb_utils.Tensor("SUM", np.array([total], np.int32)),
                       pb_utils.Tensor("IS_CANCELLED", np.array([cancelled]))]
            responses.append(pb_utils.InferenceResponse(outputs, error))
        return responses
''')
