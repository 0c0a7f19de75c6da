"""Triton's vLLM backend as a Python model: what a ``backend: "vllm"`` model runs.

The model's ``<version>/model.json`` holds vLLM's engine arguments (``AsyncEngineArgs``, as in
Triton: ``{"model": "facebook/opt-125m", "gpu_memory_utilization": 0.5}``). Its tensors are the
vLLM backend's, which auto-complete adds to a config that leaves them out: ``text_input``;
optional ``stream``, ``sampling_parameters`` (a JSON object of vLLM's ``SamplingParams``, each
value cast to the field's type, so ``"max_tokens": "16"`` is taken), ``exclude_input_in_output``
and the ``return_*`` flags; answers ``text_output`` and, when asked, ``finish_reason``,
``cumulative_logprob``, ``logprobs``, ``num_input_tokens``, ``num_output_tokens``. A streamed
request gets each new piece of text as it is made, the last with the final flag; any other, one
response with the whole text (after the prompt, unless ``exclude_input_in_output``). The
request's own parameters give sampling parameters ``sampling_parameters`` leaves out (the
generate extension's members). A cancelled request is aborted in the engine.

The engine runs on an event loop of its own thread; ``execute`` hands each request to it and
returns (the model is decoupled), so requests are batched by vLLM's scheduler as they come.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

FLAGS = ("exclude_input_in_output", "return_finish_reason", "return_cumulative_logprob", "return_logprobs",
         "return_num_input_tokens", "return_num_output_tokens")
INPUTS = [
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]},
    {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    *({"name": flag, "data_type": "TYPE_BOOL", "dims": [1], "optional": True} for flag in FLAGS),
]
OUTPUTS = [
    {"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "cumulative_logprob", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": [-1]},
]
# SamplingParams fields whose values are cast from what the JSON gives (Triton's rule), by the
# field's annotation (a type, or its spelling where the annotations are strings).
_CASTS = {"int": int, "float": float, "str": str, "Optional[int]": int, "int | None": int,
          "bool": lambda v: v.strip().lower() in ("true", "1") if isinstance(v, str) else bool(v)}


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        for kind, tensors, add in (("input", INPUTS, config.add_input), ("output", OUTPUTS, config.add_output)):
            given = {t.get("name") for t in config.as_dict().get(kind, [])}
            for tensor in tensors:
                if tensor["name"] not in given:
                    add(tensor)
        config.set_model_transaction_policy({"decoupled": True})
        config.set_max_batch_size(0)
        return config

    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not config.get("model_transaction_policy", {}).get("decoupled"):
            raise pb_utils.TritonModelException(
                "vLLM Triton backend must be configured to use decoupled model transaction policy")
        path = os.path.join(args["model_repository"], args["model_version"], "model.json")
        with open(path, encoding="utf-8") as file:
            self.engine_arguments = json.load(file)
        self.outputs = {o["name"] for o in config.get("output", [])}
        self.logger = pb_utils.Logger
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-engine", daemon=True)
        self.thread.start()
        self.engine = asyncio.run_coroutine_threadsafe(self._start_engine(), self.loop).result()
        from vllm import SamplingParams

        self.sampling_fields = {name: _spelling(hint) for cls in reversed(SamplingParams.__mro__)
                                for name, hint in getattr(cls, "__annotations__", {}).items()}
        self.sampling_class = SamplingParams

    async def _start_engine(self):
        from vllm import AsyncEngineArgs, AsyncLLMEngine

        return AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**self.engine_arguments))

    def execute(self, requests):
        for request in requests:
            asyncio.run_coroutine_threadsafe(self._answer(request), self.loop)
        return None

    def sampling_params(self, request):
        """The request's SamplingParams: ``sampling_parameters``, then its own parameters for
        the fields that leaves out; each value cast to its field's type."""
        given = {}
        tensor = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
        if tensor is not None:
            raw = tensor.as_numpy().reshape(-1)[0]
            given = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
        for key, value in json.loads(request.parameters() or "{}").items():
            given.setdefault(key, value)
        settings = {}
        for key, value in given.items():
            if key not in self.sampling_fields:
                continue  # not a sampling parameter (a generate request's other members)
            cast = _CASTS.get(self.sampling_fields[key])
            settings[key] = cast(value) if cast is not None and value is not None else value
        return self.sampling_class(**settings)

    async def _answer(self, request):
        sender = request.get_response_sender()
        request_id = uuid.uuid4().hex
        try:
            prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0]
            prompt = prompt.decode("utf-8") if isinstance(prompt, bytes) else str(prompt)
            stream = _flag(request, "stream")
            excluded = pb_utils.get_input_tensor_by_name(request, "exclude_input_in_output")
            prepend = not _flag(request, "exclude_input_in_output") if excluded is not None else not stream
            if prepend and stream:
                raise ValueError("When streaming, `exclude_input_in_output` = False is not allowed.")
            wanted = {flag: _flag(request, flag) for flag in FLAGS}
            sampling = self.sampling_params(request)
            sent = {"text": [], "tokens": [], "logprobs": []}  # per output: how much went out already
            last = None
            async for output in self.engine.generate(prompt, sampling, request_id):
                if sender.is_cancelled():
                    await self.engine.abort(request_id)
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        "Request was cancelled", pb_utils.TritonError.CANCELLED)),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    return
                last = output
                if stream:
                    final = output.finished
                    sender.send(self._response(output, wanted, sent, prompt if prepend else None),
                                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
                    prepend = False
                    if final:
                        return
            if last is None:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            elif stream:  # the engine ended without a finished output
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                sender.send(self._response(last, wanted, {"text": [], "tokens": [], "logprobs": []},
                                           prompt if prepend else None),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:
            self.logger.log_error(f"[vllm] Error generating stream: {exc}")
            sender.send(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("text_output", np.array([b"N/A"], dtype=object))],
                error=pb_utils.TritonError(f"Error generating stream: {exc}")),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _response(self, output, wanted, sent, prompt):
        """One response: each of the output's sequences' text (and counts) since ``sent``."""
        texts, finish, cumulative, logprobs, counts = [], [], [], [], []
        for index, sequence in enumerate(output.outputs):
            while len(sent["text"]) <= index:
                for key in sent:
                    sent[key].append(0)
            text = sequence.text[sent["text"][index]:]
            texts.append(((prompt or "") + text).encode("utf-8"))
            sent["text"][index] = len(sequence.text)
            finish.append(str(sequence.finish_reason).encode())
            cumulative.append(sequence.cumulative_logprob or 0.0)
            if sequence.logprobs is None:
                logprobs.append(b"null")
            else:
                new = sequence.logprobs[sent["logprobs"][index]:]
                sent["logprobs"][index] = len(sequence.logprobs)
                logprobs.append(json.dumps([{str(token): {"logprob": entry.logprob, "rank": entry.rank,
                                                          "decoded_token": entry.decoded_token}
                                             for token, entry in position.items()} for position in new]).encode())
            counts.append(len(sequence.token_ids) - sent["tokens"][index])
            sent["tokens"][index] = len(sequence.token_ids)
        tensors = [pb_utils.Tensor("text_output", np.array(texts, dtype=object))]
        extra = (("return_finish_reason", "finish_reason", np.array(finish, dtype=object)),
                 ("return_cumulative_logprob", "cumulative_logprob", np.array(cumulative, dtype=np.float32)),
                 ("return_logprobs", "logprobs", np.array(logprobs, dtype=object)),
                 ("return_num_input_tokens", "num_input_tokens",
                  np.array([len(output.prompt_token_ids or ())], dtype=np.uint32)),
                 ("return_num_output_tokens", "num_output_tokens", np.array(counts, dtype=np.uint32)))
        tensors += [pb_utils.Tensor(name, value) for flag, name, value in extra if wanted[flag] and name in self.outputs]
        return pb_utils.InferenceResponse(tensors)

    def finalize(self):
        shutdown = getattr(self.engine, "shutdown", None)
        if shutdown is not None:
            self.loop.call_soon_threadsafe(shutdown)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


def _spelling(hint):
    """An annotation as written: ``int``, ``Optional[int]`` (a string annotation as it is)."""
    if isinstance(hint, str):
        return hint.replace("typing.", "")
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")


def _flag(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return tensor is not None and bool(tensor.as_numpy().reshape(-1)[0])
