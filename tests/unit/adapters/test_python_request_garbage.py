"""A Python model's requests leave no reference cycles behind: what a request made is freed when
its answer is sent. A cycle per request would be freed only by Python's garbage collector, whose
runs (triggered by the allocations it holds up) cost every request of the replica."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import numpy as np
import pytest

from rayinfer.adapters.loader import load_runner
from rayinfer.protocol.types import InferInput, InferRequest
from rayinfer.serving.model_core import ModelCore

IO = ('max_batch_size: 8\n'
      'input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
      'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n')

RETURNS = '''import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                .as_numpy())]) for r in requests]
'''

SENDS = '''import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                        .as_numpy())]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

MODELS = {
    "returns": (RETURNS, ""),
    "sends": (SENDS, ""),
    "decoupled": (SENDS, "model_transaction_policy { decoupled: true }\n"),
    "batched": (RETURNS, "dynamic_batching { max_queue_delay_microseconds: 200 }\n"),
}


def _request(value: int) -> InferRequest:
    return InferRequest("m", inputs=[InferInput("IN", "INT32", (1, 1), np.full((1, 1), value, dtype=np.int32))])


@pytest.mark.parametrize("model", sorted(MODELS))
def test_answered_requests_leave_no_cyclic_garbage(tmp_path: Path, model: str) -> None:
    code, config = MODELS[model]
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "config.pbtxt").write_text(f'name: "m"\nbackend: "python"\n{IO}{config}')
    (tmp_path / "m" / "1" / "model.py").write_text(code)
    runner, entry = load_runner(tmp_path, "m", 1)

    async def answers(core: ModelCore, count: int) -> list[int]:
        async def one(value: int) -> int:
            prepared = core.prepare(_request(value))
            if core.decoupled:
                results = [r async for r in core.stream(prepared)]
                return int(results[0].outputs[0].data[0, 0])
            return int((await core.infer(prepared)).outputs[0].data[0, 0])
        return list(await asyncio.gather(*(one(v) for v in range(count))))

    async def main() -> tuple[list[int], int]:
        core = ModelCore(runner, entry.versions)
        await answers(core, 16)  # the first requests make what the replica keeps (its threads, caches)
        gc.collect()
        gc.disable()
        try:
            values = await answers(core, 64)
            return values, gc.collect()
        finally:
            gc.enable()
            core.close()

    values, garbage = asyncio.run(main())
    assert values == list(range(64))
    assert garbage == 0, f"{garbage} objects in reference cycles after 64 requests"
