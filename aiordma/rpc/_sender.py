"""The RPC layer's sending half: the frames one side produces in a loop tick leave together.

Callers :meth:`Sender.put` what :meth:`~aiordma.protocols.rpc.RpcConnection.send` returned and
go on without suspending. Frames wait for the tick's end (``call_soon``), where the sender
joins them into batches (:class:`~aiordma.protocols.rpc.Outbox`) and posts those, with one
exception: a frame that is *alone* (the caller has no other call in flight on the connection)
and finds nothing due (no frame waiting, no flush scheduled, not corked) is posted at once, so
a lone call pays no wait, and schedules nothing (no extra loop turn). When the caller knows
more frames are coming this tick (a batch of requests or answers just arrived, each waking a
task that will send), it calls :meth:`Sender.cork` and even a lone first frame waits. So 64
calls made in one tick cost at most two SENDs, not 64, and the answers to a chunk of them one
(the server serves a batch in chunks: ``CHUNK`` in ``aiordma.rpc._server``). Messages the
endpoint cannot post at once (no credit or slot, or out-of-band buffers that go by rendezvous)
are sent by one writer task, in order; frames put meanwhile join it.

A send that fails loses frames the peer's state machine expects, so the connection cannot go
on: the sender aborts the endpoint (the reader then fails what waits) and calls ``on_failure``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiordma._errors import AiordmaError, BrokenResourceError
from aiordma._verbs.compiled import rpc_outbox
from aiordma.protocols import rpc as proto
from aiordma.transport import MessageChannel

__all__ = ["Sender"]


class Sender:
    """Sends one connection's RPC frames, batched per loop tick, in the order they were put.

    Args:
        ep: the connection.
        max_message: the RPC connection's ``max_message`` (a batch never exceeds it).
        on_failure: called once with the error of the first send that failed.
    """

    def __init__(self, ep: MessageChannel, max_message: int,
                 on_failure: Callable[[AiordmaError], None]) -> None:
        self.ep = ep
        # A batch stays eager (copied into a slot): one SEND, no rendezvous.
        self.outbox = rpc_outbox()(max(1, min(ep.eager_max, max_message)))
        self._on_failure = on_failure
        self._loop = asyncio.get_running_loop()
        self._scheduled = False  # a flush is due at this tick's end
        self._corked = False  # more frames are coming this tick: hold the first one too
        self._writer: asyncio.Task[None] | None = None
        self.failed: AiordmaError | None = None

    def put(self, msgs: list[bytes | memoryview], *, alone: bool = False) -> None:
        """Queue a frame and its out-of-band buffers; they leave at the end of this tick, or at
        once if ``alone`` (no other call in flight), a single message, and nothing is due. Dropped
        if a send failed before: the connection is being aborted."""
        if self.failed is not None:
            return
        if (alone and len(msgs) == 1
                and not (self._scheduled or self._corked or self._writer or self.outbox)):
            # At once if it can go; then nothing is due, so no flush is scheduled (the loop
            # need not turn once more for it). A frame put after it this tick that is not
            # alone waits for the tick's end; one that is alone has nothing to wait for.
            try:
                if self.ep.send_nowait(msgs[0]):
                    return
            except AiordmaError as exc:
                self._fail(exc)
                return
        self.outbox.add(msgs)
        if self._writer is None and not self._scheduled:  # (no call for a tick's later frames)
            self._end_tick()

    def cork(self) -> None:
        """Hold every frame put from now to the end of this tick (more are coming)."""
        self._corked = True
        self._end_tick()

    def _end_tick(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = self._corked = False
        if self._writer is not None or self.failed is not None or not self.outbox:
            return
        msgs = self.outbox.take()
        ep = self.ep
        for i, m in enumerate(msgs):
            try:
                if ep.send_nowait(m):
                    continue
            except AiordmaError as exc:
                self._fail(exc)
                return
            self._writer = self._loop.create_task(self._write(msgs[i:]))
            return

    async def _write(self, msgs: list[Any]) -> None:
        try:
            while msgs:
                for m in msgs:
                    await self.ep.send(m)
                msgs = self.outbox.take()  # what was put meanwhile
        except AiordmaError as exc:
            self._fail(exc)
        except asyncio.CancelledError:  # only when the connection is being torn down
            self._fail(None)
            raise
        finally:
            self._writer = None

    def _fail(self, exc: AiordmaError | None) -> None:
        if self.failed is not None:
            return
        self.failed = exc if exc is not None else BrokenResourceError("an RPC send was cancelled")
        self.outbox.take()
        self.ep.abort()
        self._on_failure(self.failed)

    async def drain(self) -> None:
        """Send what was put, now (before a graceful close). Bounded as the endpoint's sends
        are: by its peer-death detection and its close."""
        if self._writer is None and self.outbox:
            self._flush()
        while (writer := self._writer) is not None:
            await asyncio.wait({writer})

    async def aclose(self) -> None:
        """Stop: the writer, if any, is cancelled (what it had not sent is dropped)."""
        writer = self._writer
        if writer is not None:
            writer.cancel()
            await asyncio.wait({writer})  # (its outcome is the failure it recorded)
