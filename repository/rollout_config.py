"""A model's rollout settings: how a new version is rolled out beside the one serving, from the
model config's ``parameters`` (beyond Triton, which has no traffic split) or a load request's.

    parameters { key: "rollout_steps" value: { string_value: "10,50,100" } }

makes every new highest version of the model a *candidate* beside the *stable* version served
before it: requests that name no version go to the candidate by the step's weight (percent), and
the server judges it at each step against the stable version (:mod:`rayinfer.serving.rollout_analysis`).
The keys, all optional but ``rollout_steps``:

- ``rollout_steps``: the candidate's weight at each step, rising percentages ending at 100,
- ``rollout_step_seconds`` (default 60) and ``rollout_step_requests`` (default 100): how long,
  and how many of the candidate's requests, a step lasts at least before the next,
- ``rollout_max_failure_rate`` (default 0.05): how much higher than the stable version's the
  candidate's share of failed requests may be,
- ``rollout_max_latency_ratio`` (default 1.5) and ``rollout_max_queue_ratio`` (default 2.0): how
  many times the stable version's p99 request latency and mean queue time the candidate's may be,
- ``rollout_latency_slack_ms`` (default 1): latency and queue differences below this never fail
  a step (a model answering in microseconds has noisy ratios),
- ``rollout_sticky_header``: a request header (gRPC metadata key) whose value picks the version
  (the same value always reaches the same version) instead of chance,
- ``rollout_automatic`` (default true): false leaves the steps to ``rayinfer rollout promote``,
  with the candidate judged and rolled back all the same,
- ``rollout_shadow_percent`` (default 0): the share of the stable version's requests also sent
  to the candidate, whose answers are compared with the stable version's and discarded
  (:mod:`rayinfer.serving.shadow`); with it, the first step may be 0 (shadow traffic only),
- ``rollout_shadow_compare`` (default "outputs"): "outputs" (every value within
  ``rollout_shadow_tolerance``, default 1e-5) or "labels" (the same argmax, for classifiers),
- ``rollout_min_agreement`` (default 0.99): the share of shadow requests that must agree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from rayinfer.protocol.errors import InvalidArgError

PREFIX = "rollout_"
_HEADER = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")


@dataclass(frozen=True)
class RolloutSettings:
    steps: tuple[int, ...] = (10, 50, 100)
    step_seconds: float = 60.0
    step_requests: int = 100
    max_failure_rate: float = 0.05
    max_latency_ratio: float = 1.5
    max_queue_ratio: float = 2.0
    latency_slack_ms: float = 1.0
    sticky_header: str = ""
    automatic: bool = True
    shadow_percent: int = 0
    shadow_tolerance: float = 1e-5
    shadow_compare: str = "outputs"
    min_agreement: float = 0.99

    def as_dict(self) -> dict[str, Any]:
        """The settings as the rollout API reports them."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}


# key (without the prefix) -> smallest value allowed (None: not a number)
_LEAST: dict[str, float | None] = {
    "steps": None, "step_seconds": 0.0, "step_requests": 0, "max_failure_rate": 0.0, "max_latency_ratio": 1.0,
    "max_queue_ratio": 1.0, "latency_slack_ms": 0.0, "sticky_header": None, "automatic": None,
    "shadow_percent": 0, "shadow_tolerance": 0.0, "shadow_compare": None, "min_agreement": 0.0,
}


def rollout_settings(parameters: Mapping[str, Any], model: str) -> RolloutSettings | None:
    """The rollout settings in ``parameters`` (``rollout_*`` keys; values strings, or a config's
    ``{"string_value": ...}``), None when they hold no ``rollout_steps``; :class:`InvalidArgError`
    naming the model and the key when one is wrong."""
    given = {key[len(PREFIX):]: _string(value) for key, value in parameters.items() if key.startswith(PREFIX)}
    if not given:
        return None
    if "steps" not in given:
        raise InvalidArgError(f"model '{model}': the rollout parameters need '{PREFIX}steps' (e.g. '10,50,100')")
    return settings_from(given, model)


def settings_from(given: Mapping[str, str], model: str, base: RolloutSettings | None = None) -> RolloutSettings:
    """``base`` (the defaults) with the keys of ``given`` (without the prefix) applied."""
    values: dict[str, Any] = {}
    for name, text in given.items():
        if name not in _LEAST:
            raise InvalidArgError(f"model '{model}': unknown parameter '{PREFIX}{name}' (known: "
                                  f"{', '.join(PREFIX + n for n in _LEAST)})")
        values[name] = _value(name, str(text).strip(), model)
    settings = replace(base or RolloutSettings(), **values)
    if settings.steps[0] == 0 and not settings.shadow_percent:
        raise InvalidArgError(f"model '{model}': a first step of 0 (shadow traffic only) needs '{PREFIX}shadow_percent'")
    return settings


def _value(name: str, text: str, model: str) -> Any:
    key = PREFIX + name
    if name == "steps":
        try:
            steps = tuple(int(part) for part in text.replace(" ", "").split(",") if part)
        except ValueError:
            steps = ()
        if not steps or steps[-1] != 100 or any(not 0 <= s <= 100 for s in steps) \
                or any(a >= b for a, b in zip(steps, steps[1:])):
            raise InvalidArgError(f"model '{model}': parameter '{key}' must be rising percentages ending at 100 "
                                  f"(e.g. '10,50,100'), got '{text}'")
        return steps
    if name == "sticky_header":
        if text and not _HEADER.match(text):
            raise InvalidArgError(f"model '{model}': parameter '{key}' must be a header name, got '{text}'")
        return text.lower()
    if name == "shadow_compare":
        if text not in ("outputs", "labels"):
            raise InvalidArgError(f"model '{model}': parameter '{key}' must be 'outputs' or 'labels', got '{text}'")
        return text
    if name == "automatic":
        if text.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            raise InvalidArgError(f"model '{model}': parameter '{key}' must be true or false, got '{text}'")
        return text.lower() in ("true", "1", "yes", "on")
    whole = name in ("step_requests", "shadow_percent")
    try:
        number: float = int(text) if whole else float(text)
    except ValueError:
        raise InvalidArgError(f"model '{model}': parameter '{key}' must be a{' whole' if whole else ''} number, "
                              f"got '{text}'") from None
    least = _LEAST[name]
    assert least is not None
    bounded = name in ("shadow_percent", "min_agreement")
    if number < least or number != number or (bounded and number > (100 if name == "shadow_percent" else 1)):
        bound = {"shadow_percent": "between 0 and 100", "min_agreement": "between 0 and 1"}.get(name, f"at least {least:g}")
        raise InvalidArgError(f"model '{model}': parameter '{key}' must be {bound}, got '{text}'")
    return number


def _string(value: Any) -> str:
    if isinstance(value, Mapping):  # a config's parameter in Triton's JSON form
        return str(value.get("string_value", ""))
    if hasattr(value, "string_value"):  # a config's ModelParameter message
        return str(value.string_value)
    return str(value)
