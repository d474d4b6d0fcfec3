"""The channel contract (aiordma.testing.CONTRACT) against the in-memory pair and against the
TCP transport's channels over loopback sockets, on both loops. No device: the same checks run
against real endpoints over rxe in tests/rxe/test_channel_contract.py."""

from __future__ import annotations

import pytest

from aiordma import testing
from aiordma.transport import MessageChannel


@pytest.mark.parametrize("check", sorted(testing.CONTRACT))
async def test_the_memory_pair_keeps_the_contract(check: str) -> None:
    await testing.CONTRACT[check](testing.memory_pairs)


@pytest.mark.parametrize("check", sorted(testing.CONTRACT))
async def test_tcp_channels_keep_the_contract(check: str) -> None:
    await testing.CONTRACT[check](testing.tcp_pairs)


async def test_tcp_channels_are_message_channels_that_say_their_transport() -> None:
    async with testing.tcp_pairs() as (a, b):
        assert isinstance(a, MessageChannel) and isinstance(b, MessageChannel)
        assert a.transport == b.transport == "tcp"
    assert testing.channel_pair()[0].transport == "memory"


def test_the_memory_pair_is_a_message_channel() -> None:
    a, b = testing.channel_pair()
    assert isinstance(a, MessageChannel) and isinstance(b, MessageChannel)


async def test_a_broken_channel_fails_the_contract() -> None:
    """The checks can fail: a channel that drops every third message does not pass."""
    from contextlib import asynccontextmanager

    class Lossy(testing.MemoryChannel):
        sent = 0

        async def send(self, data: object) -> None:
            Lossy.sent += 1
            if Lossy.sent % 3:
                await super().send(data)

    @asynccontextmanager
    async def lossy_pairs(**options: object):  # type: ignore[no-untyped-def]
        a, b = testing.channel_pair(**options)  # type: ignore[arg-type]
        a.__class__ = b.__class__ = Lossy
        try:
            yield a, b
        finally:
            a.abort()
            b.abort()

    with pytest.raises((AssertionError, TimeoutError)):
        testing.STEP, saved = 0.5, testing.STEP
        try:
            await testing.CONTRACT["order_and_sizes"](lossy_pairs)
        finally:
            testing.STEP = saved
