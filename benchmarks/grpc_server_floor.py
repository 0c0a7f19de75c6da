#!/usr/bin/env python3
"""The floor of a grpcio asyncio server on this machine: canned ModelInfer answers, no Ray.

    .venv/bin/python benchmarks/grpc_server_floor.py [--threads 8] [--seconds 4]

Starts a grpcio ``grpc.aio`` server (uvloop, as in a Ray Serve replica) whose ModelInfer returns
a fixed response, drives it from client threads in another process, and prints calls/s and
the server's CPU per call.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
import time

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

ADDRESS = "127.0.0.1:19555"


class CannedServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    async def ModelInfer(self, request, context):  # noqa: N802 (the proto's name)
        return service_pb2.ModelInferResponse(model_name=request.model_name)


async def serve() -> None:
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(CannedServicer(), server)
    server.add_insecure_port(ADDRESS)
    await server.start()
    await server.wait_for_termination()


def drive(threads: int, seconds: float) -> float:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(ADDRESS))
    request = service_pb2.ModelInferRequest(model_name="m")
    stub.ModelInfer(request, wait_for_ready=True)
    calls = [0] * threads
    stop = time.monotonic() + seconds

    def work(i: int) -> None:
        while time.monotonic() < stop:
            stub.ModelInfer(request)
            calls[i] += 1

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return sum(calls) / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        import uvloop

        uvloop.install()
        asyncio.run(serve())
        return 0
    server = subprocess.Popen([sys.executable, __file__, "--serve"])
    try:
        time.sleep(2)
        stat = f"/proc/{server.pid}/stat"

        def ticks() -> int:
            fields = open(stat).read().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])

        before = ticks()
        rate = drive(args.threads, args.seconds)
        cpu_us = (ticks() - before) * 1e6 / os.sysconf("SC_CLK_TCK")
        print(f"{rate:,.0f} calls/s; server CPU {cpu_us / (rate * args.seconds):,.0f} us per call")
    finally:
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
