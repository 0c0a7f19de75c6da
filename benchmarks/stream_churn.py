#!/usr/bin/env python3
"""Streams while models are loaded and unloaded: does every gRPC stream opened get its answer?

    .venv/bin/python benchmarks/stream_churn.py [--seconds 400]

Serves the example repository (explicit mode: simple and the Python model simple_identity
loaded at start) inside a private network namespace. One thread unloads and loads
simple_identity again and again (each change of applications makes Serve replace its HAProxy);
the main thread opens one gRPC stream (tritonclient.grpc, a new client each time), sends one
request to simple on it and waits up to 15 s for the answer, for ``--seconds``. Prints the
streams answered, failed (with each error) and unanswered, and the reloads done.
"""

from __future__ import annotations

import argparse
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from compare_triton import in_private_netns, reexec_in_netns, start_rayinfer, stop_server, wait_ready

from rayinfer.cluster.example_repository import write_example_repository

PORT = 18960
ANSWER_WAIT_S = 15.0


def churn(stop: threading.Event, reloads: list[int]) -> None:
    """Unload and load simple_identity until ``stop``; counts the reloads in ``reloads[0]``."""
    client = httpclient.InferenceServerClient(f"127.0.0.1:{PORT}", network_timeout=300)
    while not stop.is_set():
        try:
            client.unload_model("simple_identity")
            client.load_model("simple_identity")
            reloads[0] += 1
        except Exception as exc:  # reported, and the churn goes on
            print(time.strftime("%H:%M:%S"), "reload failed:", exc, flush=True)
            stop.wait(1)


def one_stream(inputs: list[grpcclient.InferInput]) -> str | None:
    """Open a stream, send one request to simple; None if answered, else what went wrong."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{PORT + 1}")
    answers: queue.Queue = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: answers.put(error), stream_timeout=ANSWER_WAIT_S + 5)
        client.async_stream_infer("simple", inputs)
        error = answers.get(timeout=ANSWER_WAIT_S)
        return None if error is None else f"error: {error}"
    except queue.Empty:
        return f"no answer within {ANSWER_WAIT_S:.0f} s"
    except Exception as exc:  # the stream failed before the request could be sent
        return f"error: {exc}"
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=400)
    args = parser.parse_args()
    if not in_private_netns():
        reexec_in_netns()
    repo = Path(tempfile.mkdtemp(prefix="stream-churn-"))
    write_example_repository(repo)
    proc = start_rayinfer(repo, PORT, repo / "rayinfer.log", ("--model-control-mode", "explicit", "--load-model", "simple",
                                                              "--load-model", "simple_identity"))
    ones = np.ones((1, 16), dtype=np.int32)
    inputs = [grpcclient.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(ones)
    counts = {"answered": 0, "failed": 0, "unanswered": 0}
    stop, reloads = threading.Event(), [0]
    reloader = threading.Thread(target=churn, args=(stop, reloads), daemon=True)
    try:
        wait_ready(PORT, proc, 600)
        reloader.start()
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            problem = one_stream(inputs)
            if problem is None:
                counts["answered"] += 1
                continue
            counts["unanswered" if problem.startswith("no answer") else "failed"] += 1
            print(time.strftime("%H:%M:%S"), problem, f"(after {reloads[0]} reloads)", flush=True)
    finally:
        stop.set()
        reloader.join(330)
        stop_server(proc)
    print(f"{args.seconds:.0f} s: streams answered {counts['answered']}, failed {counts['failed']}, "
          f"unanswered {counts['unanswered']}; {reloads[0]} reloads")
    return 0 if counts["failed"] == counts["unanswered"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
