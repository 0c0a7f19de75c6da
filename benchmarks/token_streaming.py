#!/usr/bin/env python3
"""Time to first token and tokens per second of the example language model, over HTTP's
generate_stream (server-sent events), a gRPC stream and the OpenAI-compatible API's streamed
chat completions, in the same run.

    .venv/bin/python benchmarks/token_streaming.py [--concurrency 1,8,32] [--tokens 32] [--seconds 10]

Writes a repository with the example ``tiny_llm`` (a decoupled Python model: one response per
token, ``stream`` true) and starts ``rayinfer serve`` inside a private network namespace. For
each concurrency, that many clients each send generation requests back to back for
``--seconds``, over HTTP (``POST .../generate_stream``, one connection each, read as the events
arrive), over gRPC (``ModelStreamInfer``, one stream each, with tritonclient) and then over
``POST /v1/chat/completions`` with ``stream`` true (one connection each, read as the events
arrive, the prompt as one user message), every
request the same prompt and ``max_tokens`` with a seed of its own (temperature 0.7; a
generation may end early where the model draws ``[EOS]``, so tokens are counted as received). Prints a markdown table: requests, tokens per second (all clients),
time to first token p50 / p99 and time per later token p50, and HTTP's figures against gRPC's.
"""

from __future__ import annotations

import argparse
import http.client
import json
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from compare_triton import RAYINFER_PORT, in_private_netns, reexec_in_netns, start_rayinfer, stop_server, wait_ready
from rayinfer.cluster.example_llm import write_language_model

PROMPT = "the movie was really good and the food"
PROTOCOLS = {"http": "HTTP generate_stream", "grpc": "gRPC stream", "openai": "OpenAI chat completions (SSE)"}


def _settings(tokens: int, seed: int) -> str:
    return json.dumps({"max_tokens": tokens, "temperature": 0.7, "seed": seed})


def http_client(port: int, tokens: int, until: float, seed: int, out: list) -> None:
    """Requests back to back on one connection until ``until``: (first token s, [later gaps s], tokens)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    while time.monotonic() < until:
        body = json.dumps({"text_input": PROMPT, "stream": True, "sampling_parameters": _settings(tokens, seed)})
        seed += 1000
        start = time.perf_counter()
        connection.request("POST", "/v2/models/tiny_llm/generate_stream", body.encode())
        response = connection.getresponse()
        stamps, buffer = [], b""
        while chunk := response.read1(65536):
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if b'"error"' in event:
                    raise RuntimeError(event.decode())
                stamps.append(time.perf_counter())
        out.append(_figures(start, stamps))
    connection.close()


def openai_client(port: int, tokens: int, until: float, seed: int, out: list) -> None:
    """Streamed chat completions back to back on one connection, as http_client does."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    while time.monotonic() < until:
        body = json.dumps({"model": "tiny_llm", "messages": [{"role": "user", "content": PROMPT}], "stream": True,
                           "max_tokens": tokens, "temperature": 0.7, "seed": seed})
        seed += 1000
        start = time.perf_counter()
        connection.request("POST", "/v1/chat/completions", body.encode(), {"content-type": "application/json"})
        response = connection.getresponse()
        stamps, buffer = [], b""
        while chunk := response.read1(65536):
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if b'"error"' in event:
                    raise RuntimeError(event.decode())
                if b'"content":" ' in event:  # a token (not the role, the finish or [DONE])
                    stamps.append(time.perf_counter())
        out.append(_figures(start, stamps))
    connection.close()


def grpc_client(port: int, tokens: int, until: float, seed: int, out: list) -> None:
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    events: queue.SimpleQueue = queue.SimpleQueue()
    client.start_stream(callback=lambda result, error: events.put((time.perf_counter(), result, error)))
    try:
        while time.monotonic() < until:
            inputs = []
            for name, datatype, value in (("text_input", "BYTES", np.array([PROMPT.encode()], dtype=object)),
                                          ("stream", "BOOL", np.array([True])),
                                          ("sampling_parameters", "BYTES",
                                           np.array([_settings(tokens, seed).encode()], dtype=object))):
                tensor = grpcclient.InferInput(name, [1], datatype)
                tensor.set_data_from_numpy(value)
                inputs.append(tensor)
            seed += 1000
            start = time.perf_counter()
            client.async_stream_infer("tiny_llm", inputs, enable_empty_final_response=True)
            stamps = []
            while True:
                stamp, result, error = events.get(timeout=60)
                if error is not None:
                    raise RuntimeError(str(error))
                final = result.get_response().parameters["triton_final_response"].bool_param
                if result.get_response().outputs:
                    stamps.append(stamp)
                if final:
                    break
            out.append(_figures(start, stamps))
    finally:
        client.stop_stream()
        client.close()


def _figures(start: float, stamps: list[float]) -> tuple[float | None, list[float], int]:
    """(first token s, gaps between later ones s, tokens); no first token where the model drew
    ``[EOS]`` at once."""
    first = stamps[0] - start if stamps else None
    return first, [b - a for a, b in zip(stamps, stamps[1:])], len(stamps)


def run(protocol: str, port: int, concurrency: int, tokens: int, seconds: float) -> dict[str, float]:
    target = {"http": http_client, "grpc": grpc_client, "openai": openai_client}[protocol]
    client_port = port + 1 if protocol == "grpc" else port
    results: list = []
    began = time.monotonic()
    until = began + seconds
    threads = [threading.Thread(target=target, args=(client_port, tokens, until, 7 + n, results))
               for n in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - began
    firsts = sorted(r[0] for r in results if r[0] is not None)
    gaps = [g for r in results for g in r[1]]
    return {
        "requests": len(results),
        "tokens_s": sum(r[2] for r in results) / elapsed,
        "ttft_p50_ms": 1000 * statistics.median(firsts),
        "ttft_p99_ms": 1000 * firsts[min(len(firsts) - 1, int(0.99 * len(firsts)))],
        "gap_p50_ms": 1000 * statistics.median(gaps) if gaps else 0.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    if not in_private_netns():
        reexec_in_netns()
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="rayinfer-tokens-") as tmp:
        work = Path(tmp)
        write_language_model(work / "repo")
        server = start_rayinfer(work / "repo", RAYINFER_PORT, work / "rayinfer.log")
        try:
            wait_ready(RAYINFER_PORT, server, 600)
            run("http", RAYINFER_PORT, 1, args.tokens, 2.0)  # warm both paths up
            run("grpc", RAYINFER_PORT, 1, args.tokens, 2.0)
            run("openai", RAYINFER_PORT, 1, args.tokens, 2.0)
            for concurrency in levels:
                figures = {p: run(p, RAYINFER_PORT, concurrency, args.tokens, args.seconds) for p in PROTOCOLS}
                print(f"  c={concurrency}: {figures}", flush=True)
                rows.append((concurrency, figures))
        finally:
            stop_server(server)
    print("\n| concurrency | protocol | requests | tokens/s | first token p50 / p99 (ms) | later token p50 (ms) "
          "| tokens/s against gRPC |")
    print("|---|---|---|---|---|---|---|")
    for concurrency, figures in rows:
        for protocol in PROTOCOLS:
            f = figures[protocol]
            name = PROTOCOLS[protocol]
            print(f"| {concurrency} | {name} | {f['requests']:,} | {f['tokens_s']:,.0f} | {f['ttft_p50_ms']:.1f} / "
                  f"{f['ttft_p99_ms']:.1f} | {f['gap_p50_ms']:.2f} | "
                  f"{f['tokens_s'] / figures['grpc']['tokens_s']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
