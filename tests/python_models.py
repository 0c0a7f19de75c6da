"""Python-backend models of the test repository: Triton's python_backend examples in this
project's own words, plus models for each rule of the backend under test."""

from __future__ import annotations

import base64
import hashlib
import io
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from python_bls_models import BLS_MODELS
from python_qa_models import QA_MODELS
from python_rules_models import RULES_MODELS

ANCHOR_MODELS = Path(__file__).resolve().parents[2] / "shared" / "anchors" / "models"
# Loaded by tests through the repository API, not at start.
NOT_LOADED_AT_START = ("py_init_fail", "py_env_broken", "py_autoscaled", "py_scale_to_zero", "py_pooled_a",
                       "py_pooled_b", *QA_MODELS)

MODELS: dict[str, tuple[str, str]] = {}

# Triton's add_sub example: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1, FP32 [4];
# the arithmetic lives in a helper module beside model.py (the version folder is on sys.path).
MODELS["py_add_sub"] = ("""name: "py_add_sub"
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] } ]
instance_group [ { kind: KIND_CPU } ]
""", '''import json

import triton_python_backend_utils as pb_utils
from arithmetic import add_and_subtract


class TritonPythonModel:
    def initialize(self, args):
        self.model_config = json.loads(args["model_config"])
        self.output_dtypes = [
            pb_utils.triton_string_to_numpy(pb_utils.get_output_config_by_name(self.model_config, name)["data_type"])
            for name in ("OUTPUT0", "OUTPUT1")
        ]
        self.args = args

    def execute(self, requests):
        responses = []
        for request in requests:
            in0 = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            in1 = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            total, difference = add_and_subtract(in0, in1)
            out0 = pb_utils.Tensor("OUTPUT0", total.astype(self.output_dtypes[0]))
            out1 = pb_utils.Tensor("OUTPUT1", difference.astype(self.output_dtypes[1]))
            responses.append(pb_utils.InferenceResponse(output_tensors=[out0, out1],
                                                        parameters={"instance": self.args["model_instance_name"]}))
        return responses

    def finalize(self):
        pb_utils.Logger.log_info("py_add_sub finalized")
''')

# Triton's auto_complete example: the config names no tensors and no batch size.
MODELS["py_auto_complete"] = ("""name: "py_auto_complete"
backend: "python"
""", '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        auto_complete_model_config.add_input({"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]})
        auto_complete_model_config.add_output({"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]})
        auto_complete_model_config.set_max_batch_size(8)
        auto_complete_model_config.set_dynamic_batching()
        return auto_complete_model_config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0")
                                                            .as_numpy() * 2)]) for r in requests]
''')

# Errors: a negative first element is an error response (that request only), zero raises
# (every request of that execution fails); dynamic batching puts both in one execution.
MODELS["py_errors"] = ("""name: "py_errors"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
dynamic_batching { max_queue_delay_microseconds: 200000 }
""", '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if (value == 0).any():
                raise pb_utils.TritonModelException("zero is not allowed")
            if (value < 0).any():
                error = pb_utils.TritonError("negative input", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(error=error))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", value)]))
        return responses
''')

MODELS["py_init_fail"] = ("""name: "py_init_fail"
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
""", '''class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("the weights are missing")

    def execute(self, requests):
        return []
''')

# BYTES in and out, config parameters and request parameters, a helper module from the model
# folder, pb_utils.get_model_dir() and async execute.
MODELS["py_strings"] = ("""name: "py_strings"
backend: "python"
max_batch_size: 4
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "UPPER" data_type: TYPE_STRING dims: [ -1 ] }, { name: "SEEN" data_type: TYPE_STRING dims: [ 1 ] } ]
parameters: { key: "suffix" value: { string_value: "!" } }
""", '''import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from text_tools import shout


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.suffix = config["parameters"]["suffix"]["string_value"]
        self.model_dir = pb_utils.get_model_dir()

    async def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            upper = np.array([[shout(v, self.suffix) for v in row] for row in text], dtype=object)
            seen = {"parameters": json.loads(request.parameters()), "model_dir": os.path.basename(self.model_dir),
                    "outputs": request.requested_output_names()}
            rows = np.array([[json.dumps(seen, sort_keys=True).encode()]] * len(text), dtype=object)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("UPPER", upper),
                                                         pb_utils.Tensor("SEEN", rows)]))
        return responses
''')

# Triton's decoupled repeat example: one response per element of IN, sent from a thread of the
# model's own after execute returned, then the final flag.
MODELS["py_repeat"] = ("""name: "py_repeat"
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
""", '''import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        if not pb_utils.using_decoupled_model_transaction_policy(__import__("json").loads(args["model_config"])):
            raise pb_utils.TritonModelException("py_repeat must be decoupled")
        self.threads = []

    def execute(self, requests):
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            thread = threading.Thread(target=self.repeat, args=(request.get_response_sender(), values))
            thread.start()
            self.threads.append(thread)
        return None

    def repeat(self, sender, values):
        for index, value in enumerate(values):
            sender.send(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", np.array([value], dtype=np.int32)),
                pb_utils.Tensor("IDX", np.array([index], dtype=np.uint32)),
            ]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        for thread in self.threads:
            thread.join()
''')

# Triton's custom_metrics example: a counter per request (labelled), a gauge of the last input
# and a histogram of the inputs, created in initialize.
MODELS["py_metrics"] = ("""name: "py_metrics"
backend: "python"
max_batch_size: 4
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1 ] } ]
""", '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        labels = {"model": args["model_name"], "version": args["model_version"]}
        # A metric works while its family object lives (Triton's rule): the model keeps both.
        self.families = [
            pb_utils.MetricFamily(name="py_metrics_requests", description="Requests this model executed",
                                  kind=pb_utils.MetricFamily.COUNTER),
            pb_utils.MetricFamily(name="py_metrics_last_input", description="The last input",
                                  kind=pb_utils.MetricFamily.GAUGE),
            pb_utils.MetricFamily(name="py_metrics_inputs", description="Inputs seen",
                                  kind=pb_utils.MetricFamily.HISTOGRAM),
        ]
        self.requests = self.families[0].Metric(labels=labels)
        self.last = self.families[1].Metric(labels=labels)
        self.values = self.families[2].Metric(labels=labels, buckets=[1.0, 10.0])

    def execute(self, requests):
        responses = []
        for request in requests:
            value = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            self.requests.increment(1)
            self.last.set(float(value.reshape(-1)[-1]))
            for v in value.reshape(-1):
                self.values.observe(float(v))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", value)]))
        return responses
''')

# Cancellation: a response every 10 ms until the client cancels (is_cancelled()), which the
# model counts in a metric of its own, then the final flag.
# The logging extension reaching a replica: whether this replica's model logger would write a
# verbose (DEBUG) line and an INFO line now, and an INFO line "log probe <IN>" in the log
# (tests/compat/test_logging_extension.py).
MODELS["py_log_probe"] = ("""name: "py_log_probe"
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "VERBOSE" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "INFO" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
""", '''import logging

import numpy as np
import triton_python_backend_utils as pb_utils


def would_log(level):
    logger = logging.getLogger("triton_python_backend_utils")
    record = logging.LogRecord(logger.name, level, __file__, 0, "probe", None, None)
    return int(logger.isEnabledFor(level) and bool(logger.filter(record)))


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            marker = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            pb_utils.Logger.log_info(f"log probe {marker}")
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("VERBOSE", np.array([would_log(logging.DEBUG)], np.int32)),
                pb_utils.Tensor("INFO", np.array([would_log(logging.INFO)], np.int32)),
            ]))
        return responses
''')

MODELS["py_cancel"] = ("""name: "py_cancel"
backend: "python"
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
""", '''import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.cancelled_family = pb_utils.MetricFamily(
            name="py_cancel_cancelled", description="Requests the client cancelled", kind=pb_utils.MetricFamily.COUNTER)
        self.cancelled = self.cancelled_family.Metric(labels={"model": "py_cancel"})

    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.stream, args=(request,), daemon=True).start()
        return None

    def stream(self, request):
        sender = request.get_response_sender()
        deadline = time.monotonic() + 60
        while not sender.is_cancelled() and time.monotonic() < deadline:
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1], dtype=np.int32))]))
            time.sleep(0.01)  # the model's own pace: a response every 10 ms, as a generator streams
        if request.is_cancelled():
            self.cancelled.increment(1)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
''')

# A model's own packages: a wheel named in requirements.txt beside model.py (a Ray pip runtime
# environment), and Triton's EXECUTION_ENV_PATH (a conda-pack-style tarball).
PROBE_MODEL = '''import numpy as np
import triton_python_backend_utils as pb_utils
from {module} import VALUE


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() + np.int32(VALUE))]) for r in requests]
'''
PROBE_IO = """input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""
MODELS["py_env_pip"] = ('name: "py_env_pip"\nbackend: "python"\n' + PROBE_IO,
                        PROBE_MODEL.format(module="rayinfer_wheel_probe"))
MODELS["py_env_broken"] = ('name: "py_env_broken"\nbackend: "python"\n' + PROBE_IO,
                           PROBE_MODEL.format(module="rayinfer_wheel_probe"))
MODELS["py_env_tarball"] = ('name: "py_env_tarball"\nbackend: "python"\n' + PROBE_IO + """parameters: {
  key: "EXECUTION_ENV_PATH" value: { string_value: "$$TRITON_MODEL_DIRECTORY/probe_env.tar.gz" } }
""", PROBE_MODEL.format(module="rayinfer_env_probe"))

# is_ready(): the model is not ready while a file named "not_ready" lies in its folder.
MODELS["py_ready"] = ('name: "py_ready"\nbackend: "python"\n' + PROBE_IO, '''import os

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def is_ready(self):
        return not os.path.exists(os.path.join(pb_utils.get_model_dir(), "not_ready"))

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN")
                                                            .as_numpy())]) for r in requests]
''')

MODELS.update(BLS_MODELS)
MODELS.update(RULES_MODELS)
MODELS.update(QA_MODELS)

HELPERS = {
    ("py_add_sub", "1/arithmetic.py"): "def add_and_subtract(a, b):\n    return a + b, a - b\n",
    # In the model folder, not the version folder: both are on sys.path.
    ("py_strings", "text_tools.py"): (
        "def shout(value, suffix):\n    return value.decode('utf-8').upper().encode('utf-8') + suffix.encode()\n"
    ),
    # No index: the wheel is all pip needs (the tests run without a network).
    ("py_env_pip", "1/requirements.txt"): "--no-index\n./wheels/rayinfer_wheel_probe-1.0-py3-none-any.whl  # local\n",
    # A requirement pip cannot install (no index, no such package).
    ("py_env_broken", "1/requirements.txt"): "--no-index\nrayinfer-no-such-package==9.9\n",
}


def write_wheel(folder: Path, package: str, code: str) -> Path:
    """A pure-Python wheel of one package, written by hand (no build tools, no network)."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{package}-1.0.dist-info"
    files = {
        f"{package}/__init__.py": code,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {package.replace('_', '-')}\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: rayinfer-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    path = folder / f"{package}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)
    return path


def write_env_tarball(path: Path, module: str, code: str) -> None:
    """A conda-pack-style environment holding one module, for this interpreter's Python."""
    site = f"lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages/{module}.py"
    data = code.encode()
    with tarfile.open(path, "w:gz") as tar:
        member = tarfile.TarInfo(site)
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))


# Autoscaled from one to two replicas (rayinfer's autoscaling parameters), quick to react; each
# request takes 0.1 s and answers with the PID of the replica that ran it.
MODELS["py_autoscaled"] = ("""name: "py_autoscaled"
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "autoscaling_max_replicas" value: { string_value: "2" } }
parameters { key: "autoscaling_target_ongoing_requests" value: { string_value: "1" } }
parameters { key: "autoscaling_upscale_delay_s" value: { string_value: "0" } }
parameters { key: "autoscaling_downscale_delay_s" value: { string_value: "1" } }
parameters { key: "autoscaling_look_back_period_s" value: { string_value: "2" } }
""", '''import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.1 * len(requests))  # the model's work: 0.1 s a request
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PID", np.array([os.getpid()], np.int64))])
                for _ in requests]
''')


# Scales to zero after 1 s idle, and back to one replica on the next request.
MODELS["py_scale_to_zero"] = (MODELS["py_autoscaled"][0].replace("py_autoscaled", "py_scale_to_zero").replace(
    'parameters { key: "autoscaling_max_replicas" value: { string_value: "2" } }',
    'parameters { key: "autoscaling_min_replicas" value: { string_value: "0" } }\n'
    'parameters { key: "autoscaling_max_replicas" value: { string_value: "1" } }\n'
    'parameters { key: "autoscaling_downscale_to_zero_delay_s" value: { string_value: "1" } }'),
    MODELS["py_autoscaled"][1])

# test_model_pool: two Python models in the model pool's one process. OUT = IN + the config's
# offset (a: 1, b: 10), or with the request parameter "via", IN + offset + what that model answers
# for IN (a BLS call); DIR is pb_utils.get_model_dir(); each request counts in a custom metric
# labelled with the model and the request parameter "tag".
POOLED_PY = """import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.offset = int(config["parameters"]["offset"]["string_value"])
        self.family = pb_utils.MetricFamily("pooled_python_requests", "requests of a pooled Python model",
                                            pb_utils.MetricFamily.COUNTER)
        self.name = args["model_name"]
        self.requests = {}  # the metric of each request parameter "tag"

    def execute(self, requests):
        responses = []
        for request in requests:
            parameters = json.loads(request.parameters())
            tag = parameters.get("tag", "")
            if tag not in self.requests:
                self.requests[tag] = self.family.Metric(labels={"model": self.name, "tag": tag})
            self.requests[tag].increment(1)
            value = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy() + self.offset
            via = parameters.get("via")
            if via:
                answer = pb_utils.InferenceRequest(model_name=via, requested_output_names=["OUT"],
                                                   inputs=[pb_utils.get_input_tensor_by_name(request, "IN")]).exec()
                if answer.has_error():
                    responses.append(pb_utils.InferenceResponse(error=answer.error()))
                    continue
                value = value + pb_utils.get_output_tensor_by_name(answer, "OUT").as_numpy()
            folder = np.array([[pb_utils.get_model_dir().encode()]] * len(value), dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", value.astype(np.int32)),
                                                         pb_utils.Tensor("DIR", folder)]))
        return responses
"""

for _name, _offset in (("py_pooled_a", 1), ("py_pooled_b", 10)):
    MODELS[_name] = (f"""name: "{_name}"
backend: "python"
max_batch_size: 4
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }}, {{ name: "DIR" data_type: TYPE_STRING dims: [ 1 ] }} ]
parameters {{ key: "offset" value: {{ string_value: "{_offset}" }} }}
parameters {{ key: "rayinfer_hosting" value: {{ string_value: "pool" }} }}
""", POOLED_PY)


def write_python_models(root: Path) -> None:
    """Write the models above, and the Triton anchor's Python models when ../shared is there
    (``identity_fp32`` and ``mlp_onnx``, unmodified, with the MLP's weights built)."""
    for name, (config, code) in MODELS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
        (root / name / "1" / "model.py").write_text(code)
    for (name, relative), code in HELPERS.items():
        (root / name / relative).write_text(code)
    write_wheel(root / "py_env_pip" / "1" / "wheels", "rayinfer_wheel_probe", "VALUE = 7\n")
    write_env_tarball(root / "py_env_tarball" / "probe_env.tar.gz", "rayinfer_env_probe", "VALUE = 5\n")
    if ANCHOR_MODELS.is_dir():
        for name in ("identity_fp32", "mlp_onnx"):
            shutil.copytree(ANCHOR_MODELS / name, root / name)
        build = root / "_weights"
        build.mkdir()
        shutil.copytree(ANCHOR_MODELS / "mlp_onnx", build / "mlp_onnx")
        shutil.copy(ANCHOR_MODELS / "make_mlp_onnx.py", build)
        subprocess.run([sys.executable, "make_mlp_onnx.py"], cwd=build, check=True, capture_output=True)
        shutil.copy(build / "mlp_onnx" / "1" / "model.onnx", root / "mlp_onnx" / "1" / "model.onnx")
        shutil.rmtree(build)
