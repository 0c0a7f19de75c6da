"""A model's autoscaling, from its config's ``parameters`` (beyond Triton, whose instance counts
are fixed).

    parameters { key: "autoscaling_max_replicas" value: { string_value: "4" } }

turns the model's replica count into a range Serve scales within, from the requests in flight
in its replicas (those the front relays included). The keys, all optional but the maximum:

- ``autoscaling_min_replicas`` (default 1; 0 lets an idle model scale to zero: the model stays
  loaded and ready, and the first request after it waits for a replica to start),
- ``autoscaling_max_replicas``,
- ``autoscaling_target_ongoing_requests``: requests in flight per replica to aim at (default 2),
- ``autoscaling_upscale_delay_s`` (default 30), ``autoscaling_downscale_delay_s`` (default 600):
  how long the need must last before replicas are added or removed,
- ``autoscaling_downscale_to_zero_delay_s`` (default: the downscale delay): how long a model
  with a minimum of 0 stays idle on its last replica before that one is removed too,
- ``autoscaling_look_back_period_s``: the window the requests in flight are averaged over
  (default 30, at least 2: the replicas report them once a second).

The instance group's count is the initial number of replicas (kept within the range).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rayinfer.protocol.errors import ModelConfigError
from rayinfer.repository.model_config import ModelConfig

PREFIX = "autoscaling_"


@dataclass(frozen=True)
class AutoscalingSpec:
    min_replicas: int
    max_replicas: int
    target_ongoing_requests: float = 2.0
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_period_s: float = 30.0
    downscale_to_zero_delay_s: float | None = None


# parameter (without the prefix) -> (type, smallest value allowed)
_FIELDS: dict[str, tuple[type, float]] = {
    "min_replicas": (int, 0),
    "max_replicas": (int, 1),
    "target_ongoing_requests": (float, 0.001),
    "upscale_delay_s": (float, 0.0),
    "downscale_delay_s": (float, 0.0),
    "downscale_to_zero_delay_s": (float, 0.0),
    # At least two of the replicas' reports (one a second, cluster/settings.py).
    "look_back_period_s": (float, 2.0),
}


def autoscaling_spec(config: ModelConfig, path: Path) -> AutoscalingSpec | None:
    """The model's autoscaling (None when its config sets no ``autoscaling_*`` parameter);
    :class:`ModelConfigError` naming the file and the parameter when one is wrong."""
    given = {key[len(PREFIX):]: value.string_value for key, value in config.parameters.items()
             if key.startswith(PREFIX)}
    if not given:
        return None
    values: dict[str, float] = {}
    for name, text in given.items():
        if name not in _FIELDS:
            raise ModelConfigError(f"{path}: unknown parameter '{PREFIX}{name}' (known: "
                                   f"{', '.join(PREFIX + n for n in _FIELDS)})")
        kind, least = _FIELDS[name]
        try:
            value = kind(text.strip())
        except ValueError:
            raise ModelConfigError(f"{path}: parameter '{PREFIX}{name}' must be a{'n integer' if kind is int else ' number'}, "
                                   f"got '{text}'") from None
        if value < least:
            raise ModelConfigError(f"{path}: parameter '{PREFIX}{name}' must be at least {least:g}, got '{text}'")
        values[name] = value
    if "max_replicas" not in values:
        raise ModelConfigError(f"{path}: the autoscaling parameters need '{PREFIX}max_replicas'")
    values.setdefault("min_replicas", 1)
    if "downscale_to_zero_delay_s" in values and values["min_replicas"] != 0:
        raise ModelConfigError(f"{path}: '{PREFIX}downscale_to_zero_delay_s' needs '{PREFIX}min_replicas' 0")
    if values["min_replicas"] > values["max_replicas"]:
        raise ModelConfigError(f"{path}: '{PREFIX}min_replicas' ({values['min_replicas']:g}) is more than "
                               f"'{PREFIX}max_replicas' ({values['max_replicas']:g})")
    return AutoscalingSpec(**values)  # type: ignore[arg-type]
