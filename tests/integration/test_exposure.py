"""What the shared test server exposes by default: its HTTP, gRPC and metrics ports and Serve's
ingress behind them listen on loopback only, no dashboard runs, and tensor data sent to it never
reaches its logs at the default (INFO) level. (Ray's own gRPC ports and Serve's HAProxy stats
port listen on every interface whatever rayinfer asks: README says to firewall them.)"""

from __future__ import annotations

import glob
import json
import os
import socket
from pathlib import Path

from conftest import GRPC_PORT, HTTP_PORT, METRICS_PORT, SERVE_GRPC_PORT, SERVE_HTTP_PORT, http

MARKER = "tensor-data-7f3a91c2"


def listening_sockets() -> dict[int, list[str]]:
    """{port: [local addresses]} of the TCP sockets listening in this network namespace."""
    out: dict[int, list[str]] = {}
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # /proc writes each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out.setdefault(int(port, 16), []).append(socket.inet_ntop(family, raw))
    return out


def test_the_servers_ports_listen_on_loopback_only(server):
    listening = listening_sockets()
    for port in (HTTP_PORT, GRPC_PORT, METRICS_PORT, SERVE_HTTP_PORT, SERVE_GRPC_PORT):
        assert listening.get(port) and all(a == "127.0.0.1" for a in listening[port]), (port, listening.get(port))
    assert 8265 not in listening  # Ray's dashboard: only with --dashboard-port


def test_tensor_data_stays_out_of_the_logs(server):
    rows = [[f"{MARKER}-{i}"] for i in range(2)]
    good = {"inputs": [{"name": "INPUT0", "shape": [2, 1], "datatype": "BYTES", "data": rows}]}
    status, _, body = http("POST", "/v2/models/simple_identity/infer", json.dumps(good).encode())
    assert status == 200 and MARKER in body.decode()
    # Refused requests too: a wrong shape, an unknown input, a body that is not JSON.
    for doc in ({"inputs": [{"name": "INPUT0", "shape": [3, 1], "datatype": "BYTES", "data": rows}]},
                {"inputs": [{"name": "INPUT9", "shape": [1, 1], "datatype": "BYTES", "data": [MARKER]}]}):
        status, _, _ = http("POST", "/v2/models/simple_identity/infer", json.dumps(doc).encode())
        assert status == 400
    status, _, _ = http("POST", "/v2/models/simple_identity/infer", f"{{{MARKER}".encode())
    assert status == 400
    logs = [server["log"], *glob.glob("/tmp/ray/session_latest/logs/**/*", recursive=True)]
    found = [path for path in map(Path, logs)
             if path.is_file() and os.access(path, os.R_OK) and MARKER.encode() in path.read_bytes()]
    assert not found, f"tensor data in {found}"
