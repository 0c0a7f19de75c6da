"""The messages between a front's acceptor and the replicas: each decodes to what was encoded."""

from __future__ import annotations

import pytest

from rayinfer.transport.handoff_messages import GiveBack, HandOff, Splice, decode_returned


@pytest.mark.parametrize("message", [
    HandOff("/tmp/front/replica-relay.sock", "m/1"), HandOff("/f/grpc-relay.sock", "m/", 96),
    HandOff("/f/relay.sock", "", 0), HandOff("/f/r.sock", "mödel #1/2", 3),
])
def test_a_hand_off_decodes_to_itself(message: HandOff) -> None:
    assert HandOff.decode(message.encode()) == message


@pytest.mark.parametrize("message", [
    GiveBack("\0rayinfer-acceptor-10.0.0.1-9000", False), GiveBack("a", True),
    GiveBack("a", False, "m/2"), GiveBack("a", True, "m/1 17"),
    Splice(), Splice(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"),
])
def test_what_comes_back_decodes_to_itself(message: GiveBack | Splice) -> None:
    assert decode_returned(message.encode()) == message
