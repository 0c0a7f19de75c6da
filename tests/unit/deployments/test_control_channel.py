"""The control channel's long poll: a send returns once every replica took the message, a late
replica is named, full-state messages replace older ones, a new ``/v2`` replica's epoch starts
afresh, and a forgotten replica releases its senders."""

from __future__ import annotations

import asyncio

from rayinfer.deployments import control_channel
from waiting import wait_until_async
from rayinfer.deployments.control_channel import (
    SEQUENCE_SLOTS,
    SHM_FORGET,
    TRACE_SETTINGS,
    ControlChannel,
    ControlMessage,
)


async def _replica(channel: ControlChannel, key: str, taken: list[ControlMessage]) -> None:
    """A model replica's poll loop, as ModelDeployment runs it."""
    epoch, acked = None, 0
    while True:
        answer, messages = await channel.poll(key, epoch, acked)
        if answer != epoch:
            epoch, acked = answer, 0
        for seq, message in messages:
            taken.append(message)
            acked = seq


def test_a_send_returns_once_every_polling_replica_took_it_and_names_the_others():
    async def scenario() -> None:
        channel = ControlChannel()
        a: list[ControlMessage] = []
        b: list[ControlMessage] = []
        pollers = [asyncio.create_task(_replica(channel, "a", a)), asyncio.create_task(_replica(channel, "b", b))]
        await asyncio.sleep(0)
        message = ControlMessage(SHM_FORGET, {"kind": "system", "name": "r"})
        assert await channel.send(["a", "b"], message, 2.0) == []
        assert a == b == [message]
        # "c" never polls: the send waits its timeout and names it.
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await channel.send(["a", "c"], message, 0.2) == ["c"]
        assert 0.2 <= loop.time() - start < 1.0 and a == [message, message]
        # It takes the message when it polls at last.
        c: list[ControlMessage] = []
        pollers.append(asyncio.create_task(_replica(channel, "c", c)))
        await wait_until_async(lambda: c == [message], "the late replica to take the message")
        for poller in pollers:
            poller.cancel()

    asyncio.run(scenario())


def test_full_state_messages_replace_older_ones_and_pending_messages_are_bounded(monkeypatch):
    async def scenario() -> None:
        channel = ControlChannel()
        for level in range(3):
            await channel.send(["a"], ControlMessage(TRACE_SETTINGS, {"level": level}), 0.0)
        monkeypatch.setattr(control_channel, "MAX_PENDING", 4)
        for name in range(6):
            await channel.send(["a"], ControlMessage(SHM_FORGET, {"kind": "system", "name": str(name)}), 0.0)
        _, messages = await channel.poll("a", None, 0, wait_s=0.0)
        # The last trace settings only (then dropped as the oldest), and the newest regions.
        assert [m.body.get("name") for _, m in messages] == ["2", "3", "4", "5"]

    asyncio.run(scenario())


def test_a_sequence_table_replaces_the_older_one_of_its_own_application_only():
    """A pool replica's one mailbox holds the slot tables of every sequence model it hosts."""
    async def scenario() -> None:
        channel = ControlChannel()
        for app, version in (("s1", 1), ("s2", 1), ("s1", 2)):
            await channel.send(["pool"], ControlMessage(SEQUENCE_SLOTS, {"app": app, "listeners": version}), 0.0)
        _, messages = await channel.poll("pool", None, 0, wait_s=0.0)
        assert [(m.body["app"], m.body["listeners"]) for _, m in messages] == [("s2", 1), ("s1", 2)]

    asyncio.run(scenario())


def test_a_new_epoch_ignores_old_acknowledgements_and_forget_releases_senders():
    async def scenario() -> None:
        channel = ControlChannel()
        sending = asyncio.create_task(channel.send(["a"], ControlMessage(TRACE_SETTINGS, {}), 30.0))
        await asyncio.sleep(0)
        # A replica that polled an earlier /v2 replica acknowledges seq 9 of another epoch.
        epoch, messages = await channel.poll("a", "earlier", 9, wait_s=0.0)
        assert epoch == channel.epoch and [seq for seq, _ in messages] == [1]
        assert not sending.done()
        channel.forget("a")  # the replica withdrew
        assert await asyncio.wait_for(sending, 1.0) == []
        # A poll waits for a message, and answers none after its wait.
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await channel.poll("b", channel.epoch, 0, wait_s=0.1) == (channel.epoch, [])
        assert loop.time() - start >= 0.1

    asyncio.run(scenario())
