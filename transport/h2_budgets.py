"""What one client's HTTP/2 connection may spend in each period of :data:`PERIOD_S`: streams it
resets (and malformed requests, which this side resets), and control frames (PING, SETTINGS,
PRIORITY, empty DATA, unknown frames, HEADERS on an open call, WINDOW_UPDATEs for nothing this
side sent). Past either budget the connection ends with ENHANCE_YOUR_CALM
(``--grpc-max-reset-streams``, ``--grpc-max-control-frames``).

A client gives back the window of the DATA this side sends with WINDOW_UPDATEs, up to two for
each DATA frame (the stream's and the connection's), and a gRPC client measures the
connection's bandwidth-delay product with a PING as that DATA arrives: those (three frames for
each DATA frame sent) are free, the rest count as control frames, so a flood of them is cut off.
"""

from __future__ import annotations

import time

from rayinfer.protocol.grpc_wire import ENHANCE_YOUR_CALM, H2ProtocolError
from rayinfer.protocol.limits import ConnectionLimits

PERIOD_S = 10.0
# WINDOW_UPDATEs and PINGs owed for DATA sent, at most (a client that saves them up spends the rest).
MAX_WINDOW_CREDITS = 4096


class FrameBudgets:
    """One connection's budgets under ``limits`` (its ``max_reset_streams`` and ``max_control_frames``)."""

    __slots__ = ("_limits", "_period_ends", "_resets", "_control_frames", "_window_credits")

    def __init__(self, limits: ConnectionLimits) -> None:
        self._limits = limits
        self._period_ends = time.monotonic() + PERIOD_S
        self._resets = self._control_frames = 0
        self._window_credits = 0

    def spend(self, resets: int, control_frames: int) -> None:
        """Count streams reset and control frames; :class:`H2ProtocolError` past a budget."""
        now = time.monotonic()
        if now >= self._period_ends:
            self._period_ends, self._resets, self._control_frames = now + PERIOD_S, 0, 0
        self._resets += resets
        self._control_frames += control_frames
        if self._resets > self._limits.max_reset_streams:
            raise H2ProtocolError(ENHANCE_YOUR_CALM, f"over {self._limits.max_reset_streams} streams reset in "
                                  f"{PERIOD_S:g} s (--grpc-max-reset-streams)")
        if self._control_frames > self._limits.max_control_frames:
            raise H2ProtocolError(ENHANCE_YOUR_CALM, f"over {self._limits.max_control_frames} control frames in "
                                  f"{PERIOD_S:g} s (--grpc-max-control-frames)")

    def data_sent(self, frames: int) -> None:
        """``frames`` DATA frames went out: two WINDOW_UPDATEs and a PING each are free."""
        self._window_credits = min(self._window_credits + 3 * frames, MAX_WINDOW_CREDITS)

    def window_update(self) -> None:
        """A WINDOW_UPDATE or a PING arrived: free while DATA sent owes it, else a control frame."""
        if self._window_credits > 0:
            self._window_credits -= 1
        else:
            self.spend(0, 1)
