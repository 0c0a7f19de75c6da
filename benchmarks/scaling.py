#!/usr/bin/env python3
"""How rayinfer's throughput grows with replicas and Ray nodes, and the server's memory.

    .venv/bin/python benchmarks/scaling.py [--concurrency 1,2,4,8,16,32] [--protocols http,grpc]

Serves the anchor's MLP (``mlp_onnx``, dynamic batching on, the same config as
benchmarks/compare_triton.py) four ways, one after the other, inside a private network namespace:

- ``1 replica``: ``instance_group count: 1`` on the embedded one-node Ray (the default);
- ``2 replicas``: ``count: 2`` on the same embedded Ray;
- ``2 replicas, 2 nodes``: ``count: 2`` on a Ray cluster of two nodes started on this machine
  (``ray start --head`` and ``ray start --address``, one CPU each), with replicas asking for 0.6
  CPU so that each node takes one; where each replica runs is checked from its raylet;
- ``4 replicas``: ``count: 4`` on the embedded one-node Ray;
- ``2 replicas, 2 hosts``: as ``2 replicas, 2 nodes``, but the second node runs on a second
  "host" (tests/second_host.py: a network namespace of its own joined by a veth pair, so it has
  an address, a loopback and ports of its own, as on two machines; needs root), with a front on
  every node (``--http-address 0.0.0.0 --front-on-head --front-on-every-node``); perf_analyzer
  calls the head's front.

For each it runs perf_analyzer (batch 1 per request) at each concurrency and records the memory of
every process the server started: PSS (shared pages split between the processes sharing them, so
the sum is the server's real footprint) and RSS, idle after start and under a short
perf_analyzer load at concurrency 16 (or the highest one below it), started right after that
point's measurement. Writes the tables to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rayinfer.cluster.settings import RAY_ENVIRONMENT

from compare_triton import (
    ANCHOR_HOME,
    ANCHORS,
    MODEL,
    RAYINFER_CONFIG,
    ROOT,
    ensure_anchor,
    in_private_netns,
    perf_analyzer,
    perf_analyzer_command,
    processes,
    reexec_in_netns,
    start_rayinfer,
    stop_server,
    wait_ready,
    write_doc,
)

PORT = 18400
RAY_PORT = 6390  # outside the worker port ranges below
WORKER_NODE_PORTS = (25000, 29999)  # the second node's workers (the head's: 20000-24999)
BIN = Path(sys.executable).parent
SETUPS = ("1 replica", "2 replicas", "2 replicas, 2 nodes", "4 replicas", "2 replicas, 2 hosts")
REPLICAS = (1, 2, 2, 4, 2)  # instance_group count of each setup
MARKS = ("<!-- scaling:begin -->", "<!-- scaling:end -->")


def ray_environment() -> dict[str, str]:
    """The environment rayinfer starts its own Ray with (``rayinfer ray-env``; set variables win,
    as in ``rayinfer serve``), for ``ray start``."""
    env = {**RAY_ENVIRONMENT, **os.environ}
    # A token in ~/.ray turns token authentication on for `ray start --head` but not for the
    # second node's `ray start`; the cluster lives on loopback in a private namespace.
    env.setdefault("RAY_AUTH_MODE", "disabled")
    return env


def memory_kib(pid: int) -> tuple[int, int] | None:
    """(PSS, RSS) of one process in KiB, from /proc/<pid>/smaps_rollup."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    fields = {line.split(":")[0]: int(line.split()[1]) for line in text.splitlines() if line.endswith("kB")}
    return fields.get("Pss", 0), fields.get("Rss", 0)


def parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


def server_processes(before: set[int]) -> dict[int, str]:
    """{pid: command line} of the server's processes: new since ``before`` was taken and Ray's or
    rayinfer's (the namespace is the network's, not the PIDs')."""
    return {pid: cmd for pid, cmd in processes().items() if pid not in before and "ray" in cmd and pid != os.getpid()}


def server_memory(before: set[int]) -> dict[str, float]:
    """The memory of every process started since ``before`` was taken (the server's), in MiB."""
    total_pss = total_rss = 0
    replicas: list[tuple[int, int]] = []
    for pid, cmd in server_processes(before).items():
        figures = memory_kib(pid)
        if figures is None:
            continue
        total_pss += figures[0]
        total_rss += figures[1]
        if cmd.startswith(f"ray::ServeReplica:{MODEL}:"):
            replicas.append(figures)
    return {
        "pss_mib": total_pss / 1024,
        "rss_mib": total_rss / 1024,
        "replica_pss_mib": sum(p for p, _ in replicas) / max(len(replicas), 1) / 1024,
        "replica_rss_mib": sum(r for _, r in replicas) / max(len(replicas), 1) / 1024,
    }


def replica_nodes() -> int:
    """On how many raylets (nodes) the model's replicas run."""
    raylets = set()
    for pid, cmd in processes().items():
        if cmd.startswith(f"ray::ServeReplica:{MODEL}:"):
            raylets.add(parent(pid))
    return len(raylets)


def write_repository(root: Path, count: int) -> Path:
    repo = root / f"repo{count}"
    (repo / MODEL / "1").mkdir(parents=True)
    config = RAYINFER_CONFIG.replace("count: 1", f"count: {count}")
    if f"count: {count}" not in config:
        raise RuntimeError("the MLP config has no instance_group count to change")
    (repo / MODEL / "config.pbtxt").write_text(config)
    subprocess.run(
        [str(ANCHOR_HOME / "venv" / "bin" / "python"), str(ANCHORS / "models" / "make_mlp_onnx.py"),
         str(repo / MODEL / "1" / "model.onnx")], check=True, capture_output=True,
    )
    return repo


def start_ray_node(kind: str, env: dict[str, str]) -> None:
    """``ray start`` of the head (``kind`` "head") or a second node on this machine, one CPU each;
    their workers and dashboard agents need ports of their own."""
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--disable-usage-stats"]
    args = {
        "head": ["--head", "--port", str(RAY_PORT), "--include-dashboard", "false", "--min-worker-port", "20000",
                 "--max-worker-port", "24999", "--dashboard-agent-listen-port", "52365"],
        "worker": ["--address", f"127.0.0.1:{RAY_PORT}", "--min-worker-port", str(WORKER_NODE_PORTS[0]),
                   "--max-worker-port", str(WORKER_NODE_PORTS[1]), "--dashboard-agent-listen-port", "52366"],
    }[kind]
    started = subprocess.run([str(BIN / "ray"), "start", *args, *common], env=env, capture_output=True, text=True)
    if started.returncode != 0:
        raise RuntimeError(f"ray start failed:\n{started.stdout[-1500:]}\n{started.stderr[-1500:]}")


def start_two_nodes(env: dict[str, str]) -> None:
    for kind in ("head", "worker"):
        start_ray_node(kind, env)


def start_two_hosts(env: dict[str, str]):
    """A head (one CPU) at ``HERE_IP`` here and a node (one CPU) at ``THERE_IP`` on a second host
    (tests/second_host.py); returns that host (``close()`` it after ``ray stop``). Ray turns token
    authentication on for a head off loopback: both nodes get one token through ``env``."""
    sys.path.insert(0, str(ROOT / "tests"))
    from second_host import HERE_IP, THERE_IP, SecondHost

    host = SecondHost()
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    common = ["--num-cpus", "1", "--disable-usage-stats"]
    head = subprocess.run([str(BIN / "ray"), "start", "--head", "--node-ip-address", HERE_IP, "--port", str(RAY_PORT),
                           "--include-dashboard", "false", *common], env=env, capture_output=True, text=True)
    worker = head if head.returncode else host.run(
        [str(BIN / "ray"), "start", "--address", f"{HERE_IP}:{RAY_PORT}", "--node-ip-address", THERE_IP, *common],
        env=env, capture_output=True, text=True)
    if worker.returncode:
        subprocess.run([str(BIN / "ray"), "stop"], env=env, capture_output=True)
        host.close()
        raise RuntimeError(f"ray start failed:\n{worker.stdout[-1500:]}\n{worker.stderr[-1500:]}")
    return host


def measure_points(setup: str, result: dict, work: Path, points: list[tuple[str, int]], interval_ms: int,
                   before: set[int]) -> None:
    """perf_analyzer at each point into ``result``, and the memory under load at concurrency 16."""
    loaded_at = max((c for _, c in points if c <= 16), default=points[-1][1])
    for protocol, concurrency in points:
        out = work / f"{setup}_{protocol}_{concurrency}.csv".replace(" ", "_").replace(",", "")
        try:
            result["points"][(protocol, concurrency)] = perf_analyzer(PORT, MODEL, protocol, concurrency,
                                                                      interval_ms, out)
        except RuntimeError as exc:
            error = next((line for line in str(exc).splitlines() if line.startswith("error")), str(exc)[-300:])
            result["points"][(protocol, concurrency)] = None
            result.setdefault("errors", []).append(f"{protocol} c={concurrency}: {error.strip()}")
            print(f"  {setup} {protocol} c={concurrency} failed: {error}", flush=True)
            continue
        print(f"  {setup} {protocol} c={concurrency}: {result['points'][(protocol, concurrency)]}", flush=True)
        if concurrency == loaded_at and "loaded" not in result:
            # perf_analyzer has just stopped; measure under the same load again, briefly.
            load = subprocess.Popen(perf_analyzer_command(PORT, MODEL, protocol, concurrency, 3000, max_trials=2),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                time.sleep(3)
                result["loaded"] = server_memory(before)
                result["loaded_at"] = (protocol, concurrency)
            finally:
                load.kill()
                load.wait()


def run_setup(setup: str, repo: Path, work: Path, points: list[tuple[str, int]], interval_ms: int) -> dict:
    env = ray_environment()
    before = set(processes())
    two_nodes = setup.endswith("2 nodes")
    two_hosts = setup.endswith("2 hosts")
    result: dict = {"points": {}}
    proc = host = None
    try:
        extra: tuple[str, ...] = ()
        if two_nodes:
            start_two_nodes(env)
            extra = ("--ray-address", f"127.0.0.1:{RAY_PORT}", "--replica-num-cpus", "0.6")
        if two_hosts:
            host = start_two_hosts(env)
            extra = ("--ray-address", "auto", "--replica-num-cpus", "0.6", "--http-address", "0.0.0.0",
                     "--front-on-head", "--front-on-every-node")
        log = work / f"rayinfer-{setup.replace(' ', '_').replace(',', '')}.log"
        proc = start_rayinfer(repo, PORT, log, extra, env)
        wait_ready(PORT, proc, 300)
        time.sleep(5)
        result["nodes"] = replica_nodes()
        result["idle"] = server_memory(before)
        measure_points(setup, result, work, points, interval_ms, before)
    finally:
        if proc is not None:
            stop_server(proc)
        if two_nodes or host is not None:  # the cluster this setup started (`ray stop` stops every Ray of this user)
            subprocess.run([str(BIN / "ray"), "stop"], env=env, capture_output=True)
        if host is not None:
            host.close()
    return result


def render(results: dict[str, dict], points: list[tuple[str, int]], args: argparse.Namespace) -> str:
    lines = [
        MARKS[0],
        f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} cores ({platform.machine()}), Python "
        f"{platform.python_version()}, perf_analyzer on the same cores, batch 1 per request, `mlp_onnx` with "
        "dynamic batching (500 us), one intra-op thread per replica. Replicas on distinct nodes: "
        + ", ".join(f"{s}: {r['nodes']}" for s, r in results.items()) + ".",
        "",
        "| protocol | concurrency | " + " | ".join(f"{s} (infer/s)" for s in results) + " | "
        + " | ".join(f"{s}: p99 (us)" for s in results) + " |",
        "|---|---|" + "---|" * (2 * len(results)),
    ]
    first = next(iter(results.values()))
    for point in points:
        base = first["points"][point]
        cells = [("failed" if r["points"][point] is None else f"{r['points'][point]['infer_s']:,.0f}"
                  + (f" ({r['points'][point]['infer_s'] / base['infer_s']:.2f}x)" if r is not first and base else ""))
                 for r in results.values()]
        p99 = ["failed" if r["points"][point] is None else f"{r['points'][point]['p99_us']:,.0f}"
               for r in results.values()]
        lines.append(f"| {point[0]} | {point[1]} | " + " | ".join(cells) + " | " + " | ".join(p99) + " |")
    for setup, r in results.items():
        for error in dict.fromkeys(e.split(": ", 1)[1] for e in r.get("errors", [])):  # each distinct one once
            where = ", ".join(e.split(": ", 1)[0] for e in r["errors"] if e.endswith(error))
            lines.append(f"\n{setup}, {where}: {error}")
    lines += [
        "",
        "Memory of every process the server started (Ray's GCS, raylets, dashboard agent, Serve's controller and "
        "proxy, the `/v2` replica, the front, the model replicas): PSS splits shared pages between the processes "
        "that share them, so it adds up; RSS counts them in each process. \"Loaded\" is under perf_analyzer at "
        "the concurrency shown.",
        "",
        "| setup | whole server PSS idle / loaded (MiB) | whole server RSS idle / loaded (MiB) "
        "| per model replica PSS idle / loaded (MiB) | per model replica RSS idle / loaded (MiB) |",
        "|---|---|---|---|---|",
    ]
    for setup, r in results.items():
        if "loaded" not in r:  # its loaded measurement failed
            continue
        idle, loaded = r["idle"], r["loaded"]
        lines.append(
            f"| {setup} (loaded: {r['loaded_at'][0]}, c={r['loaded_at'][1]}) "
            f"| {idle['pss_mib']:,.0f} / {loaded['pss_mib']:,.0f} | {idle['rss_mib']:,.0f} / {loaded['rss_mib']:,.0f} "
            f"| {idle['replica_pss_mib']:,.0f} / {loaded['replica_pss_mib']:,.0f} "
            f"| {idle['replica_rss_mib']:,.0f} / {loaded['replica_rss_mib']:,.0f} |"
        )
    lines += ["", f"Reproduce: `.venv/bin/python benchmarks/scaling.py --concurrency {args.concurrency} "
              f"--protocols {args.protocols} --setups {args.setups}`", MARKS[1]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,2,4,8,16,32")
    parser.add_argument("--protocols", default="http,grpc")
    parser.add_argument("--setups", default=",".join(str(i) for i in range(len(SETUPS))),
                        help="which setups, by index: 0 = 1 replica, 1 = 2 replicas, 2 = 2 replicas on 2 nodes, "
                             "3 = 4 replicas, 4 = 2 replicas on 2 hosts (needs root)")
    parser.add_argument("--measurement-interval", type=int, default=3000, help="ms per perf_analyzer window")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args()
    if not in_private_netns():
        reexec_in_netns()
    ensure_anchor()  # for perf_analyzer and the weights
    points = [(p, int(c)) for p in args.protocols.split(",") for c in args.concurrency.split(",")]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rayinfer-scaling-") as tmp:
        work = Path(tmp)
        for index in (int(i) for i in args.setups.split(",")):
            setup = SETUPS[index]
            repo = write_repository(work / str(index), REPLICAS[index])
            print(f"{setup}", flush=True)
            try:
                results[setup] = run_setup(setup, repo, work, points, args.measurement_interval)
            except Exception as exc:  # report the others
                print(f"{setup} failed: {exc}", flush=True)
            shutil.rmtree(repo)
    if not results:
        return 1
    section = render(results, points, args)
    print(section)
    write_doc(section, args.output, MARKS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
