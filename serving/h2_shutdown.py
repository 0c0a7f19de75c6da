"""How a client's gRPC connection that a model replica holds ends
(:class:`~rayinfer.serving.replica_h2.H2Connection`): gracefully, for a client's error, or for a
timeout or a budget it ran past.

The graceful close is RFC 9113's (section 6.8): a ``GOAWAY`` with the largest stream id and a
``PING``; once the ``PING`` is answered, every call the client sent before it has arrived, and a
second ``GOAWAY`` names the last of them; once they are answered the replica sends FIN and reads
on, dropping what arrives, until the client closes its end (:meth:`Shutdown._shut_down`). A
replica closes so when it rebalances a connection, when a rollout's run on it ends, when the
replica stops, and when the connection has been idle past its keep-alive timeout. A client's
error ends the connection at once (``GOAWAY`` with the RFC's error code, FIN, and what it still
sends dropped for a moment), and so do a header block not ended in time, answers not read in
time, a call's request not sent on, and more reset streams or control frames than their budgets
allow in :data:`_BUDGET_S`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from rayinfer.protocol.grpc_wire import ENHANCE_YOUR_CALM, MAX_WINDOW, PING, H2ProtocolError, frame, goaway
from rayinfer.protocol.limits import ConnectionLimits

logger = logging.getLogger("rayinfer.serving.replica_h2")

_GOING = b"rayinfer"  # the PING of a graceful close
_PING_WAIT_S = 2.0  # a client that does not answer that PING: the second GOAWAY anyway
_LINGER_S = 5.0  # after the last GOAWAY and answer: how long the client may take to close its end
_FAIL_LINGER_S = 1.0  # a connection closed for an error: how long what the client sends is dropped
_BUDGET_S = 10.0  # the period of the reset-stream and control-frame budgets


class Shutdown:
    """The ends of ``replica_h2.H2Connection``'s connection, a part of it."""

    _transport: Any
    _limits: ConnectionLimits
    _calls: dict[int, Any]
    _block: Any  # a header block in CONTINUATIONs, with the time it started, or None
    _highest: int  # the largest stream id the client opened
    _last_taken: int  # calls above this id are not taken
    _last_read: float
    _paused_at: float | None
    _buffer: bytes
    _write: Callable[[bytes], None]  # to the client (H2Connection's)
    _drop: Callable[[Any], None]  # a call is cancelled (H2Connection's)
    close: Callable[[], None]

    def _init_shutdown(self, now: float) -> None:
        self._going = 0  # 0 serving, 1 first GOAWAY and PING sent, 2 last GOAWAY sent
        self._shut = False  # all sent (the last GOAWAY, then FIN): what the client sends is dropped
        self._budget_at = now + _BUDGET_S
        self._resets = self._glitches = 0
        self._timer: asyncio.TimerHandle | None = None

    # graceful

    def hand_back(self) -> bool:
        """Close gracefully: no new calls once the client has seen the GOAWAY; the open ones
        are answered."""
        if self._transport is not None and not self._going:
            self._going = 1
            self._write(goaway(MAX_WINDOW) + frame(PING, 0, 0, _GOING))
            asyncio.get_running_loop().call_later(_PING_WAIT_S, self._last_goaway)
        return True

    def _last_goaway(self) -> None:
        if self._going == 1 and self._transport is not None:
            self._going = 2
            self._last_taken = self._highest
            self._write(goaway(self._highest))
            self._maybe_close()

    def _maybe_close(self) -> None:
        if self._going == 2 and not self._calls and self._transport is not None and not self._shut:
            self._shut_down()

    def _shut_down(self) -> None:
        """End a connection whose calls are answered, after the last GOAWAY: FIN, then read and
        drop what the client sends until it closes its end (or :data:`_LINGER_S` has passed).
        Closing at once would reset the connection when the client's next frames arrive (a
        call it started before it read the GOAWAY), and a client whose write fails first fails
        that call ("Stream removed (sendmsg: Broken pipe)", UNAVAILABLE) instead of sending it
        again on a new connection, as the GOAWAY tells it to."""
        self._shut = True
        self._buffer = b""
        self._transport.write_eof()
        asyncio.get_running_loop().call_later(_LINGER_S, self.close)

    def _ping_acked(self, data: bytes) -> None:
        """The client answered a PING: after the graceful close's, its last GOAWAY."""
        if data == _GOING and self._going == 1:
            self._last_goaway()

    # for a client's error, or a timeout or budget it ran past

    def _fail(self, code: int) -> None:
        """End the connection for a client's error: ``GOAWAY`` with ``code`` and FIN, then drop
        what it still sends for :data:`_FAIL_LINGER_S` (so that it reads the GOAWAY) and close;
        its calls are cancelled."""
        if self._transport is not None and not self._shut:
            self._shut = True
            self._transport.write(goaway(self._highest, code))
            self._transport.write_eof()
            asyncio.get_running_loop().call_later(_FAIL_LINGER_S, self._transport.abort)
            for call in list(self._calls.values()):
                self._drop(call)

    def _check_every(self) -> float:
        limits = self._limits
        return max(min(1.0, limits.request_head_timeout_s / 2, limits.keepalive_timeout_s / 2,
                       limits.send_timeout_s / 2), 0.05)

    def _check(self) -> None:
        """The connection's timeouts: a header block not ended, a client that does not read its
        answers, a connection idle (no call open) or silent (calls waiting for its bytes)."""
        if self._transport is None:
            return
        limits, now = self._limits, time.monotonic()
        if self._block is not None and now - self._block[4] > limits.request_head_timeout_s:
            logger.warning("closed a client's HTTP/2 connection: a header block not ended in %s s "
                           "(--http-request-timeout)", limits.request_head_timeout_s)
            self._fail(ENHANCE_YOUR_CALM)
            return
        if self._paused_at is not None and now - self._paused_at > limits.send_timeout_s:
            logger.warning("closed a client's HTTP/2 connection: its answers not read in %s s "
                           "(--client-send-timeout)", limits.send_timeout_s)
            self._transport.abort()
            return
        if now - self._last_read > limits.keepalive_timeout_s and self._paused_at is None:
            if not self._calls:
                self.hand_back()
            elif any(call.task is None for call in self._calls.values()):
                logger.warning("closed a client's HTTP/2 connection: a call's request not sent on for %s s "
                               "(--http-keepalive-timeout)", limits.keepalive_timeout_s)
                self._fail(ENHANCE_YOUR_CALM)
                return
        self._timer = asyncio.get_running_loop().call_later(self._check_every(), self._check)

    def _spend(self, resets: int, glitches: int) -> None:
        """Count reset streams and control frames against their budgets (per :data:`_BUDGET_S`)."""
        now = time.monotonic()
        if now >= self._budget_at:
            self._budget_at, self._resets, self._glitches = now + _BUDGET_S, 0, 0
        self._resets += resets
        self._glitches += glitches
        if self._resets > self._limits.max_reset_streams:
            raise H2ProtocolError(ENHANCE_YOUR_CALM, f"over {self._limits.max_reset_streams} streams reset in "
                                  f"{_BUDGET_S:g} s (--grpc-max-reset-streams)")
        if self._glitches > self._limits.max_control_frames:
            raise H2ProtocolError(ENHANCE_YOUR_CALM, f"over {self._limits.max_control_frames} control frames in "
                                  f"{_BUDGET_S:g} s (--grpc-max-control-frames)")
