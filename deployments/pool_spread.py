"""Spreading a busy pooled version over several pool replicas (--pool-scale-up-rpm).

With several pool replicas and ``--pool-max-models``, a version is loaded only where a request
asked for it lately, so a busy version could sit on one replica while its neighbours idle. As
KServe's ModelMesh does with its ``scaleup_rpm_threshold``, the pool adds copies of a version
whose requests per minute, spread over its loaded copies, pass a threshold: it wants
``ceil(rpm / threshold)`` copies (at most one per replica), and the replicas holding fewest
versions load the missing ones. A copy loaded this way registers its listener, so the front
spreads new connections over every copy, and Serve's router spreads handle calls over them.
While the version stays that busy, its copies count as used (the budget unloads others first);
once it cools, the budget unloads the extra copies as any idle version.

Each replica decides alone, from every replica's hosting report in Ray's key-value store
(:mod:`cluster_records`: the versions loaded and each one's requests per minute there); the
decision is a pure function of the reports, so replicas that read the same reports pick the
same replicas, and one load per version is all a round adds.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

# How far back the requests per minute look (the rate of the last ten seconds, as ModelMesh's).
RATE_WINDOW_S = 10.0
# A report older than this is a replica's that stopped (it is left out of the decision).
REPORT_TTL_S = 15.0


class RequestRates:
    """Each version's requests per minute in this replica over the last :data:`RATE_WINDOW_S`,
    from its cumulative request counts sampled as the report loop goes round."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self._window_s = window_s
        self._samples: dict[str, deque[tuple[float, int]]] = {}

    def sample(self, counts: dict[str, int], now: float | None = None) -> None:
        """Record each version's cumulative request count now; versions not given are forgotten."""
        now = time.monotonic() if now is None else now
        for app in set(self._samples) - set(counts):
            del self._samples[app]
        for app, count in counts.items():
            samples = self._samples.setdefault(app, deque())
            samples.append((now, count))
            while len(samples) > 2 and now - samples[1][0] >= self._window_s:
                samples.popleft()  # keep one sample at or before the window's start

    def per_minute(self) -> dict[str, float]:
        """{version: requests per minute} for versions with requests in the window."""
        rates = {}
        for app, samples in self._samples.items():
            (start, first), (end, last) = samples[0], samples[-1]
            if end > start and last > first:
                rates[app] = (last - first) * 60.0 / (end - start)
        return rates


def copies_wanted(rpm: float, threshold_rpm: float, replicas: int) -> int:
    """How many loaded copies a version with ``rpm`` requests per minute in all wants: one per
    ``threshold_rpm`` (ModelMesh's rule), at least one, at most one per replica."""
    if threshold_rpm <= 0:
        return 1
    return max(1, min(replicas, math.ceil(rpm / threshold_rpm)))


def spread(reports: dict[str, dict[str, Any]], threshold_rpm: float,
           now: float | None = None) -> dict[str, set[str]]:
    """{replica id: versions it is to load} so that every busy version has the copies it wants.

    ``reports``: {replica id: its hosting report}, each with ``"loaded"`` ({version: digest}),
    ``"evicted"``, ``"failed"``, ``"rpm"`` ({version: its requests per minute there}) and
    ``"at"`` (Unix time of the report). A version goes to replicas that serve it (it is among
    their loaded or unloaded versions with the same spec) and do not hold it, those holding
    fewest versions first, then by id.
    """
    live, totals = _live_rates(reports, now)
    wanted: dict[str, set[str]] = {}
    loads = {replica: len(report.get("loaded") or {}) for replica, report in live.items()}
    for app, rpm in sorted(totals.items()):
        holders = [replica for replica, report in live.items() if app in (report.get("loaded") or {})]
        missing = copies_wanted(rpm, threshold_rpm, len(live)) - len(holders)
        if missing <= 0 or not holders:
            continue
        digest = live[holders[0]]["loaded"][app]
        candidates = sorted((replica for replica, report in live.items() if replica not in holders
                             and (report.get("evicted") or {}).get(app) == digest),
                            key=lambda replica: (loads[replica], replica))
        for replica in candidates[:missing]:
            wanted.setdefault(replica, set()).add(app)
            loads[replica] += 1
    return wanted


def busy_versions(reports: dict[str, dict[str, Any]], threshold_rpm: float, now: float | None = None) -> set[str]:
    """The versions busy enough to want more than one copy (their copies are kept loaded)."""
    live, totals = _live_rates(reports, now)
    return {app for app, rpm in totals.items() if copies_wanted(rpm, threshold_rpm, len(live)) > 1}


def _live_rates(reports: dict[str, dict[str, Any]],
                now: float | None) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
    """The reports of replicas still reporting, and each version's requests per minute over them."""
    now = time.time() if now is None else now
    live = {replica: report for replica, report in reports.items()
            if now - float(report.get("at") or 0.0) <= REPORT_TTL_S}
    totals: dict[str, float] = {}
    for report in live.values():
        for app, rpm in (report.get("rpm") or {}).items():
            totals[app] = totals.get(app, 0.0) + float(rpm)
    return live, totals
