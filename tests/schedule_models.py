"""A model of the test repository for Triton's schedule policy: priority levels, a bounded queue
and queue timeouts (tests/compat/test_schedule_policy.py).

``sched`` answers each request with the order in which it executed. A request whose ``HOLD`` is
1 holds the model (its one instance) until the test creates the file ``release`` in the model's
folder, so later requests queue behind it for as long as the test needs; while it holds, the
file ``holding`` exists.
"""

from __future__ import annotations

from pathlib import Path

from rayinfer.cluster.model_files import write_python_model

SCHED_CONFIG = """name: "sched"
backend: "python"
max_batch_size: 1
input [ { name: "HOLD" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "ORDER" data_type: TYPE_INT32 dims: [ 1 ] } ]
dynamic_batching {
  priority_levels: 2
  default_priority_level: 2
  # Level 1 queues one request at most; every level's requests may shorten the one-minute timeout.
  priority_queue_policy { key: 1 value: { max_queue_size: 1 } }
  default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 60000000 allow_timeout_override: true }
}
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

SCHED_MODEL = '''import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils

HOLD_LIMIT_S = 60.0


class TritonPythonModel:
    def initialize(self, args):
        self.folder = args["model_repository"]  # the model's own folder
        self.executed = 0

    def execute(self, requests):
        responses = []
        for request in requests:
            self.executed += 1
            order = self.executed
            if int(pb_utils.get_input_tensor_by_name(request, "HOLD").as_numpy()[0, 0]):
                self.hold()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("ORDER", np.array([[order]], np.int32))]))
        return responses

    def hold(self):
        holding = os.path.join(self.folder, "holding")
        release = os.path.join(self.folder, "release")
        open(holding, "w").close()
        deadline = time.monotonic() + HOLD_LIMIT_S
        try:
            while not os.path.exists(release) and time.monotonic() < deadline:
                time.sleep(0.005)  # the test's signal is a file: polled
        finally:
            os.remove(holding)
'''


def write_schedule_models(root: Path) -> None:
    write_python_model(root, "sched", SCHED_CONFIG, SCHED_MODEL)
