"""Serve autoscaling for models whose config asks for it (:mod:`rayinfer.repository.autoscaling`).

Serve's own policy counts the requests that travel through Serve (its ingress and deployment
handles). Inference calls the front relays go to the replicas' own listeners, which Serve does not
see, so each replica reports the calls its listener is answering as a custom autoscaling metric
(``ModelDeployment.record_autoscaling_stats``) and :func:`front_traffic_policy` adds them to
Serve's count. Serve applies the bounds and the delays around it.
"""

from __future__ import annotations

from typing import Any

from rayinfer.repository.autoscaling import AutoscalingSpec

# The custom metric each replica of an autoscaled model reports.
LISTENER_ONGOING = "rayinfer_listener_ongoing_requests"
POLICY = "rayinfer.deployments.autoscaling:front_traffic_policy"


def serve_autoscaling_config(spec: AutoscalingSpec, initial_replicas: int) -> dict[str, Any]:
    """Serve's ``autoscaling_config`` for ``spec``, starting at ``initial_replicas`` (kept
    within the range)."""
    return {
        "min_replicas": spec.min_replicas,
        "max_replicas": spec.max_replicas,
        "initial_replicas": min(max(initial_replicas, spec.min_replicas), spec.max_replicas),
        "target_ongoing_requests": spec.target_ongoing_requests,
        "upscale_delay_s": spec.upscale_delay_s,
        "downscale_delay_s": spec.downscale_delay_s,
        "look_back_period_s": spec.look_back_period_s,
        # How often replicas report: RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S in
        # rayinfer's Ray environment (this field is deprecated, but Serve still checks the look-back
        # window against it).
        "metrics_interval_s": 1.0,
        "policy": {"policy_function": POLICY},
        **({"downscale_to_zero_delay_s": spec.downscale_to_zero_delay_s}
           if spec.downscale_to_zero_delay_s is not None else {}),
    }


def front_traffic_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Replicas wanted: the requests in flight (Serve's count plus the listeners'), over the
    target per replica. ``ctx``: Serve's AutoscalingContext."""
    if ctx.current_num_replicas == 0:
        return ctx.target_num_replicas, {}
    listeners = (ctx.aggregated_metrics or {}).get(LISTENER_ONGOING, {})
    ongoing = float(ctx.total_num_requests) + sum(listeners.values())
    return ongoing / ctx.config.get_target_ongoing_requests(), {}
