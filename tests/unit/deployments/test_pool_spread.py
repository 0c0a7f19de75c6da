"""Spreading busy pooled versions over pool replicas (deployments/pool_spread.py): the rate,
how many copies a version wants, and which replicas load them."""

from __future__ import annotations

from rayinfer.deployments.pool_spread import RequestRates, busy_versions, copies_wanted, spread

NOW = 1_000_000.0


def _report(loaded: dict[str, str], evicted: dict[str, str] | None = None, rpm: dict[str, float] | None = None,
            age_s: float = 1.0) -> dict:
    return {"loaded": loaded, "evicted": evicted or {}, "failed": {}, "rpm": rpm or {}, "at": NOW - age_s}


def test_the_rate_is_requests_per_minute_over_the_last_ten_seconds():
    rates = RequestRates()
    rates.sample({"a": 0, "b": 7}, now=0.0)
    rates.sample({"a": 100, "b": 7}, now=5.0)
    rates.sample({"a": 200, "b": 7}, now=10.0)
    assert rates.per_minute() == {"a": 1200.0}  # b had no request
    rates.sample({"a": 200}, now=25.0)  # idle for 15 s: the window holds no request
    assert rates.per_minute() == {}
    rates.sample({"a": 230}, now=27.0)  # measured from the last sample at or before the window's start
    assert rates.per_minute() == {"a": 30 * 60 / 17}


def test_a_version_wants_a_copy_per_threshold_at_most_one_per_replica():
    assert copies_wanted(5000, 2000, 4) == 3
    assert copies_wanted(5000, 2000, 2) == 2
    assert copies_wanted(100, 2000, 3) == 1
    assert copies_wanted(0, 2000, 3) == 1
    assert copies_wanted(99999, 0, 3) == 1  # 0: never spread


def test_the_missing_copies_go_to_the_replicas_holding_fewest_versions():
    reports = {
        "r1": _report({"a": "d1", "x": "dx"}, rpm={"a": 3000.0}),
        "r2": _report({"y": "dy", "z": "dz"}, evicted={"a": "d1"}),
        "r3": _report({"y": "dy"}, evicted={"a": "d1"}),
    }
    assert spread(reports, 2000, NOW) == {"r3": {"a"}}
    assert spread(reports, 1000, NOW) == {"r2": {"a"}, "r3": {"a"}}
    assert spread(reports, 5000, NOW) == {}
    assert busy_versions(reports, 2000, NOW) == {"a"} and busy_versions(reports, 5000, NOW) == set()


def test_copies_already_loaded_count_and_their_rates_add_up():
    reports = {
        "r1": _report({"a": "d1"}, rpm={"a": 1500.0}),
        "r2": _report({"a": "d1"}, rpm={"a": 1500.0}),
        "r3": _report({}, evicted={"a": "d1"}),
    }
    assert spread(reports, 2000, NOW) == {}  # 3,000 rpm in all: two copies, loaded
    reports["r1"]["rpm"]["a"] = 4000.0
    assert spread(reports, 2000, NOW) == {"r3": {"a"}}


def test_a_stopped_replica_an_other_spec_or_a_failed_load_is_no_candidate():
    reports = {
        "r1": _report({"a": "d1"}, rpm={"a": 9000.0}),
        "r2": _report({}, evicted={"a": "d1"}, age_s=60.0),  # stopped reporting
        "r3": _report({}, evicted={"a": "d0"}),  # an older spec of the version
        "r4": _report({}),  # failed to load it (neither loaded nor unloaded)
    }
    assert spread(reports, 2000, NOW) == {}
    reports["r2"]["at"] = NOW
    assert spread(reports, 2000, NOW) == {"r2": {"a"}}


def test_replicas_reading_the_same_reports_agree():
    reports = {f"r{i}": _report({}, evicted={"a": "d1", "b": "d2"}) for i in range(4)}
    reports["r0"] = _report({"a": "d1", "b": "d2"}, rpm={"a": 5000.0, "b": 2500.0})
    first = spread(reports, 2000, NOW)
    assert first == spread(dict(reversed(list(reports.items()))), 2000, NOW)
    copies = {app: 1 + sum(app in apps for apps in first.values()) for app in ("a", "b")}
    assert copies == {"a": 3, "b": 2}
