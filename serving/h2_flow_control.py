"""HTTP/2 flow control of a client's gRPC connection that a model replica holds
(:class:`~rayinfer.serving.replica_h2.H2Connection`).

Both directions are bounded by windows (RFC 9113, section 5.2). This side's sending follows the
client's: its ``SETTINGS_INITIAL_WINDOW_SIZE`` and ``WINDOW_UPDATE`` frames, each checked against
the largest window. What the client sends is bounded by the windows this side gives back: a
call's bytes are *held* while the replica has not taken them, its stream window is given back as
they arrive, and the connection's in steps of half of it; once the connection's calls hold more
than ``connection_window_bytes`` (or the replica's connections more than
``replica_buffer_bytes``), only the oldest call still being received gets more window, so that a
message larger than the window can arrive, and the others wait until bytes are released.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rayinfer.protocol.grpc_wire import (
    ACK, DEFAULT_FRAME_SIZE, DEFAULT_WINDOW, FLOW_CONTROL_ERROR, MAX_WINDOW, SETTINGS, SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_FRAME_SIZE, H2ProtocolError, check_settings, frame, window_update,
)
from rayinfer.protocol.limits import ConnectionLimits


class FlowControl:
    """The windows of ``replica_h2.H2Connection``, a part of it. A ``call`` is one of its calls
    (``replica_h2._Call``): ``held``, ``unacked``, ``deferred``, ``recv_window`` and ``window``
    are its own windows' figures."""

    _calls: dict[int, Any]
    _limits: ConnectionLimits
    _listener: Any  # the replica's listener: ``held_bytes`` over all its connections
    _write: Callable[[bytes], None]  # to the client (H2Connection's)
    _flush: Callable[[], None]  # answers that wait for window are sent (H2Connection's)
    _reset: Callable[[Any, int], None]  # a call is reset (H2Connection's)

    def _init_windows(self, limits: ConnectionLimits) -> None:
        self._send_window = DEFAULT_WINDOW  # what the client lets this side send on the connection
        self._initial_window = DEFAULT_WINDOW  # each call's send window at its start
        self._max_frame = DEFAULT_FRAME_SIZE
        self._client_window = limits.stream_window_bytes  # what a client may send on one call
        self._unacked = 0  # received bytes released, their connection window not given back yet
        # What the client may still send on the connection (its window, as this side gave it).
        self._recv_window = DEFAULT_WINDOW + max(limits.connection_window_bytes - DEFAULT_WINDOW, 1)
        self._held = 0  # bytes the open calls hold
        self._deferred_calls = 0  # calls whose window is held back

    # the client's SETTINGS and WINDOW_UPDATEs: what this side may send

    def _settings(self, values: dict[int, int]) -> None:
        check_settings(values)
        if SETTINGS_INITIAL_WINDOW_SIZE in values:
            delta = values[SETTINGS_INITIAL_WINDOW_SIZE] - self._initial_window
            self._initial_window += delta
            for call in self._calls.values():
                call.window += delta
                if call.window > MAX_WINDOW:
                    raise H2ProtocolError(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE took a window over 2^31-1")
        if SETTINGS_MAX_FRAME_SIZE in values:
            self._max_frame = values[SETTINGS_MAX_FRAME_SIZE]
        self._write(frame(SETTINGS, ACK, 0))
        self._flush()

    def _window_update(self, stream: int, increment: int) -> None:
        if stream == 0:
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise H2ProtocolError(FLOW_CONTROL_ERROR, "a WINDOW_UPDATE took the connection's window over 2^31-1")
        elif (call := self._calls.get(stream)) is not None:
            call.window += increment
            if call.window > MAX_WINDOW:
                self._reset(call, FLOW_CONTROL_ERROR)
                return
        self._flush()


    # the client's windows: a call's given back as it is received, while the connection holds little

    def _hold(self, call: Any, size: int) -> None:
        call.held += size
        self._held += size
        self._listener.held_bytes += size

    def _release(self, call: Any, size: int | None = None) -> None:
        """``size`` bytes a call held (all: the call ended) are freed; calls held back get their
        windows."""
        held = call.held if size is None else min(size, call.held)
        call.held -= held
        if size is None and call.deferred:  # the call ended while held back
            self._deferred_calls -= 1
            call.deferred = 0
        if held:
            self._held -= held
            self._listener.held_bytes -= held
            if self._deferred_calls:
                for other in list(self._calls.values()):
                    if other.deferred:
                        self._credit_stream(other, 0)

    def _credit(self, size: int) -> None:
        """Give ``size`` received bytes back to the connection's window (in steps of half of it);
        what a connection holds is bounded by its calls' windows (:meth:`_credit_stream`)."""
        self._unacked += size
        if self._unacked >= self._limits.connection_window_bytes // 2:
            self._write(window_update(0, self._unacked))
            self._recv_window += self._unacked
            self._unacked = 0

    def _credit_stream(self, call: Any, size: int) -> None:
        """Give a call's received bytes back to its window, unless the connection holds more than
        ``connection_window_bytes`` (or the replica more than ``replica_buffer_bytes``) and the
        call is not the oldest one still being received, which always may go on so that a
        message larger than the window can arrive. A call held back waits for its window until
        bytes are released (:meth:`_release`)."""
        call.unacked += size
        limits = self._limits
        if ((self._held > limits.connection_window_bytes or self._listener.held_bytes > limits.replica_buffer_bytes)
                and call is not self._oldest_receiving()):
            self._deferred_calls += not call.deferred
            call.deferred = call.unacked
            return
        if call.deferred:
            self._deferred_calls -= 1
            call.deferred = 0
        if call.unacked >= self._client_window // 2 or (size == 0 and call.unacked):
            self.give_window(call)

    def give_window(self, call: Any) -> None:
        """Give a call's unacknowledged bytes back to its window (a WINDOW_UPDATE)."""
        self._write(window_update(call.id, call.unacked))
        call.recv_window += call.unacked
        call.unacked = 0

    def _oldest_receiving(self) -> Any:
        return next((call for call in self._calls.values() if call.task is None), None)

    def _release_all(self) -> None:
        """The connection is gone: what its calls held is freed."""
        self._listener.held_bytes -= self._held
        self._held = 0
