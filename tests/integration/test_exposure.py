"""What the shared test server exposes by default: its HTTP, gRPC and metrics ports and Serve's
ingress behind them listen on loopback only, no dashboard runs, tensor data sent to it never
reaches its logs at the default (INFO) level, and its model replicas' listeners answer their
internal routes only to the /v2 replica. (Ray's own gRPC ports and Serve's HAProxy stats
port listen on every interface whatever rayinfer asks: docs/operations.md says to firewall them.)"""

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


def test_a_listener_has_no_internal_routes(server):
    """A model replica's listener listens on its node's network (other nodes' fronts reach
    it): it serves only the server's own parts (requests with the front key), and answers the
    model's routes only. The /v2 replica's changes (trace settings, a shared-memory region
    forgotten, sequence slots) reach replicas over Ray's control channel, so a client there finds
    nothing to send them by, whatever headers it sends."""
    import urllib.error
    import urllib.request

    from conftest import front_folder, read_map

    listener = next(v for k, v in read_map(front_folder(server) / "listeners.map").items() if k.startswith("simple/"))
    host, port = listener.rsplit("|", 1)
    for path, body in (("/rayinfer/trace/settings", b'{"trace_level": ["TIMESTAMPS"]}'),
                       ("/rayinfer/sharedmemory/forget/system/", b""),
                       ("/rayinfer/sequences/slots", b'{"listeners": [], "previous": []}')):
        request = urllib.request.Request(f"http://{host}:{port}{path}", data=body, method="POST",
                                         headers={"x-rayinfer-internal": "guessed"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                status, answer = response.status, response.read()
        except urllib.error.HTTPError as exc:
            status, answer = exc.code, exc.read()
        assert status == 403, (path, status, answer)
        assert "rayinfer-front-key" in json.loads(answer)["error"]
    # The model still serves.
    assert http("GET", "/v2/models/simple/ready")[0] == 200
    assert http("GET", "/v2/models/simple/trace/setting")[0] == 200
