"""``rayinfer rollout``: a running server's rollouts (deployments/rollouts.py) from the command
line, over its HTTP repository API (``/v2/repository/models/<model>/rollout``)."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

ACTIONS = ("status", "start", "promote", "abort", "weight")


def add_rollout_parser(commands: Any) -> None:
    rollout = commands.add_parser("rollout", help="start, show, promote or abort a model's rollout on a running server")
    rollout.add_argument("action", choices=ACTIONS)
    rollout.add_argument("model", nargs="?", default="", help="the model (status: every rollout without one)")
    rollout.add_argument("weight", nargs="?", type=int, help="weight: the candidate's percent of the requests")
    rollout.add_argument("--url", default="localhost:8000", help="the server's HTTP address (default localhost:8000)")
    rollout.add_argument("--stable", help="start: the stable version (default: the highest served below the candidate)")
    rollout.add_argument("--candidate", help="start: the candidate version (default: the highest served)")
    rollout.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help="start: a rollout setting (rollout_steps=10,50,100 and the other rollout_* keys)")
    rollout.add_argument("--json", action="store_true", help="print the server's JSON answer")


def run_rollout(args: argparse.Namespace) -> int:
    base = args.url if "://" in args.url else f"http://{args.url}"
    if args.action != "status" and not args.model:
        print(f"error: rollout {args.action} needs a model", file=sys.stderr)
        return 2
    if args.action == "status":
        path = f"/v2/repository/models/{args.model}/rollout" if args.model else "/v2/repository/rollouts"
        status, doc = _call(base + path, None)
    else:
        body: dict[str, Any] = {}
        if args.action == "start":
            settings = dict(item.partition("=")[::2] for item in args.set)
            body = {"parameters": settings, **({"stable_version": args.stable} if args.stable else {}),
                    **({"candidate_version": args.candidate} if args.candidate else {})}
        elif args.action == "weight":
            if args.weight is None:
                print("error: rollout weight needs the candidate's percent", file=sys.stderr)
                return 2
            body = {"weight": args.weight}
        status, doc = _call(f"{base}/v2/repository/models/{args.model}/rollout/{args.action}", body)
    if status != 200:
        print(f"error: {doc.get('error', doc)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        for rollout in doc.get("rollouts", [doc]):
            print(summary(rollout))
    return 0


def summary(rollout: dict[str, Any]) -> str:
    """A rollout in a few lines: its state, weight, latest figures and decisions."""
    lines = [f"{rollout['model']}: {rollout['state']}, version {rollout['candidate_version']} at {rollout['weight']}% "
             f"beside version {rollout['stable_version']} (step {rollout['step'] + 1} of "
             f"{len(rollout['settings']['steps'])})"]
    for who, figures in (rollout.get("figures") or {}).items():
        lines.append(f"  {who}: {figures['requests']} requests, {figures['failure_rate']:.1%} failed, "
                     f"p99 {figures['p99_ms']} ms, queue {figures['queue_ms']} ms")
    for decision in rollout.get("decisions", [])[-5:]:
        lines.append(f"  {decision['action']}: {decision['reason']}")
    return "\n".join(lines)


def _call(url: str, body: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except ValueError:
            return exc.code, {"error": exc.reason}
    except OSError as exc:
        return 0, {"error": f"cannot reach the server at {url}: {exc}"}
