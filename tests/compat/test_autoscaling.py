"""A model with rayinfer's autoscaling parameters, under load through the front (the calls
Serve does not see itself): Serve adds a replica, and removes it once the load is gone."""

from __future__ import annotations

import threading
import time

import numpy as np
import tritonclient.http as httpclient

from conftest import tensor
from waiting import wait_until

MODEL = "py_autoscaled"


def pid_of(client: httpclient.InferenceServerClient) -> int:
    return int(client.infer(MODEL, [tensor(httpclient, "INPUT0", np.array([1], np.int32), "INT32")]).as_numpy("PID")[0])


def test_a_model_scales_up_under_load_through_the_front_and_down_after_it(server):
    control = httpclient.InferenceServerClient(server["url"], network_timeout=120.0)
    control.load_model(MODEL)
    seen: set[int] = set()
    done = threading.Event()

    def load() -> None:  # one of 4 clients calling back to back (0.1 s a call: 4 in flight)
        client = httpclient.InferenceServerClient(server["url"])
        deadline = time.monotonic() + 90
        while not done.is_set() and time.monotonic() < deadline:
            seen.add(pid_of(client))
        client.close()

    clients = [threading.Thread(target=load) for _ in range(4)]
    try:
        for client in clients:
            client.start()
        wait_until(lambda: len(seen) == 2, "a second replica to answer under load", timeout_s=90)
        done.set()
        for client in clients:
            client.join()
        # One call at a time, 1 in flight: back to one replica after the 1 s downscale delay.
        wait_until(lambda: len({pid_of(control) for _ in range(16)}) == 1, "the model to scale back to one replica",
                   timeout_s=90, interval_s=1.0)
    finally:
        done.set()
        for client in clients:
            if client.is_alive():
                client.join()
        control.unload_model(MODEL)
