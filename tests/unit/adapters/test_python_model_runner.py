"""The Python backend without Ray: triton_python_backend_utils, loading a model.py, and running
it as the serving core's executor (one answer per request, decoupled streams, finalize)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from rayinfer.adapters.loader import load_runner
from rayinfer.adapters.python_backend import triton_python_backend_utils as pb_utils
from rayinfer.protocol.errors import ModelConfigError, ServingError
from rayinfer.protocol.types import InferInput, InferRequest
from rayinfer.serving.model_core import ModelCore

IO = ('input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
      'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]\n')


def write(root: Path, name: str, code: str, config: str = "", files: dict[str, str] | None = None) -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "python"\n{config}')
    (root / name / "1" / "model.py").write_text(code)
    for relative, text in (files or {}).items():
        (root / name / relative).write_text(text)


def request(value: int, batched: bool = True) -> InferRequest:
    shape = (1, 1) if batched else (1,)
    return InferRequest("m", inputs=[InferInput("IN", "INT32", shape, np.full(shape, value, dtype=np.int32))])


def test_bytes_tensors_round_trip_as_triton_serializes_them() -> None:
    values = np.array([b"a", b"", "\u00fc".encode()], dtype=object)
    encoded = pb_utils.serialize_byte_tensor(values)
    assert encoded.dtype == np.uint8 and encoded[:4].tobytes() == (1).to_bytes(4, "little")
    assert pb_utils.deserialize_bytes_tensor(encoded).tolist() == values.tolist()


def test_type_helpers() -> None:
    assert pb_utils.triton_string_to_numpy("TYPE_FP32") is np.float32
    assert pb_utils.numpy_to_triton_type(np.int64) == 9
    assert pb_utils.triton_to_numpy_type(13) is np.object_
    assert pb_utils.using_decoupled_model_transaction_policy({"model_transaction_policy": {"decoupled": True}})
    tensor = pb_utils.Tensor("X", np.array(["ab"]))
    assert tensor.as_numpy().tolist() == [b"ab"] and tensor.triton_dtype() == 13
    assert pb_utils.Tensor.from_dlpack("Y", np.arange(3)).as_numpy().tolist() == [0, 1, 2]


def test_auto_complete_refuses_to_contradict_the_config() -> None:
    config = pb_utils.ModelConfig({"name": "m", "max_batch_size": 4, "input": [{"name": "IN", "data_type": "TYPE_FP32",
                                                                                   "dims": [2]}]})
    config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [2]})  # the same: fine
    with pytest.raises(pb_utils.TritonModelException, match="dims"):
        config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [3]})
    with pytest.raises(pb_utils.TritonModelException, match="max_batch_size"):
        config.set_max_batch_size(8)


IDENTITY = '''import triton_python_backend_utils as pb_utils
from helper import twice

class TritonPythonModel:
    finalized = []

    def execute(self, requests):
        if len(requests) == 3:
            return []  # the wrong number of responses
        out = []
        for r in requests:
            value = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if (value < 0).any():
                raise ValueError("negative")
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", twice(value))]))
        return out

    def finalize(self):
        import helper
        helper.FINALIZED.append(True)
'''


def test_a_model_runs_its_batch_and_each_failure_stays_in_its_execution(tmp_path: Path) -> None:
    write(tmp_path, "m", IDENTITY, "max_batch_size: 4\n" + IO,
          {"1/helper.py": "FINALIZED = []\n\ndef twice(x):\n    return x * 2\n"})
    runner, entry = load_runner(tmp_path, "m", 1)
    ok = runner.execute([runner.prepare(request(2)), runner.prepare(request(5))])
    assert [r.outputs[0].data.tolist() for r in ok] == [[[4]], [[10]]]
    failed = runner.execute([runner.prepare(request(-1)), runner.prepare(request(1))])
    assert all(isinstance(r, ServingError) and "ValueError: negative" in r.message for r in failed)
    wrong = runner.execute([runner.prepare(request(1)) for _ in range(3)])
    assert all("returned 0 responses for 3 requests" in r.message for r in wrong)
    assert runner.stats.snapshot()["durations"]["success"][0] == 2
    runner.close()
    import helper  # the model's helper module, imported from its version folder
    assert helper.FINALIZED == [True]


def test_initialize_failure_names_the_model_and_the_error(tmp_path: Path) -> None:
    write(tmp_path, "broken", "class TritonPythonModel:\n    def initialize(self, args):\n        raise KeyError('w')\n"
          "    def execute(self, requests):\n        return []\n", IO)
    with pytest.raises(ServingError, match="Failed to initialize model 'broken': KeyError"):
        load_runner(tmp_path, "broken", 1)
    write(tmp_path, "noclass", "x = 1\n", IO)
    with pytest.raises(ModelConfigError, match="TritonPythonModel"):
        load_runner(tmp_path, "noclass", 1)


REPEAT = '''import threading
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            count = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])

            def answer(sender=sender, count=count):
                for n in range(count):
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([n], np.int32))]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

            threading.Thread(target=answer).start()
        return None
'''


def test_a_decoupled_model_streams_through_its_response_sender(tmp_path: Path) -> None:
    write(tmp_path, "repeat", REPEAT, IO + "model_transaction_policy { decoupled: true }\n")
    runner, entry = load_runner(tmp_path, "repeat", 1)

    async def main() -> list[list[int]]:
        core = ModelCore(runner, entry.versions)
        answers = []
        for count in (3, 0):
            answers.append([int(r.outputs[0].data[0]) async for r in core.stream(core.prepare(request(count, False)))])
        core.close()
        return answers

    assert asyncio.run(main()) == [[0, 1, 2], []]


def test_metric_families_follow_tritons_rules() -> None:
    counter = pb_utils.MetricFamily("unit_requests", "Requests", pb_utils.MetricFamily.COUNTER)
    metric = counter.Metric(labels={"route": "a"})
    before, _ = pb_utils.metrics_snapshot()
    metric.increment(2)
    assert metric.value() == 2 and counter.Metric(labels={"route": "a"}).value() == 2  # the same labels, one value
    with pytest.raises(pb_utils.TritonModelException):
        metric.increment(-1)
    with pytest.raises(pb_utils.TritonModelException):
        metric.set(3)
    level = pb_utils.MetricFamily("unit_level", "Level", pb_utils.MetricFamily.GAUGE)
    gauge = level.Metric()
    gauge.set(7)
    gauge.increment(-2)
    assert gauge.value() == 5
    sizes_family = pb_utils.MetricFamily("unit_sizes", "Sizes", pb_utils.MetricFamily.HISTOGRAM)
    histogram = sizes_family.Metric(buckets=[1, 4])
    for value in (0.5, 3, 9):
        histogram.observe(value)
    version, families = pb_utils.metrics_snapshot()
    assert version > before
    sizes = next(f for f in families if f["name"] == "unit_sizes")["metrics"][0]
    assert (sizes["counts"], sizes["count"], sizes["sum"]) == ([1, 1], 3, 12.5)
    with pytest.raises(pb_utils.TritonModelException, match="already exists as a counter"):
        pb_utils.MetricFamily("unit_requests", "Requests", pb_utils.MetricFamily.GAUGE)
    again = pb_utils.MetricFamily("unit_requests", "Another description", pb_utils.MetricFamily.COUNTER)
    del counter
    assert again.description == "Requests"  # the first one's, which it shares
    with pytest.raises(pb_utils.TritonModelException, match="'MetricFamily' has been deleted"):
        metric.increment(1)
    with pytest.raises(pb_utils.TritonModelException, match="Missing required buckets"):
        sizes_family.Metric()
    with pytest.raises(pb_utils.TritonModelException, match="increasing order"):
        sizes_family.Metric(buckets=[1, 1, 2])


def test_model_readiness_asks_the_models_is_ready(tmp_path: Path) -> None:
    code = ('import triton_python_backend_utils as pb_utils\n\nclass TritonPythonModel:\n'
            '    answer = True\n\n    def is_ready(self):\n        if self.answer is None:\n'
            '            raise RuntimeError("broken")\n        return self.answer\n\n'
            '    def execute(self, requests):\n        return []\n')
    write(tmp_path, "ready", code, IO)
    runner, entry = load_runner(tmp_path, "ready", 1)

    async def readiness() -> list[bool]:
        core = ModelCore(runner, entry.versions)
        seen = []
        for answer in (True, False, None):
            runner.adapter.model.answer = answer
            seen.append(await core.ready())
        core.close()
        return seen

    assert asyncio.run(readiness()) == [True, False, False]


RESCHEDULING = '''import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            if value > 0:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], np.int32))])
                             if value != 1 else None)
        return responses
'''


def test_a_rescheduled_request_is_marked_to_run_again_or_gets_tritons_error(tmp_path: Path) -> None:
    """set_release_flags(RESCHEDULE): with iterative_sequence the request's result says so (its
    response must be None: Triton's message otherwise); without it, Triton's error."""
    from rayinfer.adapters.model_runner import RESCHEDULED

    write(tmp_path, "iterative", RESCHEDULING, IO + "sequence_batching { iterative_sequence: true }\n")
    write(tmp_path, "plain", RESCHEDULING, IO)
    iterative, _ = load_runner(tmp_path, "iterative", 1)
    again, wrong, done = iterative.execute([iterative.prepare(request(v, batched=False)) for v in (1, 2, 0)])
    assert again is RESCHEDULED and done.outputs[0].data.tolist() == [0]
    assert wrong.message == ("Expected a None object in the execute function return list for reschduled request, "
                             "found type 'InferenceResponse'.")
    plain, _ = load_runner(tmp_path, "plain", 1)
    [refused] = plain.execute([plain.prepare(request(1, batched=False))])
    assert refused.code.name == "INVALID_ARG" and "while the model is not configured to handle such a flag" in refused.message
    for runner in (iterative, plain):
        runner.close()
