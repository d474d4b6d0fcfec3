"""Batches: the RPC frames one side produces in a loop tick, carried by one message.

Sans-I/O. A message is either one frame (see :mod:`aiordma.protocols.rpc`) or a *batch*: several
frames back to back, in order (each frame's header gives its length), of which only the last may
announce out-of-band buffers (they follow the batch as messages of their own, as they follow a
lone frame). A batch costs its frames nothing: :func:`join` concatenates the frames' bytes as
they are, so a frame is packed once whether it travels alone or in a batch.

:class:`Outbox` is the sender's half: it collects what :meth:`RpcConnection.send` returned and
hands it out as the fewest messages the rules allow, each batch at most ``limit`` bytes (a
frame larger than that travels alone). What one message saves is every per-message cost
below it: a work request, a completion, a receive slot and a credit each way.
"""

from __future__ import annotations

__all__ = ["Outbox", "join"]


def join(frames: list[bytes]) -> bytes:
    """One message carrying ``frames`` (packed frames, in order): the frame itself for one, a
    batch for several. Only the last may announce out-of-band buffers (not checked here:
    :class:`Outbox` keeps that rule)."""
    if len(frames) == 1:
        return frames[0]
    return b"".join(frames)


class Outbox:
    """What one side has to send, as the fewest messages the batch rules allow.

    Args:
        limit: the largest batch, in bytes (a single frame may be larger: it goes alone).

    ``add`` takes what :meth:`~aiordma.protocols.rpc.RpcConnection.send` returned (a frame, then
    its out-of-band buffers); ``take`` returns every message to send, in order, and empties the
    outbox. Order is kept: a frame is never sent before one added earlier.
    """

    __slots__ = ("_frames", "_ready", "_size", "limit")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("a batch limit is at least 1 byte")
        self.limit = limit
        self._frames: list[bytes] = []  # the open batch
        self._size = 0  # its size in bytes
        self._ready: list[bytes | memoryview] = []  # closed messages, in order

    def __bool__(self) -> bool:
        """Something is waiting to be taken."""
        return bool(self._frames or self._ready)

    def add(self, msgs: list[bytes | memoryview]) -> None:
        """Queue a frame and its out-of-band buffers (``msgs[0]`` is the frame)."""
        frame = msgs[0]
        n = len(frame)
        if self._frames and self._size + n > self.limit:
            self._close()
        self._frames.append(frame)  # type: ignore[arg-type]  # frames are bytes (encode's)
        self._size += n
        if len(msgs) > 1:  # its buffers follow: the batch ends with it
            self._close()
            self._ready.extend(msgs[1:])

    def take(self) -> list[bytes | memoryview]:
        """Every message to send, in order; the outbox is empty afterwards."""
        if self._frames:
            self._close()
        out, self._ready = self._ready, []
        return out

    def _close(self) -> None:
        self._ready.append(join(self._frames))
        self._frames = []
        self._size = 0
