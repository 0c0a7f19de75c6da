"""A model with rayinfer's autoscaling parameters, under load through the front (the calls
Serve does not see itself): Serve adds a replica, and removes it once the load is gone."""

from __future__ import annotations

import threading
import time

import numpy as np
import tritonclient.http as httpclient

import tritonclient.grpc as grpcclient

from conftest import LOAD_TIMEOUT_S, pids_titled, tensor
from waiting import wait_until

MODEL = "py_autoscaled"
TO_ZERO = "py_scale_to_zero"
# A new replica is a new process: on a busy 2-core machine its start has taken over 90 s.
SCALE_TIMEOUT_S = 240


def pid_of(client, model: str = MODEL) -> int:
    """The PID of the replica that answered (``client``: tritonclient.http's or .grpc's)."""
    module = httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient
    return int(client.infer(model, [tensor(module, "INPUT0", np.array([1], np.int32), "INT32")]).as_numpy("PID")[0])


def test_a_model_scales_up_under_load_through_the_front_and_down_after_it(server):
    control = httpclient.InferenceServerClient(server["url"], network_timeout=LOAD_TIMEOUT_S)
    control.load_model(MODEL)
    seen: set[int] = set()
    done = threading.Event()

    def load() -> None:  # one of 4 clients calling back to back (0.1 s a call: 4 in flight)
        client = httpclient.InferenceServerClient(server["url"])
        deadline = time.monotonic() + SCALE_TIMEOUT_S
        while not done.is_set() and time.monotonic() < deadline:
            seen.add(pid_of(client))
        client.close()

    clients = [threading.Thread(target=load) for _ in range(4)]
    try:
        for client in clients:
            client.start()
        wait_until(lambda: len(seen) == 2, "a second replica to answer under load", timeout_s=SCALE_TIMEOUT_S)
        done.set()
        for client in clients:
            client.join()
        # One call at a time, 1 in flight: back to one replica after the 1 s downscale delay.
        wait_until(lambda: len({pid_of(control) for _ in range(16)}) == 1, "the model to scale back to one replica",
                   timeout_s=SCALE_TIMEOUT_S, interval_s=1.0)
    finally:
        done.set()
        for client in clients:
            if client.is_alive():
                client.join()
        control.unload_model(MODEL)


def test_an_idle_model_scales_to_zero_and_its_next_request_waits_for_a_replica(server):
    """Beyond Triton: ``autoscaling_min_replicas`` 0. The model stays loaded and ready with no
    replica; a request over either protocol then waits for a new one instead of failing."""
    http = httpclient.InferenceServerClient(server["url"], network_timeout=LOAD_TIMEOUT_S)
    grpc = grpcclient.InferenceServerClient(server["grpc_url"])
    http.load_model(TO_ZERO)
    replicas = f"ray::ServeReplica:{TO_ZERO}:"
    try:
        first = pid_of(http, TO_ZERO)
        for client in (http, grpc):
            wait_until(lambda: not pids_titled(replicas), f"'{TO_ZERO}' to scale to zero", timeout_s=60)
            assert http.is_model_ready(TO_ZERO) and grpc.is_model_ready(TO_ZERO)
            assert {m["name"]: m["state"] for m in http.get_model_repository_index()}[TO_ZERO] == "READY"
            answered = pid_of(client, TO_ZERO)  # waits for the replica Serve starts for it
            assert answered != first and pids_titled(replicas) == {answered}
            first = answered
    finally:
        http.unload_model(TO_ZERO)
