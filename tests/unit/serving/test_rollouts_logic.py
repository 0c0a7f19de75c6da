"""A rollout's pure parts: its settings from config parameters, the version split's pick, and
the judging of a step (no Ray, no server)."""

from __future__ import annotations

import math
import zlib
from collections import Counter

import numpy as np
import pytest

from rayinfer.protocol.errors import InvalidArgError
from rayinfer.protocol.statistics import ModelStatistics, merge_snapshots
from rayinfer.repository.rollout_config import RolloutSettings, rollout_settings
from rayinfer.serving.rollout_analysis import VersionFigures, figures_since, judge, shadow_verdict, version_figures
from rayinfer.protocol.types import InferOutput, InferResponse
from rayinfer.serving.shadow import ShadowCounts, answers_agree, labels_agree
from rayinfer.transport.router import (
    GRPC_RUN_REQUESTS,
    RUN_REQUESTS,
    ConnectionTurn,
    SplitPlacement,
    VersionSplit,
    bucket_of,
    minority_run,
    pick_version,
    run_length,
    sticky_value,
)


def test_settings_come_from_rollout_parameters_with_defaults():
    assert rollout_settings({"other": "1"}, "m") is None
    settings = rollout_settings({"rollout_steps": {"string_value": "5, 25,100"}, "rollout_step_seconds": "2",
                                 "rollout_sticky_header": "X-User-Id", "rollout_automatic": "false"}, "m")
    assert settings == RolloutSettings(steps=(5, 25, 100), step_seconds=2.0, sticky_header="x-user-id", automatic=False)
    assert settings.as_dict()["steps"] == [5, 25, 100]


@pytest.mark.parametrize(("parameters", "message"), [
    ({"rollout_step_seconds": "2"}, "need 'rollout_steps'"),
    ({"rollout_steps": "10,50"}, "rising percentages ending at 100"),
    ({"rollout_steps": "50,10,100"}, "rising percentages ending at 100"),
    ({"rollout_steps": "100", "rollout_max_latency_ratio": "0.5"}, "'rollout_max_latency_ratio' must be at least 1"),
    ({"rollout_steps": "100", "rollout_step_requests": "many"}, "must be a whole number"),
    ({"rollout_steps": "100", "rollout_sticky_header": "a b"}, "must be a header name"),
    ({"rollout_steps": "100", "rollout_colour": "red"}, "unknown parameter 'rollout_colour'"),
])
def test_wrong_settings_name_the_model_and_the_key(parameters, message):
    with pytest.raises(InvalidArgError, match=message) as caught:
        rollout_settings(parameters, "resnet")
    assert "model 'resnet'" in caught.value.message


def test_the_split_picks_by_weight_or_by_the_sticky_value():
    split = VersionSplit("1", "2", 10, "x-user")
    picks = Counter(pick_version(split) for _ in range(20000))
    assert 0.09 <= picks["2"] / 20000 <= 0.11
    for user in ("a", "b", "user-17", "\u00fc"):
        # The front's bucket: HAProxy's crc32 converter (zlib's) of the header's bytes, modulo 100.
        assert bucket_of(user) == zlib.crc32(user.encode()) % 100
        assert len({pick_version(split, user) for _ in range(20)}) == 1
    assert sticky_value(split, [(b"X-User", b"first"), (b"x-user", b"last")]) == b"last"
    assert sticky_value(VersionSplit("1", "2", 10), [(b"x-user", b"a")]) is None
    assert {pick_version(VersionSplit("1", "2", 0)) for _ in range(200)} == {"1"}


def _stats(successes: int, failures: int, latency_us: float, queue_us: float = 10.0) -> dict:
    stats = ModelStatistics()
    for _ in range(successes):
        stats.record_success(int(latency_us * 1000), int(queue_us * 1000))
    for _ in range(failures):
        stats.record_failure(1000)
    return merge_snapshots([stats.snapshot()])


def test_a_connections_runs_give_each_version_its_weights_share():
    for weight in (1, 10, 30, 50, 75):
        split = VersionSplit("1", "2", weight)
        minority = "2" if weight <= 50 else "1"
        assert run_length(split, minority) == RUN_REQUESTS
        mean = sum(run_length(split, "1") + run_length(split, "2") for _ in range(2000)) / 2000
        candidate = sum(run_length(split, "2") for _ in range(2000)) / 2000
        assert candidate / mean == pytest.approx(weight / 100, rel=0.05), weight
    assert run_length(VersionSplit("1", "2", 100), "1") == 0
    # One connection alternating: runs at each version, each ending with a move to the other.
    split, turn, served = VersionSplit("1", "2", 20), ConnectionTurn(), Counter()
    version = "1"
    for _ in range(10 * 5 * RUN_REQUESTS):
        assert turn.serves(split, version, None)
        served[version] += 1
        if turn.move_to:
            version, turn = turn.move_to, ConnectionTurn()
    assert served["2"] / sum(served.values()) == pytest.approx(0.2, abs=RUN_REQUESTS / 500)


def _placed_runs(weight: int, clients: int, rounds: int, speed=lambda version: 1) -> tuple[Counter, int, Counter]:
    """Clients that each answer a run at a time, in lockstep (a client at a version of speed k
    takes k rounds a request): (requests answered per version, the most connections any version
    held beyond its weight's share, rounded up, and the first client's requests per version)."""
    split, placement = VersionSplit("1", "2", weight), SplitPlacement(expire_s=60)
    served, worst, first = Counter(), 0, Counter()
    runs = {client: [*placement.place("m", split, client, 0.0), 0] for client in range(clients)}
    for now in range(rounds):
        for client, run in runs.items():
            version, left, waited = run
            if waited + 1 < speed(version):
                run[2] += 1
                continue
            served[version] += 1
            first[version] += client == 0
            run[1], run[2] = left - 1, 0
            if run[1] == 0:
                placement.leaves(client)
                run[:2] = placement.place("m", split, client, now / 1000)  # a round: 1 ms
        for version, share in (("1", 100 - weight), ("2", weight)):
            worst = max(worst, placement.connections("m", version) - math.ceil(share * clients / 100))
    return served, worst, first


@pytest.mark.parametrize("weight", [1, 10, 50, 80])
@pytest.mark.parametrize("clients", [1, 2, 8, 50])
def test_placed_runs_give_each_version_its_weight_and_spread_the_connections_by_it(weight, clients):
    served, worst, first = _placed_runs(weight, clients, rounds=400 * RUN_REQUESTS // clients + 20 * RUN_REQUESTS)
    # No version holds more than one connection beyond its share of them.
    assert worst <= 1, (weight, clients)
    share = served["2"] / sum(served.values())
    # Within two runs of the requests answered, or of a connection's share of them.
    assert share == pytest.approx(weight / 100, abs=max(2 * RUN_REQUESTS * clients / sum(served.values()), 0.02))
    if clients <= 2:  # one client alone, or beside another: its own runs go to both versions by weight
        slack = 0.02 if clients == 1 else 0.1  # two clients in lockstep share the runs less evenly
        assert first["2"] / sum(first.values()) == pytest.approx(weight / 100, abs=slack)


def test_a_slower_candidate_gets_no_more_connections_than_its_share_and_one():
    # Three times slower: without a bound its connections stay three times longer.
    served, worst, _ = _placed_runs(10, 8, rounds=300 * RUN_REQUESTS, speed=lambda v: 3 if v == "2" else 1)
    assert worst <= 1
    assert 0.02 < served["2"] / sum(served.values()) <= 0.1


def test_a_placement_counts_a_connection_once_and_forgets_one_not_placed_again():
    placement, split = SplitPlacement(expire_s=10), VersionSplit("", "2", 50)
    version, length = placement.place("m/", split, ("10.0.0.1", 5000), 0.0)
    assert length == RUN_REQUESTS and placement.connections("m/", version) == 1
    # Placed again (its run ended, or goes on): it moves, it is not counted twice.
    placement.at("m/", "2", ("10.0.0.1", 5000), 1.0)
    assert placement.connections("m/", "2") == 1 and placement.connections("m/", "") == 0
    placement.at("m/", "", None, 1.0)  # an unknown client's address: not counted
    assert placement.connections("m/", "") == 0
    placement.place("m/", split, ("10.0.0.2", 5000), 20.0)  # 19 s later: the first one is forgotten
    assert placement.connections("m/", "2") + placement.connections("m/", "") == 1


def test_a_turn_carries_its_rest_cuts_it_on_a_new_weight_and_leaves_sticky_values_alone():
    split = VersionSplit("1", "2", 10, "x-user")
    turn = ConnectionTurn()
    assert turn.serves(split, "2", None) and turn.next_place() == f"2 {RUN_REQUESTS - 1}"
    carried = ConnectionTurn(RUN_REQUESTS - 1)  # placed again at another replica of version 2
    for _ in range(RUN_REQUESTS - 1):
        assert carried.serves(split, "2", None)
    assert carried.next_place() == "1"
    # A sticky value goes by its bucket, whatever the run.
    user = next(f"u{n}" for n in range(100) if pick_version(split, f"u{n}") == "1")
    assert not ConnectionTurn().serves(split, "2", user) and ConnectionTurn().serves(split, "1", user)
    # The weight goes from 1% to 50%: the stable version's long run is cut to the new length.
    long = ConnectionTurn()
    long.serves(VersionSplit("1", "2", 1), "1", None)
    assert long.left > 50 * RUN_REQUESTS
    long.serves(VersionSplit("1", "2", 50), "1", None)
    assert long.left == RUN_REQUESTS - 1
    # A version with no weight answers none.
    assert not ConnectionTurn().serves(VersionSplit("1", "2", 0), "2", None)


def test_runs_that_end_with_a_new_connection_grow_with_the_minoritys_weight():
    """A gRPC connection's minority run: GRPC_RUN_REQUESTS at 50%, in proportion to a smaller
    weight, at least RUN_REQUESTS; the majority's keeps the weights' ratio, so that both runs
    together are about twice GRPC_RUN_REQUESTS at any weight the floor does not reach."""
    for weight, run in ((1, RUN_REQUESTS), (5, RUN_REQUESTS), (10, GRPC_RUN_REQUESTS // 5),
                        (30, GRPC_RUN_REQUESTS * 3 // 5), (50, GRPC_RUN_REQUESTS), (80, GRPC_RUN_REQUESTS * 2 // 5),
                        (99, RUN_REQUESTS)):
        split = VersionSplit("1", "2", weight)
        assert minority_run(split, reconnects=True) == run and minority_run(split) == RUN_REQUESTS
        minority, majority = ("2", "1") if weight <= 50 else ("1", "2")
        assert run_length(split, minority, reconnects=True) == run
        mean = sum(run_length(split, majority, reconnects=True) for _ in range(2000)) / 2000
        assert mean == pytest.approx(run * max(weight, 100 - weight) / min(weight, 100 - weight), rel=0.01)
        if run > RUN_REQUESTS:
            assert run + mean == pytest.approx(2 * GRPC_RUN_REQUESTS, rel=0.01)
    # Placed and carried the same way: a reconnecting turn's new weight cuts its run to that length.
    _, length = SplitPlacement(expire_s=10, reconnects=True).place("m/", VersionSplit("1", "2", 50), None, 0.0)
    assert length == GRPC_RUN_REQUESTS
    turn = ConnectionTurn(reconnects=True)
    turn.serves(VersionSplit("1", "2", 1), "1", None)
    turn.serves(VersionSplit("1", "2", 40), "1", None)
    mean = GRPC_RUN_REQUESTS * 40 // 50 * 60 / 40  # (chance rounds a fractional mean)
    assert turn.left in (int(mean) - 1, int(mean))


def test_figures_come_from_the_statistics_and_count_from_a_start():
    import time

    now = time.time()
    figures = version_figures(_stats(99, 1, 2000.0), now)
    assert (figures.successes, figures.failures, figures.requests) == (99, 1, 100)
    assert figures.p99_us == pytest.approx(2000.0, rel=0.02)
    assert figures.queue_ms == pytest.approx(0.01)
    step = figures_since(figures, VersionFigures(50, 1, figures.queue_ns // 2))
    assert (step.successes, step.failures) == (49, 0)
    assert math.isnan(version_figures(_stats(0, 0, 1.0), now).p99_us)


def test_a_step_passes_fails_or_waits():
    settings = RolloutSettings(step_seconds=5, step_requests=20)
    stable = VersionFigures(1000, 10, 1000 * 50_000, 20_000.0)  # 1% failed, p99 20 ms, queue 0.05 ms
    good = VersionFigures(40, 0, 40 * 50_000, 22_000.0)
    assert judge(VersionFigures(10, 0), stable, settings, 60).passed is None  # too few requests
    assert judge(good, stable, settings, 1).passed is None  # too early
    assert judge(good, stable, settings, 6).passed is True
    failing = judge(VersionFigures(32, 8, 0, 20_000.0), stable, settings, 1)  # 20% failed
    assert failing.passed is False and "failure rate 20.0%" in failing.reason
    slow = judge(VersionFigures(100, 0, 100 * 50_000, 60_000.0), stable, settings, 1)  # 3x the p99
    assert slow.passed is False and "p99 latency 60.00 ms" in slow.reason
    # The p99 of fewer than LATENCY_MIN_REQUESTS requests is their slowest: not judged yet.
    assert judge(VersionFigures(99, 0, 99 * 50_000, 60_000.0), stable, settings, 1).passed is None
    queued = judge(VersionFigures(40, 0, 40 * 5_000_000, 20_000.0), stable, settings, 1)  # 5 ms queue
    assert queued.passed is False and "mean queue time" in queued.reason
    # Within the slack: a model answering in microseconds is not judged on noise.
    fast = VersionFigures(1000, 0, 0, 30.0)
    assert judge(VersionFigures(400, 0, 0, 300.0), fast, settings, 6).passed is True


def _answer(*outputs: tuple[str, object]) -> InferResponse:
    return InferResponse("m", "1", [InferOutput(name, "FP32" if np.asarray(v).dtype.kind == "f" else "BYTES",
                                                np.asarray(v).shape, np.asarray(v)) for name, v in outputs])


def test_shadow_answers_agree_within_the_tolerance_and_labels_by_argmax():
    stable = _answer(("probs", np.array([[0.1, 0.9], [0.8, 0.2]], np.float32)))
    assert answers_agree(stable, _answer(("probs", np.array([[0.1, 0.9], [0.8, 0.2]], np.float32) + 1e-7)), 1e-5)
    close_labels = _answer(("probs", np.array([[0.3, 0.7], [0.6, 0.4]], np.float32)))
    assert not answers_agree(stable, close_labels, 1e-5) and labels_agree(stable, close_labels) is True
    flipped = _answer(("probs", np.array([[0.9, 0.1], [0.8, 0.2]], np.float32)))
    assert labels_agree(stable, flipped) is False
    assert not answers_agree(stable, _answer(("other", np.zeros((2, 2), np.float32))), 1e-5)
    assert not answers_agree(stable, _answer(("probs", np.zeros((2, 3), np.float32))), 1e-5)
    text = _answer(("text", np.array([b"a", b"b"], dtype=object)))
    assert answers_agree(text, _answer(("text", np.array([b"a", b"b"], dtype=object))), 0)
    assert labels_agree(text, text) is None  # no numeric output with classes


def test_a_rollout_fails_on_shadow_agreement_once_enough_were_compared():
    settings = rollout_settings({"rollout_steps": "0,100", "rollout_shadow_percent": "50",
                                 "rollout_step_requests": "10", "rollout_min_agreement": "0.9"}, "m")
    assert settings.steps == (0, 100) and settings.shadow_percent == 50
    assert shadow_verdict(ShadowCounts(compared=9, agreed=0), settings) is None  # too few
    assert shadow_verdict(ShadowCounts(compared=10, agreed=9), settings) is None
    failed = judge(VersionFigures(50, 0), VersionFigures(50, 0), settings, 100, ShadowCounts(compared=10, agreed=8))
    assert failed.passed is False and "shadow answers agreed 80.0%" in failed.reason
    labels = rollout_settings({"rollout_steps": "100", "rollout_shadow_percent": "5", "rollout_step_requests": "2",
                               "rollout_shadow_compare": "labels"}, "m")
    assert "shadow labels" in shadow_verdict(ShadowCounts(compared=4, agreed=0, labelled=4, labels_agreed=1), labels).reason
    with pytest.raises(InvalidArgError, match="needs 'rollout_shadow_percent'"):
        rollout_settings({"rollout_steps": "0,100"}, "m")


def test_settings_come_from_a_parsed_config_too(tmp_path):
    from rayinfer.repository.model_config import read_config

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text('name: "m"\nbackend: "python"\n'
                                           'parameters { key: "rollout_steps" value: { string_value: "20,100" } }\n'
                                           'parameters { key: "rollout_max_latency_ratio" value: { string_value: "3" } }\n')
    config = read_config(tmp_path / "m", required=True)
    settings = rollout_settings(config.parameters, "m")
    assert settings is not None and (settings.steps, settings.max_latency_ratio) == ((20, 100), 3.0)
