"""Point to point: ``send`` and ``recv`` by rank and tag, on the group's links.

A message is one block (:mod:`._direct`): the array's description and, when it fits, its bytes
in one message; else the description, then the bytes as pieces. Messages from one rank to
another with the same tag are received in the order they were sent (MPI's non-overtaking
rule): each carries its number on its channel (one channel per tag), counted by the sender
per (destination, tag) as it starts its sends and by the receiver per (source, tag) as it
starts its receives. They are not collectives: they do not take a place in the group's
order, and run at the same time as its collectives.
"""

from __future__ import annotations

from types import EllipsisType
from typing import Any

import numpy as np

from aiordma._args import check_int
from aiordma.protocols import collectives as proto

from . import _direct
from ._arrays import as_input, as_output
from ._core import MAX_TAG, GroupCore, arg, timeout_arg
from ._errors import CollectiveArgumentError, CollectiveMismatchError
from ._meta import meta_dtype_shape, meta_of
from ._plane import CallPlane

__all__ = ["PointToPoint"]

Timeout = float | None | EllipsisType


class PointToPoint(GroupCore):
    """``send`` and ``recv`` (see :class:`~._group.Group`)."""

    def _peer(self, rank: Any, name: str) -> int:
        peer = arg(check_int, rank, name=name, low=0, high=self.world_size - 1)
        if peer == self.rank:
            raise CollectiveArgumentError(f"{name} is this rank ({peer}): a rank sends to and "
                                          f"receives from the others only")
        return peer

    async def send(self, array: Any, dst: int, *, tag: int = 0,
                   timeout: Timeout = ...) -> None:
        """Send ``array`` (any array, DLPack tensor or buffer; any dtype without Python
        objects, any shape) to rank ``dst``, which takes it with ``recv(..., src=this rank,
        tag=tag)``. Returns once the data is on its way: it was copied first, so ``array``
        may change at once. Sends to one rank with one tag arrive in the order they were
        started.

        Raises:
            CollectiveArgumentError: ``dst`` out of range or this rank, ``tag`` not in
                ``0 .. 2**31 - 1``, an object dtype.
            BrokenResourceError, OperationTimeout: as :meth:`~._group.Group.barrier` (the
                group is broken).
        """
        timeout = timeout_arg(timeout)
        peer = self._peer(dst, "dst")
        tag = arg(check_int, tag, name="tag", low=0, high=MAX_TAG)
        arr = as_input(array, "send")
        number = self._sends[(peer, tag)]
        self._sends[(peer, tag)] += 1

        async def run(plane: CallPlane, call: proto.Tag) -> None:
            work = plane.work(arr.nbytes)
            np.copyto(work.view(arr.dtype).reshape(arr.shape), arr)
            await _direct.send_block(plane, plane.outs[peer], call, 0, meta_of(arr), 0, 0,
                                     arr.nbytes, proto.signature("send", tag))

        await self._run("send", timeout, run, channel=1 + tag, number=number)

    async def recv(self, array: Any, src: int, *, tag: int = 0,
                   timeout: Timeout = ...) -> Any:
        """The next array rank ``src`` sends this rank with ``tag``: into ``array`` (a
        writable array, DLPack tensor or buffer of the sent shape and dtype), returned, or,
        with ``array`` None, as a new numpy array.

        Raises:
            CollectiveArgumentError: ``src`` out of range or this rank, ``tag`` not in
                ``0 .. 2**31 - 1``, a read-only ``array``.
            CollectiveMismatchError: the message has another shape or dtype than ``array``
                (the group is broken).
            BrokenResourceError, OperationTimeout: as :meth:`~._group.Group.barrier` (the
                group is broken).
        """
        timeout = timeout_arg(timeout)
        peer = self._peer(src, "src")
        tag = arg(check_int, tag, name="tag", low=0, high=MAX_TAG)
        dst = None if array is None else as_output(array, "recv")
        number = self._recvs[(peer, tag)]
        self._recvs[(peer, tag)] += 1

        async def run(plane: CallPlane, call: proto.Tag) -> Any:
            inb = plane.ins[peer]
            meta, data = await _direct.recv_block(inb, call, 0, peer)
            dtype, shape = meta_dtype_shape(meta)
            if dst is not None and (dst.dtype, dst.shape) != (dtype, shape):
                raise CollectiveMismatchError(
                    f"rank {self.rank}: recv into {dst.dtype} of shape {dst.shape}; rank {peer} "
                    f"sent {dtype} of shape {shape} (tag {tag})")
            got = np.empty(shape, dtype)
            await _direct.take_block(inb, call, 0, data, got.reshape(-1).view(np.uint8),
                                     proto.signature("send", tag))
            if dst is None:
                return got
            np.copyto(dst, got)
            return array

        return await self._run("send", timeout, run, channel=1 + tag, number=number,
                               what="recv")
