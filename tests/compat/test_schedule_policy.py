"""Triton's schedule policy through unmodified tritonclient, over HTTP and gRPC: a higher-priority
request overtakes queued lower ones, a full queue answers UNAVAILABLE at once, a request whose
queue timeout expires is rejected without running, and a request whose client goes away (an HTTP
disconnect, a gRPC cancel) leaves the queue without running (the ``sched`` model,
tests/schedule_models.py).
"""

from __future__ import annotations

import concurrent.futures
import json
import queue
import re
import socket
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import tensor
from waiting import wait_until

MODEL = "sched"


def url_of(module, server: dict) -> str:
    return server["url"] if module is httpclient else server["grpc_url"]


def order(module, server: dict, hold: int = 0, **options) -> int:
    """One request on its own connection; the order in which the model executed it."""
    client = module.InferenceServerClient(url_of(module, server))
    try:
        result = client.infer(MODEL, [tensor(module, "HOLD", np.array([[hold]], np.int32), "INT32")], **options)
        return int(result.as_numpy("ORDER")[0, 0])
    finally:
        client.close()


def metric(server: dict, name: str, **labels: str) -> float:
    with urllib.request.urlopen(server["metrics_url"], timeout=10) as response:
        text = response.read().decode()
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted({"model": MODEL, "version": "1", **labels}.items()))
    match = re.search(rf"^{name}\{{{re.escape(wanted)}\}} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def wait_queued(server: dict, count: int, what: str) -> None:
    """Until the model's pending-request gauge reads ``count``. The gauge follows the replica's
    reports, in order: a test first waits for 0 (nothing queued behind the holding request), so
    that a reading left from an earlier test is not taken for its own."""
    wait_until(lambda: metric(server, "nv_inference_pending_request_count") == count, what)


class Holder:
    """A first request holding the model, so that later ones queue until :meth:`release`."""

    def __init__(self, module, server: dict, folder: Path, pool: concurrent.futures.Executor):
        self.folder = folder
        (folder / "release").unlink(missing_ok=True)
        self.first = pool.submit(order, module, server, 1)
        wait_until(lambda: (folder / "holding").exists() or self.first.done(), "the first request to hold the model")
        assert not self.first.done(), self.first.result()
        wait_queued(server, 0, "no request to be queued behind the holding one")

    def release(self) -> int:
        (self.folder / "release").touch()
        return self.first.result(timeout=60)


@pytest.fixture(params=["http", "grpc"])
def module(request):
    return httpclient if request.param == "http" else grpcclient


@pytest.fixture
def pool(model_repository):
    with concurrent.futures.ThreadPoolExecutor(8) as executor:
        try:
            yield executor
        finally:  # a test that failed while the model was held lets it go
            (model_repository / MODEL / "release").touch()


def test_a_higher_priority_request_overtakes_queued_lower_ones(module, server, model_repository, pool):
    holder = Holder(module, server, model_repository / MODEL, pool)
    low = [pool.submit(order, module, server) for _ in range(2)]  # the default level, 2
    wait_queued(server, 2, "the two low-priority requests to be queued")
    high = pool.submit(order, module, server, priority=1)
    wait_queued(server, 3, "the high-priority request to be queued")
    first = holder.release()
    assert high.result(timeout=60) == first + 1
    assert sorted(f.result(timeout=60) for f in low) == [first + 2, first + 3]


def test_a_full_queue_answers_unavailable_at_once(module, server, model_repository, pool):
    holder = Holder(module, server, model_repository / MODEL, pool)
    both = [pool.submit(order, module, server, priority=1) for _ in range(2)]  # level 1 queues one
    refused = next(concurrent.futures.as_completed(both, timeout=60))
    with pytest.raises(InferenceServerException) as info:
        refused.result()
    assert info.value.message().endswith("Exceeds maximum queue size")
    assert info.value.message().startswith("[request id: ")
    assert info.value.status() == ("503" if module is httpclient else "StatusCode.UNAVAILABLE")
    first = holder.release()
    assert [f.result(timeout=60) for f in both if f is not refused] == [first + 1]


def test_an_expired_request_is_rejected_without_running(module, server, model_repository, pool):
    rejected = metric(server, "nv_inference_request_failure", reason="REJECTED")
    holder = Holder(module, server, model_repository / MODEL, pool)
    with pytest.raises(InferenceServerException) as info:
        order(module, server, timeout=100_000)  # microseconds: shorter than the default minute
    assert info.value.message() == "Request timeout expired"
    assert info.value.status() == ("503" if module is httpclient else "StatusCode.UNAVAILABLE")
    assert not holder.first.done()  # answered while the model was still held
    first = holder.release()
    assert order(module, server) == first + 1  # the rejected request never executed
    wait_until(lambda: metric(server, "nv_inference_request_failure", reason="REJECTED") == rejected + 1,
               "the rejection to be counted with reason REJECTED")


def test_priority_and_timeout_of_the_wrong_type_are_refused(server):
    client = httpclient.InferenceServerClient(server["url"])
    inputs = [tensor(httpclient, "HOLD", np.array([[0]], np.int32), "INT32")]
    with pytest.raises(InferenceServerException) as info:
        client.infer(MODEL, inputs, priority=-1)
    assert info.value.message() == (
        "Unable to parse 'priority': attempt to access JSON non-unsigned-integer as unsigned-integer")
    client.close()


def test_a_client_that_disconnects_leaves_the_queue_without_running(server, model_repository, pool):
    canceled = metric(server, "nv_inference_request_failure", reason="CANCELED")
    holder = Holder(httpclient, server, model_repository / MODEL, pool)
    body = json.dumps({"inputs": [{"name": "HOLD", "datatype": "INT32", "shape": [1, 1], "data": [0]}]}).encode()
    host, port = server["url"].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(b"POST /v2/models/sched/infer HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%b" % (host.encode(), len(body), body))
        wait_queued(server, 1, "the request to be queued")
    wait_until(lambda: metric(server, "nv_inference_request_failure", reason="CANCELED") == canceled + 1,
               "the cancelled request to be counted with reason CANCELED")
    first = holder.release()
    assert order(httpclient, server) == first + 1  # the cancelled request never executed


def test_a_grpc_cancel_leaves_the_queue_without_running(server, model_repository, pool):
    canceled = metric(server, "nv_inference_request_failure", reason="CANCELED")
    holder = Holder(grpcclient, server, model_repository / MODEL, pool)
    client = grpcclient.InferenceServerClient(server["grpc_url"])
    answers: queue.Queue = queue.Queue()
    call = client.async_infer(MODEL, [tensor(grpcclient, "HOLD", np.array([[0]], np.int32), "INT32")],
                              callback=lambda result, error: answers.put(error))
    wait_queued(server, 1, "the request to be queued")
    call.cancel()
    assert "CANCELLED" in str(answers.get(timeout=60))
    wait_until(lambda: metric(server, "nv_inference_request_failure", reason="CANCELED") == canceled + 1,
               "the cancelled request to be counted with reason CANCELED")
    first = holder.release()
    assert order(grpcclient, server) == first + 1  # the cancelled request never executed
    client.close()
