"""``rayinfer rollout`` without a server: its summary of a rollout, and its errors."""

from __future__ import annotations

import socket

from rayinfer.cluster.cli import main
from rayinfer.cluster.rollout_cli import summary


def test_a_rollout_is_summed_up_in_a_few_lines():
    rollout = {"model": "m", "state": "PROGRESSING", "candidate_version": "2", "stable_version": "1", "weight": 10,
               "step": 0, "settings": {"steps": [10, 50, 100]},
               "figures": {"candidate": {"requests": 40, "failure_rate": 0.025, "p99_ms": 3.5, "queue_ms": 0.1}},
               "decisions": [{"action": "started", "reason": "started by request"}]}
    assert summary(rollout).splitlines() == [
        "m: PROGRESSING, version 2 at 10% beside version 1 (step 1 of 3)",
        "  candidate: 40 requests, 2.5% failed, p99 3.5 ms, queue 0.1 ms",
        "  started: started by request",
    ]


def test_the_command_says_what_is_missing_or_unreachable(capsys):
    assert main(["rollout", "promote"]) == 2
    assert capsys.readouterr().err == "error: rollout promote needs a model\n"
    assert main(["rollout", "weight", "m"]) == 2
    assert "needs the candidate's percent" in capsys.readouterr().err
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["rollout", "status", "m", "--url", f"127.0.0.1:{port}"]) == 1
    assert f"cannot reach the server at http://127.0.0.1:{port}/v2/repository/models/m/rollout" in capsys.readouterr().err
