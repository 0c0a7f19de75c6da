"""Python models of the test repository for the rules of Triton's Python backend that real
models lean on: a model with no inputs, answers through the response sender of a non-decoupled
model, response parameters, BF16 tensors, a decoupled model's concurrent async execute, the
final flag sent alone, BLS cancellation and user-defined readiness. Each model takes a ``mode``
request parameter; ``mode: errors`` answers with (and forgets) the messages of the exceptions
the model caught, Triton's own among them."""

from __future__ import annotations

RULES_MODELS: dict[str, tuple[str, str]] = {}

# No inputs at all (its logic needs none), non-decoupled; reads its readiness from a file.
RULES_MODELS["py_rules"] = ("""name: "py_rules"
backend: "python"
output [ { name: "OUT" data_type: TYPE_STRING dims: [ -1 ] } ]
""", '''import json
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def answer(*words):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([w.encode() for w in words], dtype=object))])


class TritonPythonModel:
    def initialize(self, args):
        self.errors = []
        self.threads = []
        # Triton's level constants, on the Logger as its binding exports them.
        levels = [pb_utils.Logger.INFO, pb_utils.Logger.WARNING, pb_utils.Logger.ERROR, pb_utils.Logger.VERBOSE]
        assert levels == [pb_utils.Logger.LogLevel.INFO, pb_utils.Logger.LogLevel.WARNING,
                          pb_utils.Logger.LogLevel.ERROR, pb_utils.Logger.LogLevel.VERBOSE]
        pb_utils.Logger.log("py_rules initialized", pb_utils.Logger.INFO)

    def is_ready(self):
        path = os.path.join(pb_utils.get_model_dir(), "ready_answer")
        text = open(path).read() if os.path.exists(path) else "true"
        if text == "raise":
            raise RuntimeError("readiness check failed on purpose")
        if text == "slow":
            time.sleep(8)
        return {"true": True, "false": False, "slow": True}.get(text, text)

    def execute(self, requests):
        return [self.answer(r) for r in requests]

    def caught(self, call):
        try:
            call()
        except pb_utils.TritonModelException as exc:
            self.errors.append(str(exc))

    def answer(self, request):
        mode = json.loads(request.parameters()).get("mode", "")
        if mode == "errors":
            errors, self.errors = self.errors, []
            return answer(*errors)
        if mode in ("sender_one", "sender_later", "sender_final_first", "sender_two", "sender_then_return"):
            sender = request.get_response_sender()
            if mode == "sender_one":
                sender.send(answer("sent"), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                self.caught(lambda: sender.send(answer("after final")))
            elif mode == "sender_later":  # after execute returned, from a thread of the model's
                thread = threading.Thread(target=lambda: (time.sleep(0.2), sender.send(
                    answer("sent later"), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)))
                thread.start()
                self.threads.append(thread)
            elif mode == "sender_final_first":
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)  # raises: the request fails
            elif mode == "sender_two":
                sender.send(answer("first"))
                sender.send(answer("second"))  # raises: the first response stays the answer
            else:
                sender.send(answer("sent, then returned"), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return answer("returned")
            return None
        if mode == "error_and_outputs":  # the error wins; the outputs are ignored
            return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([b"x"], dtype=object))],
                                              error=pb_utils.TritonError("an error beside outputs"))
        if mode == "parameters":
            for bad in ({"f": 1.5}, {"nested": {"a": 1}}, {"none": None}, {1: "int key"}):
                self.caught(lambda: pb_utils.InferenceResponse([], parameters=bad))
                self.caught(lambda: pb_utils.InferenceRequest(model_name="py_rules", parameters=bad))
            response = answer("parameters")
            return pb_utils.InferenceResponse(response.output_tensors(), parameters={"s": "x", "i": 3, "b": True})
        if mode == "bls_cancel":
            return self.bls_cancel()
        return answer("no inputs", str(len(request.inputs())))

    def bls_cancel(self):
        """A decoupled BLS call cancelled after its first response: how many came, and
        cancel() after the end and twice does nothing."""
        call = pb_utils.InferenceRequest(model_name="py_rules_decoupled", requested_output_names=["OUT"],
                                         parameters={"mode": "until_cancelled"})
        responses = call.exec(decoupled=True)
        first = next(responses)
        responses.cancel()
        responses.cancel()
        rest = list(responses)
        responses.cancel()
        return answer(first.output_tensors()[0].as_numpy()[0].decode(), str(len(rest)))

    def finalize(self):
        for thread in self.threads:
            thread.join()
''')

# Decoupled, with optional inputs only (a BF16 one), and async: executions overlap.
RULES_MODELS["py_rules_decoupled"] = ("""name: "py_rules_decoupled"
backend: "python"
input [ { name: "IN" data_type: TYPE_BF16 dims: [ -1 ] optional: true } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ -1 ] }, { name: "BF16_OUT" data_type: TYPE_BF16 dims: [ -1 ] } ]
model_transaction_policy { decoupled: true }
""", '''import asyncio
import json

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def answer(*words):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([w.encode() for w in words], dtype=object))])


class TritonPythonModel:
    def initialize(self, args):
        self.errors = []
        self.released = None
        self.cancelled_seen = []

    def execute(self, requests):
        # A coroutine for most modes (async execute, run in the background); for "return_value"
        # a plain return, which a decoupled model may not make.
        modes = [json.loads(r.parameters()).get("mode", "") for r in requests]
        if "return_value" in modes:
            return [answer("returned") for _ in requests]
        return self.run(requests, modes)

    async def run(self, requests, modes):
        for request, mode in zip(requests, modes):
            await self.answer(request, mode, request.get_response_sender())

    async def answer(self, request, mode, sender):
        if self.released is None:
            self.released = asyncio.Event()
        parameters = json.loads(request.parameters())
        if mode == "errors":
            errors, self.errors = self.errors + self.cancelled_seen, []
            self.cancelled_seen = []
            sender.send(answer(*errors), flags=FINAL)
        elif mode in ("count", "count_final_with_last"):
            n = int(parameters["n"])
            for i in range(n):
                last = mode == "count_final_with_last" and i == n - 1
                sender.send(answer(str(i)), flags=FINAL if last else 0)
            if mode == "count":
                sender.send(flags=FINAL)
            try:
                sender.send(answer("after final"))
            except pb_utils.TritonModelException as exc:
                self.errors.append(str(exc))
        elif mode == "wait":  # answered once a later request released it: executions overlap
            try:
                await asyncio.wait_for(self.released.wait(), 30)
                sender.send(answer("released"), flags=FINAL)
            except asyncio.TimeoutError:
                sender.send(answer("never released"), flags=FINAL)
            self.released = asyncio.Event()
        elif mode == "release":
            self.released.set()
            sender.send(answer("releasing"), flags=FINAL)
        elif mode == "raise":
            await asyncio.sleep(0)
            raise RuntimeError("async execute failed on purpose")
        elif mode == "until_cancelled":  # a BLS callee: responds until its caller cancels
            for i in range(200):
                if request.is_cancelled():
                    self.cancelled_seen.append(f"cancelled after {i}")
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        "cancelled", pb_utils.TritonError.CANCELLED)), flags=FINAL)
                    return
                sender.send(answer(f"response {i}"))
                await asyncio.sleep(0.05)
            sender.send(flags=FINAL)
        elif mode == "bf16":
            import torch

            tensor = pb_utils.get_input_tensor_by_name(request, "IN")
            try:
                tensor.as_numpy()
            except pb_utils.TritonModelException as exc:
                self.errors.append(str(exc))
            doubled = torch.utils.dlpack.from_dlpack(tensor.to_dlpack()) * 2
            assert doubled.dtype == torch.bfloat16
            sender.send(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", np.array([str(tensor.triton_dtype()).encode()], dtype=object)),
                pb_utils.Tensor.from_dlpack("BF16_OUT", torch.utils.dlpack.to_dlpack(doubled))]), flags=FINAL)
        else:
            sender.send(answer("inputs", str(len(request.inputs()))), flags=FINAL)
''')

# Readiness from an async is_ready.
RULES_MODELS["py_ready_async"] = ("""name: "py_ready_async"
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
""", '''import asyncio
import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def is_ready(self):
        await asyncio.sleep(0)
        return not os.path.exists(os.path.join(pb_utils.get_model_dir(), "not_ready"))

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy())]) for r in requests]
''')
