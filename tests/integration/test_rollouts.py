"""Rollouts on the real test server: weighted and sticky routing between two versions of a
Python model, automatic rollback of a failing or slow candidate, promotion of a good one (and
the version policy unloading the old version), over tritonclient HTTP and gRPC."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import urllib.request
from collections import Counter

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import LOAD_TIMEOUT_S, http, http_json, pids_titled
from rollout_models import FAILURE, ROLLOUT_MODEL, rollout_config
from rayinfer.transport.router import GRPC_RUN_REQUESTS, RUN_REQUESTS
from waiting import wait_until

MODEL = ROLLOUT_MODEL
ROLLOUT = f"/v2/repository/models/{MODEL}/rollout"


@pytest.fixture(scope="module")
def clients(server):
    h = httpclient.InferenceServerClient(server["url"], network_timeout=LOAD_TIMEOUT_S)
    g = grpcclient.InferenceServerClient(server["grpc_url"])
    yield h, g
    h.close()
    g.close()


def _load_with(config: str, parameters: dict[str, str]) -> None:
    body = json.dumps({"parameters": {"config": config, **parameters}}).encode()
    status, _, answer = http("POST", f"/v2/repository/models/{MODEL}/load", body, timeout=LOAD_TIMEOUT_S)
    assert status == 200, answer


@pytest.fixture(scope="module")
def two_versions(clients):
    """The model with its two versions as they are on disk, loaded once for the tests that
    start rollouts of their own (each replaces the one before)."""
    clients[0].load_model(MODEL, config=rollout_config())
    yield clients
    clients[0].unload_model(MODEL)


@pytest.fixture
def loaded(clients):
    """The model loaded by the test (with a config of its own), unloaded afterwards."""
    yield clients
    clients[0].unload_model(MODEL)


def _inputs(module, value: float = 1.0) -> list:
    tensor = module.InferInput("INPUT0", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.full((1, 1), value, np.float32))
    return [tensor]


def _version(client, module, headers: dict | None = None) -> str:
    """The version that answered a version-less request (its model_version and its output agree)."""
    # (tritonclient's HTTP client adds its own headers to the dict it is given.)
    result = client.infer(MODEL, _inputs(module), headers=dict(headers) if headers else None)
    response = result.get_response()
    version = response["model_version"] if isinstance(response, dict) else response.model_version
    assert float(result.as_numpy("OUTPUT0")[0, 0]) == float(version)
    return version


def _grpc_versions(client, calls: int) -> Counter:
    """The versions that answered ``calls`` version-less gRPC calls on ``client``'s one
    connection, eight at a time (a connection's runs are long: many calls, sooner)."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return Counter(pool.map(lambda _: _version(client, grpcclient), range(calls)))


def _start(**settings) -> dict:
    status, doc = http_json("POST", f"{ROLLOUT}/start", {"stable_version": "1", "candidate_version": "2",
                                                         "parameters": {f"rollout_{k}": str(v) for k, v in settings.items()}})
    assert status == 200, doc
    return doc


def _status() -> dict:
    status, doc = http_json("GET", ROLLOUT)
    assert status == 200, doc
    return doc


class _Traffic:
    """Version-less requests over HTTP until stopped: each call's outcome (the version that
    answered, or the error's message)."""

    def __init__(self, url: str) -> None:
        self.outcomes: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self._thread.start()

    def _run(self, url: str) -> None:
        client = httpclient.InferenceServerClient(url, network_timeout=30)
        while not self._stop.is_set():
            try:
                self.outcomes.append(_version(client, httpclient))
            except InferenceServerException as exc:
                self.outcomes.append(str(exc.message()))
        client.close()

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(30)
        return self.outcomes


# The slack leaves the tests of routing to their routing: no latency check ends their rollouts
# on a busy machine (the failures check still applies).
_NOT_ON_LATENCY = {"latency_slack_ms": 1000}


def test_a_weight_splits_version_less_requests_and_changes_at_run_time(server, two_versions):
    h, g = two_versions
    doc = _start(steps="10,100", automatic="false", **_NOT_ON_LATENCY)
    assert (doc["state"], doc["weight"], doc["stable_version"], doc["candidate_version"]) == ("PROGRESSING", 10, "1", "2")
    calls = 30 * RUN_REQUESTS  # three of an HTTP/1.1 connection's pairs of runs at 10%
    served = Counter(_version(h, httpclient) for _ in range(calls))
    assert 0.07 <= served["2"] / calls <= 0.13, served
    # A gRPC connection's runs at 10% are about a tenth and nine tenths of two GRPC_RUN_REQUESTS.
    calls = 4 * GRPC_RUN_REQUESTS
    served = _grpc_versions(g, calls)
    assert 0.05 <= served["2"] / calls <= 0.15, served
    # Named versions are never split.
    assert {h.infer(MODEL, _inputs(httpclient), model_version="1").get_response()["model_version"]
            for _ in range(20)} == {"1"}
    # The weight moves under traffic with no failed request.
    traffic = _Traffic(server["url"])
    wait_until(lambda: len(traffic.outcomes) > 10, "the traffic to start")
    status, doc = http_json("POST", f"{ROLLOUT}/weight", {"weight": 50})
    assert status == 200 and doc["weight"] == 50
    wait_until(lambda: 0.35 <= Counter(_version(h, httpclient) for _ in range(200))["2"] / 200 <= 0.65,
               "half the requests to go to version 2", timeout_s=30)
    status, doc = http_json("POST", f"{ROLLOUT}/abort")
    assert status == 200 and doc["state"] == "ABORTED"
    wait_until(lambda: {_version(h, httpclient) for _ in range(50)} == {"1"}, "version 1 to answer every request",
               timeout_s=30)
    outcomes = traffic.stop()
    assert set(outcomes) <= {"1", "2"} and len(outcomes) > 50, Counter(outcomes)
    # The metrics port shows the rollout's weight and state.
    with urllib.request.urlopen(server["metrics_url"], timeout=30) as answer:
        metrics = answer.read().decode()
    assert f'rayinfer_rollout_weight{{candidate_version="2",model="{MODEL}",stable_version="1"}} 0' in metrics
    assert f'rayinfer_rollout_state{{model="{MODEL}",state="ABORTED"}} 1' in metrics


def test_a_sticky_header_always_reaches_the_same_version(two_versions):
    h, g = two_versions
    _start(steps="50,100", automatic="false", sticky_header="x-user-id", **_NOT_ON_LATENCY)
    seen = Counter()
    for n in range(30):
        headers = {"x-user-id": f"user-{n}"}
        versions = {_version(h, httpclient, headers) for _ in range(3)} | {_version(g, grpcclient, headers) for _ in range(3)}
        assert len(versions) == 1, (n, versions)
        seen[versions.pop()] += 1
    assert set(seen) == {"1", "2"}, seen


def _rolled_back(server, h, behaviour: str, delay_ms: float = 5.0, **settings) -> tuple[dict, list[str]]:
    h.load_model(MODEL, config=rollout_config(behaviour, delay_ms=delay_ms))
    traffic = _Traffic(server["url"])
    _start(steps="30,60,100", step_seconds=30, step_requests=25, **settings)
    try:
        wait_until(lambda: _status()["state"] != "PROGRESSING", "the rollout to end", timeout_s=90)
    finally:
        outcomes = traffic.stop()
    return _status(), outcomes


def test_a_candidate_whose_shadow_answers_differ_is_rolled_back_before_it_answers_anyone(two_versions):
    h, _ = two_versions  # version 2 answers twice version 1's
    _start(steps="0,50,100", shadow_percent=100, step_requests=20, step_seconds=60, latency_slack_ms=50)
    answered = set()
    wait_until(lambda: answered.update(_version(h, httpclient) for _ in range(10)) or _status()["state"] != "PROGRESSING",
               "the rollout to end", timeout_s=60)
    doc = _status()
    assert doc["state"] == "ROLLED_BACK" and answered == {"1"}, (doc["state"], answered)
    assert "shadow answers agreed 0.0%" in doc["decisions"][-1]["reason"], doc["decisions"][-1]


def test_the_rollout_command_starts_shows_and_aborts_a_rollout(server, two_versions, capsys):
    from rayinfer.cluster.cli import main

    url = ["--url", server["url"]]
    assert main(["rollout", "start", MODEL, "--set", "rollout_steps=25,100", "--set", "rollout_automatic=false", *url]) == 0
    assert capsys.readouterr().out.startswith(f"{MODEL}: PROGRESSING, version 2 at 25% beside version 1 (step 1 of 2)")
    assert main(["rollout", "weight", MODEL, "60", *url]) == 0
    assert "version 2 at 60%" in capsys.readouterr().out
    assert main(["rollout", "status", "--json", *url]) == 0
    assert json.loads(capsys.readouterr().out)["rollouts"][0]["weight"] == 60
    assert main(["rollout", "abort", MODEL, *url]) == 0
    assert "ABORTED" in capsys.readouterr().out
    assert main(["rollout", "promote", "no_such_model", *url]) == 1
    assert capsys.readouterr().err == "error: model 'no_such_model' has no rollout\n"


def test_rollout_requests_are_refused_with_triton_errors(two_versions):
    status, doc = http_json("GET", "/v2/repository/models/no_such_model/rollout")
    assert status == 404 and "has no rollout" in doc["error"]
    status, doc = http_json("POST", f"{ROLLOUT}/start", {"stable_version": "1", "candidate_version": "7"})
    assert status == 400 and doc["error"] == f"rollout of '{MODEL}': version 7 is not served"
    status, doc = http_json("POST", f"{ROLLOUT}/start", {"parameters": {"rollout_steps": "10,50"}})
    assert status == 400 and "rising percentages ending at 100" in doc["error"]
    _start(steps="10,100", automatic="false")
    status, doc = http_json("POST", f"{ROLLOUT}/weight", {"weight": 101})
    assert status == 400 and "between 0 and 100" in doc["error"]


def test_a_rollout_splits_between_two_versions_in_the_model_pool(server, loaded):
    """Both versions hosted by the model pool (rayinfer_hosting: pool): the split, a sticky key
    and the abort work as between dedicated versions, over HTTP and gRPC."""
    h, g = loaded
    h.load_model(MODEL, config=rollout_config(rayinfer_hosting="pool"))
    wait_until(lambda: not pids_titled(f"ServeReplica:{MODEL}"), "the dedicated replicas gone")  # pooled only
    _start(steps="50,100", automatic="false", sticky_header="x-user-id", **_NOT_ON_LATENCY)
    calls = 8 * RUN_REQUESTS
    served = Counter(_version(h, httpclient) for _ in range(calls))
    assert 0.4 <= served["2"] / calls <= 0.6, served
    calls = 4 * GRPC_RUN_REQUESTS  # a gRPC connection's runs at 50%: GRPC_RUN_REQUESTS each
    served = _grpc_versions(g, calls)
    assert 0.3 <= served["2"] / calls <= 0.7, served
    for n in range(10):
        headers = {"x-user-id": f"user-{n}"}
        assert len({_version(h, httpclient, headers) for _ in range(3)}) == 1
    status, doc = http_json("POST", f"{ROLLOUT}/abort")
    assert status == 200 and doc["state"] == "ABORTED"
    wait_until(lambda: {_version(h, httpclient) for _ in range(50)} == {"1"}, "version 1 to answer every request",
               timeout_s=30)


def test_a_failing_candidate_is_rolled_back_within_its_first_step(server, loaded):
    h, _ = loaded
    doc, outcomes = _rolled_back(server, h, "failing")
    assert doc["state"] == "ROLLED_BACK" and doc["weight"] == 0 and doc["step"] == 0, doc
    last = doc["decisions"][-1]
    assert last["action"] == "rolled_back" and "failure rate" in last["reason"], last
    assert last["figures"]["candidate"]["failures"] > 0
    # Every request was answered: by a version, or with the candidate's own failure.
    assert set(outcomes) <= {"1", "2", FAILURE}, Counter(outcomes)
    # The front routes by the rollback within moments of the decision (one routing change).
    def only_version_1() -> bool:
        try:
            return {_version(h, httpclient) for _ in range(100)} == {"1"}
        except InferenceServerException:  # a request still in flight to the candidate when it was rolled back
            return False

    wait_until(only_version_1, "version 1 to answer every request", timeout_s=10)


def test_a_slow_candidate_is_rolled_back_on_latency(server, loaded):
    h, _ = loaded
    doc, outcomes = _rolled_back(server, h, "slow", delay_ms=10.0, max_latency_ratio=1.5)
    assert doc["state"] == "ROLLED_BACK", doc
    # On its p99, or first on the queue its slow answers build (the same slowness, seen sooner).
    reason = doc["decisions"][-1]["reason"]
    assert "p99 latency" in reason or "mean queue time" in reason, doc["decisions"][-1]
    assert set(outcomes) <= {"1", "2"}, Counter(outcomes)


def test_a_load_with_rollout_settings_promotes_a_good_candidate_and_applies_the_version_policy(loaded):
    h, _ = loaded
    only_latest = {"latest": {"num_versions": 1}}
    h.load_model(MODEL, config=rollout_config(versions={"specific": {"versions": [1]}}))
    assert {_version(h, httpclient) for _ in range(10)} == {"1"}
    # Version 2 arrives (the policy now selects it alone); the load's settings start a rollout.
    # (Generous latency bounds: a p99 of a few dozen requests on a busy machine is their slowest.)
    _load_with(rollout_config(versions=only_latest), {"rollout_steps": "40,100", "rollout_step_seconds": "1",
                                                      "rollout_step_requests": "20", "rollout_max_latency_ratio": "10",
                                                      "rollout_latency_slack_ms": "50"})
    doc = _status()
    assert (doc["stable_version"], doc["candidate_version"], doc["weight"]) == ("1", "2", 40), doc
    stop = time.monotonic() + 90
    while _status()["state"] == "PROGRESSING" and time.monotonic() < stop:
        for _ in range(20):
            _version(h, httpclient)
    doc = _status()
    assert doc["state"] == "PROMOTED", doc
    assert [d["action"] for d in doc["decisions"]] == ["started", "step", "promoted"]
    wait_until(lambda: not h.is_model_ready(MODEL, "1"), "version 1 to be unloaded (the policy selects version 2)",
               timeout_s=60)
    assert {_version(h, httpclient) for _ in range(20)} == {"2"}


def test_shadow_requests_change_no_answer_and_report_agreement(server, loaded):
    h, _ = loaded
    h.load_model(MODEL, config=rollout_config("same"))  # version 2 answers as version 1 does
    # The slack leaves the judging to the shadow answers: on a busy machine version 2's queue
    # time, under a copy of every request, may be over twice version 1's plus a millisecond.
    _start(steps="0,100", automatic="false", shadow_percent=100, step_requests=20, latency_slack_ms=1000)
    # Weight 0: every answer is version 1's; a copy of each goes to version 2 and is compared.
    answered: set[str] = set()

    def compared() -> dict | None:
        answered.update(_version(h, httpclient) for _ in range(10))
        doc = _status()["shadow"]
        return doc if doc["compared"] >= 40 else None

    shadow = wait_until(compared, "40 shadow comparisons")
    assert answered == {"1"}
    assert shadow["agreed"] == shadow["compared"] and shadow["failed"] == 0, shadow
    doc = _status()
    assert doc["state"] == "PROGRESSING", doc["decisions"]
    with urllib.request.urlopen(server["metrics_url"], timeout=30) as answer:
        assert f'rayinfer_rollout_shadow_agreement{{model="{MODEL}"}} 1\n' in answer.read().decode()


