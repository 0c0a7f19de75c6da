"""FrameBudgets: a gRPC client's flow control and bandwidth probes, which follow the DATA sent
to it, are free; the same frames with nothing sent are a flood, cut off past the budget."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rayinfer.protocol.grpc_wire import ENHANCE_YOUR_CALM, H2ProtocolError
from rayinfer.protocol.limits import DEFAULT_CONNECTION_LIMITS
from rayinfer.transport.h2_budgets import FrameBudgets

LIMITS = replace(DEFAULT_CONNECTION_LIMITS, max_control_frames=100)


def test_two_window_updates_and_a_ping_per_data_frame_sent_are_free() -> None:
    budgets = FrameBudgets(LIMITS)
    for _ in range(10_000):  # a long gRPC stream: one response, then its client's three frames
        budgets.data_sent(1)
        for _ in range(3):
            budgets.window_update()


def test_pings_with_nothing_sent_are_cut_off_past_the_budget() -> None:
    budgets = FrameBudgets(LIMITS)
    budgets.data_sent(1)
    with pytest.raises(H2ProtocolError) as caught:
        for _ in range(3 + 101):
            budgets.window_update()
    assert caught.value.code == ENHANCE_YOUR_CALM
