"""The channel contract as executable checks (re-exported by :mod:`aiordma.testing`, which
says how to use them): each takes a pair factory, an async context manager
``make_pair(**options)`` yielding two connected channels."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from aiordma._errors import BrokenResourceError, ClosedResourceError, LocalProtocolError
from aiordma.transport import ReadyChannel

__all__ = ["CONTRACT", "STEP", "PairFactory"]

PairFactory = Callable[..., AbstractAsyncContextManager[tuple[Any, Any]]]


# -- the checks ---------------------------------------------------------------------

STEP = 30.0  # every await on the peer in a check is bounded by this


async def _bounded(aw: Awaitable[Any]) -> Any:
    return await asyncio.wait_for(aw, STEP)


def _expect(condition: object, what: str) -> None:
    """A check of the contract: an ``AssertionError`` saying ``what`` when ``condition`` is
    false (not an ``assert``, which ``python -O`` would drop, passing any channel)."""
    if not condition:
        raise AssertionError(what)


def _payload(i: int, n: int) -> bytes:
    return random.Random(i).randbytes(n)


async def check_order_and_sizes(make_pair: PairFactory) -> None:
    """Messages of every size class arrive in order, whole, both ways."""
    async with make_pair() as (a, b):
        sizes = [0, 1, 100, a.eager_max, a.eager_max + 1, 3 * a.eager_max + 5, 1 << 20]
        msgs = [_payload(i, n) for i, n in enumerate(sizes)]
        for x, y in ((a, b), (b, a)):
            sending = asyncio.ensure_future(asyncio.gather(*(x.send(m) for m in msgs)))
            got = [await _bounded(y.recv()) for _ in msgs]
            await _bounded(sending)
            _expect([bytes(g) for g in got] == msgs, "messages changed or reordered")


async def check_a_pipelined_batch_is_not_a_deadlock(make_pair: PairFactory) -> None:
    """A batch sent before the first read (each side echoing) completes: 300 messages."""
    async with make_pair() as (a, b):
        async def echo() -> None:
            while (m := await b.recv()) is not None:
                await b.send(m)

        echoing = asyncio.ensure_future(echo())
        msgs = [_payload(i, (i * 37) % 9000) for i in range(300)]
        await _bounded(asyncio.gather(*(a.send(m) for m in msgs)))
        got = [bytes(await _bounded(a.recv())) for _ in msgs]
        _expect(got == msgs, "the echoed batch changed or was reordered")
        await _bounded(a.aclose())
        await _bounded(echoing)


async def check_backpressure_holds_a_writer(make_pair: PairFactory) -> None:
    """A writer of large messages to a reader that does not read is held (it does not run
    ahead without bound); each read lets more through; nothing is lost."""
    async with make_pair(recv_buffer=0) as (a, b):
        n = 2 * a.eager_max  # held until read
        done = 0

        async def writer() -> None:
            nonlocal done
            for i in range(4):
                await a.send(_payload(i, n))
                done += 1

        w = asyncio.ensure_future(writer())
        await asyncio.sleep(0.2)
        _expect(done < 4, "a writer ran ahead of a reader with no buffer")
        for i in range(4):
            _expect(bytes(await _bounded(b.recv())) == _payload(i, n),
                    f"message {i} changed or was reordered")
        await _bounded(w)
        _expect(done == 4, "the writer did not finish once its messages were read")


async def check_recv_into(make_pair: PairFactory) -> None:
    """recv_into copies into the buffer and returns the size; a message larger than the
    buffer stays queued (LocalProtocolError), the next call with room gets it."""
    async with make_pair() as (a, b):
        await _bounded(a.send(b"x" * 100))
        await _bounded(a.send(b"yz"))
        small = bytearray(10)
        try:
            await _bounded(b.recv_into(small))
        except LocalProtocolError:
            pass
        else:
            raise AssertionError("a message larger than the buffer was taken")
        big = bytearray(200)
        _expect(await _bounded(b.recv_into(big)) == 100 and big[:100] == b"x" * 100,
                "recv_into with room did not get the message left queued")
        _expect(await _bounded(b.recv_into(small)) == 2 and small[:2] == b"yz",
                "recv_into did not get the next message")


async def check_graceful_close(make_pair: PairFactory) -> None:
    """aclose() after sends: the peer receives them all, then the end (None, -1), and its
    send fails BrokenResourceError; this side's operations fail ClosedResourceError."""
    async with make_pair() as (a, b):
        msgs = [b"one", b"two" * 5000, b""]
        for m in msgs:
            await _bounded(a.send(m))
        closing = asyncio.ensure_future(a.aclose())
        got = [bytes(await _bounded(b.recv())) for _ in msgs]
        _expect(got == msgs, "messages sent before aclose() changed or were lost")
        _expect(await _bounded(b.recv()) is None, "recv() at the end of stream is not None")
        _expect(await _bounded(b.recv_into(bytearray(8))) == -1,
                "recv_into() at the end of stream is not -1")
        await _bounded(closing)
        _expect(a.closed and not b.closed, "closed is wrong after aclose()")
        for op in (a.send(b"late"), a.recv()):
            try:
                await _bounded(op)
            except ClosedResourceError:
                pass
            else:
                raise AssertionError("an operation on a closed channel succeeded")
        try:
            await _bounded(b.send(b"to a closed peer"))
        except BrokenResourceError:
            pass
        else:
            raise AssertionError("a send to a peer that closed succeeded")
        await _bounded(a.aclose())  # idempotent
        a.abort()


async def check_abort_is_seen_by_the_peer(make_pair: PairFactory) -> None:
    """abort(): a receiver waiting on the peer fails BrokenResourceError promptly; one
    waiting on this side fails ClosedResourceError."""
    async with make_pair() as (a, b):
        waiting_b = asyncio.ensure_future(b.recv())
        waiting_a = asyncio.ensure_future(a.recv())
        await asyncio.sleep(0.05)
        a.abort()
        for fut, kind in ((waiting_a, ClosedResourceError), (waiting_b, BrokenResourceError)):
            try:
                await _bounded(fut)
            except kind:
                pass
            else:
                raise AssertionError(f"a waiting receive did not fail with {kind.__name__}")
        _expect(a.closed and b.broken, "closed/broken are wrong after abort()")


async def check_bad_arguments_are_typed_and_send_nothing(make_pair: PairFactory) -> None:
    """Not a bytes-like object, non-contiguous, or larger than the peer accepts:
    LocalProtocolError, and nothing is sent (the next message is the next one sent)."""
    async with make_pair(max_message=1000) as (a, b):
        _expect(a.peer_max_message == 1000, "peer_max_message is not the peer's limit")
        for bad in ("text", 12, memoryview(bytes(100))[::2], bytes(1001)):
            try:
                await _bounded(a.send(bad))
            except LocalProtocolError:
                pass
            else:
                raise AssertionError(f"send({type(bad).__name__}) was accepted")
        try:
            a.send_nowait(object())
        except LocalProtocolError:
            pass
        else:
            raise AssertionError("send_nowait(object()) was accepted")
        await _bounded(a.send(b"good"))
        _expect(bytes(await _bounded(b.recv())) == b"good",
                "a refused message was sent, or the good one lost")


async def check_send_nowait(make_pair: PairFactory) -> None:
    """send_nowait sends a small message at once (True), or nothing (False: too large for
    an eager send); what it sent arrives in order with what send() sent."""
    async with make_pair() as (a, b):
        _expect(a.send_nowait(b"first") is True, "send_nowait of a small message did not send")
        _expect(a.send_nowait(bytes(a.eager_max + 1)) is False,
                "send_nowait of a message past eager_max did not refuse")
        await _bounded(a.send(b"second"))
        _expect(bytes(await _bounded(b.recv())) == b"first", "send_nowait's message is not first")
        _expect(bytes(await _bounded(b.recv())) == b"second", "send()'s message is not second")


async def check_a_cancelled_receive_loses_nothing(make_pair: PairFactory) -> None:
    """A receive cancelled while waiting takes no message: the next receive gets it."""
    async with make_pair() as (a, b):
        waiting = asyncio.ensure_future(b.recv())
        await asyncio.sleep(0.05)
        waiting.cancel()
        try:
            await waiting
        except asyncio.CancelledError:
            pass
        await _bounded(a.send(b"kept"))
        _expect(bytes(await _bounded(b.recv())) == b"kept",
                "a cancelled receive took the message")


async def check_the_ready_path(make_pair: PairFactory) -> None:
    """A :class:`~aiordma.transport.ReadyChannel` read without a waiting task: every message,
    in order, through ``recv_nowait()`` after each callback (and ``recv()`` when
    ``call_when_readable`` leaves the next one to it); nothing is taken before it arrived; the
    end is left to ``recv()``. (A channel without these methods passes.)"""
    async with make_pair() as (a, b):
        if not isinstance(b, ReadyChannel):
            return
        _expect(b.recv_nowait() is None, "recv_nowait() returned a message never sent")
        woken = asyncio.Event()
        sizes = [1, 100, 0, a.eager_max, 7, 3 * a.eager_max + 5, 64]
        msgs = [_payload(i, n) for i, n in enumerate(sizes)]
        sending = asyncio.ensure_future(asyncio.gather(*(a.send(m) for m in msgs)))
        got: list[bytes] = []
        while len(got) < len(msgs):
            while (m := b.recv_nowait()) is not None:
                got.append(bytes(m))
            if len(got) == len(msgs):
                break
            woken.clear()
            if b.call_when_readable(woken.set):
                await _bounded(woken.wait())
            elif (m := await _bounded(b.recv())) is not None:
                got.append(bytes(m))
            else:
                break
        await _bounded(sending)
        _expect(got == msgs, "messages changed, lost or reordered on the ready path")
        await _bounded(a.aclose())
        woken.clear()
        while b.call_when_readable(woken.set):  # (until the end came)
            await _bounded(woken.wait())
            woken.clear()
        _expect(b.recv_nowait() is None, "recv_nowait() returned something after the end")
        _expect(await _bounded(b.recv()) is None, "the graceful end was not left to recv()")


CONTRACT: dict[str, Callable[[PairFactory], Awaitable[None]]] = {
    "order_and_sizes": check_order_and_sizes,
    "pipelined_batch": check_a_pipelined_batch_is_not_a_deadlock,
    "backpressure": check_backpressure_holds_a_writer,
    "recv_into": check_recv_into,
    "graceful_close": check_graceful_close,
    "abort": check_abort_is_seen_by_the_peer,
    "bad_arguments": check_bad_arguments_are_typed_and_send_nothing,
    "send_nowait": check_send_nowait,
    "cancelled_receive": check_a_cancelled_receive_loses_nothing,
    "ready_path": check_the_ready_path,
}
