"""Forming a group (rendezvous, ring connections) and the public :class:`Group`.

Formation, bounded as a whole by ``timeout``:

1. Rank 0 serves a :class:`Rendezvous` (an :mod:`aiordma.rpc` service) on
   ``MASTER_ADDR:MASTER_PORT``. Every rank starts a listener for its ring connection on a free
   port, on the address that reaches rank 0 (the local address of its rendezvous connection;
   rank 0 uses ``MASTER_ADDR``), and calls ``join(rank, world_size, host, port)``; ranks that
   start before rank 0 retry until it is up. The call returns once all ``world_size`` ranks
   joined: a random group token and every rank's address. A rank joining twice, out of range
   or with another world size fails the rendezvous for everyone (:class:`RendezvousError`).
2. Each rank connects to its right neighbour (``aiordma.connect``) and sends ``Hello(token,
   rank)``; it accepts its left neighbour's connection (anything else is dropped). It then
   exposes its receive slots to the left neighbour, and learns the right neighbour's.
3. A barrier round the ring; after it rank 0 closes the rendezvous server (everyone has
   their answer by then).

Failure
    Every wait on a peer is bounded: by the endpoint's peer-death detection (a dead process
    closes its TCP liveness connection; keepalive notices a dead host in seconds), which fails
    the operation with :class:`~aiordma.BrokenResourceError`, and by the group's ``timeout``
    (:class:`~aiordma.OperationTimeout`). A collective that fails in any way, or is cancelled,
    leaves the ranks out of step, so it *aborts the group*: its endpoints close at once, which
    fails the neighbours' collectives in turn, so a failure travels round the ring in a few
    round trips instead of leaving ranks waiting for their timeouts. An aborted group raises
    :class:`~aiordma.BrokenResourceError` from then on; form a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import Awaitable, Callable
from types import EllipsisType
from typing import Any, Self, TypeVar

import numpy as np

import aiordma
from aiordma import (
    AiordmaError,
    BrokenResourceError,
    BusyResourceError,
    ClosedResourceError,
    Config,
    Endpoint,
    Listener,
    OperationTimeout,
    RemoteBuffer,
    RemoteProtocolError,
)
from aiordma.lowlevel import Device
from aiordma.protocols import collectives as proto
from aiordma.protocols.errors import ProtocolError
from aiordma.rpc import RemoteError, RpcClient, RpcServer, Service, method, serve
from aiordma.rpc import connect as rpc_connect

from ._env import launch_environment
from ._errors import (
    CollectiveArgumentError,
    CollectiveMismatchError,
    GroupError,
    RendezvousError,
)
from ._ring import REDUCE_OPS, Ring, meta_dtype_shape, meta_of

__all__ = ["Group", "Rendezvous"]

log = logging.getLogger("aiordma.services.collectives")
T = TypeVar("T")

DEFAULT_SLOTS = 4
DEFAULT_SLOT_BYTES = 256 << 10
_REDUCIBLE_KINDS = frozenset("biufc")  # bool, signed, unsigned, float, complex


class Rendezvous(Service):
    """Rank 0's meeting point: ``join()`` returns once every rank has joined.

    The bookkeeping is :class:`aiordma.protocols.collectives.Roster`; a refused join fails the whole
    rendezvous, and every waiting ``join()`` raises :class:`RendezvousError`.
    """

    def __init__(self, world_size: int, token: int) -> None:
        self.roster = proto.Roster(world_size)
        self.token = token
        self._done = asyncio.Event()

    def add(self, rank: Any, world_size: Any, host: Any, port: Any) -> None:
        try:
            self.roster.add(rank, world_size, host, port)
        except proto.RendezvousRefused as exc:
            raise RendezvousError(str(exc)) from None
        finally:
            if self.roster.done:
                self._done.set()

    async def result(self) -> dict[str, Any]:
        await self._done.wait()
        if self.roster.failure is not None:
            raise RendezvousError(self.roster.failure)
        return {"token": self.token, "members": [list(m) for m in self.roster.addresses()]}

    @method
    async def join(self, rank: int, world_size: int, host: str, port: int) -> dict[str, Any]:
        """Join as ``rank`` listening on ``host:port``; every rank's address once complete."""
        self.add(rank, world_size, host, port)
        return await self.result()


def _resolve(host: str) -> str:
    """An IPv4 address for ``host`` (RoCE v2 GIDs carry IPv4 addresses here)."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError as exc:
        raise GroupError(f"cannot resolve MASTER_ADDR {host!r}: {exc}") from exc
    return str(infos[0][4][0])


def _is_local(ip: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


class Group:
    """A group of ``world_size`` ranks (processes, usually on several hosts) that run
    collectives over RDMA: :meth:`barrier`, :meth:`broadcast`, :meth:`allgather` and
    :meth:`allreduce` of numpy arrays.

    Form it with :meth:`from_env` (under torchrun, srun, or ``python -m
    aiordma.services.collectives.launch``) or :meth:`join`, and use it as ``async with``. Every rank
    must call the same collectives in the same order with matching arguments (as with MPI);
    one collective at a time per group. A mismatch that the ranks can see (kind, op, dtype,
    size, root) raises :class:`CollectiveMismatchError`.

    Attributes:
        rank, world_size: this rank and the group's size.
        timeout: the default bound, in seconds, on each collective (``None``: unbounded, only
            peer death ends a wait).
        calls: collectives run so far.
    """

    def __init__(self, *, rank: int, world_size: int, timeout: float | None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.calls = 0
        self._ring: Ring | None = None
        self._listener: Listener | None = None
        self._right: Endpoint | None = None
        self._left: Endpoint | None = None
        self._left_fut: asyncio.Future[Endpoint] | None = None
        self._token_fut: asyncio.Future[int] | None = None
        self._client: RpcClient | None = None
        self._released = asyncio.Event()  # ends the listener's handler
        self._server: RpcServer | None = None
        self._busy = False
        self._closed = False
        self._broken: BaseException | None = None

    # -- formation -----------------------------------------------------------------------------

    @classmethod
    async def from_env(cls, *, timeout: float | None = 60.0, **kwargs: Any) -> Group:
        """Join the group the environment describes (see :mod:`aiordma.services.collectives._env`:
        ``RANK``/``WORLD_SIZE`` or ``SLURM_PROCID``/``SLURM_NTASKS``, with ``MASTER_ADDR`` and
        ``MASTER_PORT``); other arguments as :meth:`join`.

        Raises:
            LaunchEnvironmentError: the variables are missing or invalid (it says which).
        """
        env = launch_environment()
        return await cls.join(env.rank, env.world_size, env.master_addr, env.master_port,
                              timeout=timeout, **kwargs)

    @classmethod
    async def join(cls, rank: int, world_size: int, master_addr: str, master_port: int, *,
                   timeout: float | None = 60.0, host: str | None = None,
                   device: str | Device | None = None, config: Config | None = None,
                   slots: int = DEFAULT_SLOTS, slot_bytes: int = DEFAULT_SLOT_BYTES) -> Group:
        """Form the group: rank 0 serves the rendezvous on ``master_addr:master_port``.

        Args:
            rank, world_size: this process's place (``0 <= rank < world_size``).
            master_addr, master_port: where rank 0 serves the rendezvous.
            timeout: bound on the formation, and the default bound on each collective.
            host: the address this rank's ring listener is advertised on (default: the local
                address that reaches rank 0; ``master_addr`` for rank 0).
            device, config: passed to every endpoint (device choice, endpoint tunables).
            slots, slot_bytes: this rank's receive slots (the unit of pipelining; ranks may
                differ). ``slot_bytes`` is rounded up to 64.

        Raises:
            RendezvousError: rank 0 refused the group (duplicate rank, world size mismatch).
            OperationTimeout: the group did not form in ``timeout`` seconds.
            BrokenResourceError: a rank died during formation.
            CollectiveArgumentError: invalid arguments.
        """
        if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int)
                and 0 <= rank < world_size):
            raise CollectiveArgumentError(f"rank {rank!r} is not in 0..world_size-1 "
                                          f"(world_size={world_size!r})")
        if slots < 1 or slot_bytes < 1:
            raise CollectiveArgumentError("slots and slot_bytes must be positive")
        slot_bytes = -(-slot_bytes // 64) * 64
        group = cls(rank=rank, world_size=world_size, timeout=timeout)
        if world_size == 1:
            return group
        try:
            async with asyncio.timeout(timeout):
                await group._form(master_addr, master_port, host, device, config, slots,
                                  slot_bytes)
        except TimeoutError:
            await group._abort_quietly()
            raise OperationTimeout(f"rank {rank}: the group of {world_size} did not form "
                                   f"within {timeout} s") from None
        except BaseException:
            await group._abort_quietly()
            raise
        return group

    async def _form(self, master_addr: str, master_port: int, host: str | None,
                    device: str | Device | None, config: Config | None, slots: int,
                    slot_bytes: int) -> None:
        master_ip = _resolve(master_addr)
        loop = asyncio.get_running_loop()
        self._left_fut = loop.create_future()
        self._token_fut = loop.create_future()
        if self.rank == 0:
            token = secrets.randbits(63)
            rendezvous = Rendezvous(self.world_size, token)
            bind = master_ip if _is_local(master_ip) else "0.0.0.0"
            try:
                self._server = await serve(rendezvous, bind, master_port, device=device,
                                           config=config)
            except OSError as exc:
                raise GroupError(f"rank 0 cannot serve the rendezvous on {bind}:{master_port}: "
                                 f"{exc}") from exc
            host = host or master_ip
            self._listener = await aiordma.listen(self._accept_left, bind, 0, device=device,
                                                  config=config)
            rendezvous.add(0, self.world_size, host, self._listener.port)
            info = await rendezvous.result()
        else:
            self._client = client = await self._reach_master(master_ip, master_port, device,
                                                             config)
            host = host or client.endpoint.local_address[0]
            self._listener = await aiordma.listen(self._accept_left, host, 0, device=device,
                                                  config=config)
            try:
                info = await client.call("join", self.rank, self.world_size, host,
                                         self._listener.port)
            except RemoteError as exc:
                if exc.type_name == "RendezvousError":
                    raise RendezvousError(exc.message) from None
                raise
            await client.aclose()
            self._client = None
        try:
            members = proto.validate_members(info["members"], self.world_size)
            token = int(info["token"])
        except (KeyError, TypeError, ValueError, ProtocolError) as exc:
            raise RemoteProtocolError(f"bad rendezvous answer: {exc}") from exc
        self._token_fut.set_result(token)
        rhost, rport = members[(self.rank + 1) % self.world_size]
        # Bounded by the formation's timeout around all of this.
        self._right = await aiordma.connect(rhost, rport, timeout=1e9, device=device,
                                            config=config)
        await self._right.send(proto.encode(proto.Hello(
            version=proto.PROTOCOL_VERSION, token=token, rank=self.rank, world=self.world_size)))
        self._left = await self._left_fut
        self._ring = await self._exchange_slots(slots, slot_bytes)
        await self._ring.exchange(0, None)  # everyone is connected
        if self._server is not None:
            await self._server.aclose()
            self._server = None

    async def _reach_master(self, ip: str, port: int, device: str | Device | None,
                            config: Config | None) -> RpcClient:
        """Connect to rank 0's rendezvous, retrying while it is not up yet."""
        delay = 0.05
        while True:
            try:
                return await rpc_connect(ip, port, device=device, config=config)
            except (BrokenResourceError, OperationTimeout) as exc:
                log.debug("rank %d: rendezvous %s:%d not reachable yet: %s", self.rank, ip,
                          port, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _accept_left(self, ep: Endpoint) -> None:
        """Listener handler: the left neighbour's connection, if it says the right Hello."""
        want = (self.rank - 1) % self.world_size
        assert self._token_fut is not None
        try:
            async with asyncio.timeout(self.timeout):
                data = await ep.recv()
                ev = proto.decode(data) if data is not None else None
                token = await asyncio.shield(self._token_fut)  # may still be on its way here
        except (AiordmaError, ProtocolError, TimeoutError, asyncio.CancelledError) as exc:
            log.warning("rank %d: dropped a ring connection from %s: %r", self.rank,
                        ep.peer_address, exc)
            return
        ok = (isinstance(ev, proto.Hello) and ev.version == proto.PROTOCOL_VERSION
              and ev.token == token and ev.rank == want and ev.world == self.world_size)
        fut = self._left_fut
        if not ok or fut is None or fut.done():
            log.warning("rank %d: dropped a ring connection from %s: %r", self.rank,
                        ep.peer_address, ev)
            return
        fut.set_result(ep)
        await self._released.wait()  # the listener closes the endpoint when this returns

    async def _exchange_slots(self, slots: int, slot_bytes: int) -> Ring:
        assert self._left is not None and self._right is not None
        buf = np.zeros(slots * slot_bytes, np.uint8)
        mr = self._left.register(buf, remote_write=True)
        desc = mr.expose(write=True)
        await self._left.send(proto.encode(proto.Slots(descriptor=desc.to_wire(), count=slots,
                                                       size=slot_bytes)))
        data = await self._right.recv()
        ev = proto.decode(data) if data is not None else None
        if not isinstance(ev, proto.Slots) or ev.count < 1 or ev.size < 1:
            raise RemoteProtocolError(f"rank {(self.rank + 1) % self.world_size} sent {ev!r}, "
                                      f"not its receive slots")
        remote = RemoteBuffer.from_wire(ev.descriptor)
        if remote.length < ev.count * ev.size or not remote.writable:
            raise RemoteProtocolError(f"receive slots {remote} do not hold {ev.count} x "
                                      f"{ev.size} B writable")
        return Ring(rank=self.rank, world=self.world_size, left=self._left, right=self._right,
                    slots_mr=mr, slots=buf, slot_count=slots, slot_bytes=slot_bytes,
                    remote=remote, remote_count=ev.count, remote_bytes=ev.size)

    # -- collectives ---------------------------------------------------------------------------

    async def barrier(self, *, timeout: float | None | EllipsisType = ...) -> None:
        """Return once every rank has called ``barrier()`` (``world_size - 1`` message hops
        round the ring).

        Raises:
            BrokenResourceError: a rank died or left; the group is aborted.
            OperationTimeout: ``timeout`` (default: the group's) expired; the group is aborted.
        """
        await self._run("barrier", timeout, lambda ring, call: ring.exchange(call, None))

    async def broadcast(self, array: Any = None, *, root: int = 0,
                        timeout: float | None | EllipsisType = ...) -> np.ndarray:
        """Rank ``root``'s array, on every rank.

        The root passes its array (anything ``np.asarray`` takes; any dtype without Python
        objects, any shape) and gets it back unchanged. Another rank passes ``None`` to get a
        new array, or an array of the root's shape and dtype to have it filled in place (and
        returned). Pipelined along the ring: each rank forwards a piece as soon as it arrived.

        Raises:
            CollectiveArgumentError: ``root`` out of range, an object dtype, or a read-only
                array to fill (before anything is sent).
            CollectiveMismatchError: a non-root's array does not match the root's shape and
                dtype, or ranks disagree on ``root``; the group is aborted.
            BrokenResourceError, OperationTimeout: as :meth:`barrier`.
        """
        if not (isinstance(root, int) and 0 <= root < self.world_size):
            raise CollectiveArgumentError(f"root {root!r} is not a rank of this group")
        if self.rank == root:
            arr = _as_array(array, "broadcast")
        elif array is not None:
            arr = _writable(array, "broadcast")
        else:
            arr = None

        async def run(ring: Ring, call: int) -> np.ndarray:
            if self.rank == root:
                assert arr is not None
                work = ring.work(arr.nbytes)
                np.copyto(work.view(arr.dtype).reshape(arr.shape), arr)
                await ring.broadcast(call, root, work, meta_of(arr))
                return arr
            meta, data = await ring.broadcast(call, root, None, None)
            dtype, shape = meta_dtype_shape(meta)
            got = data.view(dtype).reshape(shape)
            if arr is None:
                return got.copy()
            if arr.shape != shape or arr.dtype != dtype:
                raise CollectiveMismatchError(f"rank {self.rank} passed a {arr.dtype} array of "
                                              f"shape {arr.shape} to broadcast; root {root} "
                                              f"sent {dtype} of shape {shape}")
            np.copyto(arr, got)
            return arr

        if self.world_size == 1:
            self._check_usable()
            assert arr is not None  # the only rank is the root
            return arr
        return await self._run("broadcast", timeout, run)

    async def allgather(self, array: Any, *,
                        timeout: float | None | EllipsisType = ...) -> list[np.ndarray]:
        """Every rank's array, in rank order (new arrays; this rank's is a copy).

        Arrays may differ in shape and dtype between ranks (their descriptions travel round
        the ring first, ``world_size - 1`` small hops, then the data by a ring allgather).

        Raises:
            CollectiveArgumentError: an object dtype.
            BrokenResourceError, OperationTimeout: as :meth:`barrier`.
        """
        arr = _as_array(array, "allgather")

        async def run(ring: Ring, call: int) -> list[np.ndarray]:
            metas = await ring.exchange(call, meta_of(arr))
            described = [meta_dtype_shape(m) for m in metas]
            sizes = [dt.itemsize * int(np.prod(sh, dtype=np.int64)) for dt, sh in described]
            blocks = await ring.allgather(call, sizes, arr)
            return [b.view(dt).reshape(sh).copy()
                    for b, (dt, sh) in zip(blocks, described, strict=True)]

        if self.world_size == 1:
            self._check_usable()
            return [arr.copy()]
        return await self._run("allgather", timeout, run)

    async def allreduce(self, array: np.ndarray, op: str = "sum", *,
                        timeout: float | None | EllipsisType = ...) -> np.ndarray:
        """Reduce ``array`` element-wise over all ranks, in place; returns ``array``.

        ``op`` is ``"sum"``, ``"prod"``, ``"max"`` or ``"min"``; the dtype any boolean,
        integer, floating or complex one (integers wrap as numpy's do). Every rank passes an
        array of the same dtype and element count (any shape and layout; non-contiguous
        arrays are copied in and out). Ring reduce-scatter then allgather by RDMA WRITE: each
        rank sends about ``2 (world_size - 1) / world_size`` times the array's size, and all
        ranks end with bit-identical results.

        Raises:
            CollectiveArgumentError: an unknown op, a dtype it cannot reduce, or a read-only
                or non-numpy ``array`` (before anything is sent).
            CollectiveMismatchError: ranks disagree on op, dtype or size; the group is aborted.
            BrokenResourceError, OperationTimeout: as :meth:`barrier`.
        """
        if op not in REDUCE_OPS:
            raise CollectiveArgumentError(f"op {op!r} is not one of {sorted(REDUCE_OPS)}")
        arr = _writable(array, "allreduce")
        if arr.dtype.kind not in _REDUCIBLE_KINDS or arr.dtype.fields is not None:
            raise CollectiveArgumentError(f"allreduce cannot reduce dtype {arr.dtype}")

        async def run(ring: Ring, call: int) -> np.ndarray:
            dtype = arr.dtype.newbyteorder("=")
            values = ring.work(arr.size * dtype.itemsize).view(dtype)
            np.copyto(values.reshape(arr.shape), arr)
            await ring.allreduce(call, values, op)
            np.copyto(arr, values.reshape(arr.shape))
            return arr

        if self.world_size == 1:
            self._check_usable()
            return arr
        return await self._run("allreduce", timeout, run)

    def _check_usable(self) -> None:
        if self._closed:
            raise ClosedResourceError("the group is closed")
        if self._broken is not None:
            raise BrokenResourceError(f"the group is broken ({self._broken!r}); form a new "
                                      f"one") from self._broken
        if self._busy:
            raise BusyResourceError("another collective of this group is running (one at a "
                                    "time, in the same order on every rank)")

    async def _run(self, what: str, timeout: float | None | EllipsisType,
                   fn: Callable[[Ring, int], Awaitable[T]]) -> T:
        """Run one collective: state checks, the call number, the timeout, and the rule that
        a failed or cancelled collective aborts the group."""
        self._check_usable()
        if self.world_size == 1:  # only barrier gets here: nothing to wait for
            self.calls += 1
            return None  # type: ignore[return-value]
        assert self._ring is not None
        bound = self.timeout if timeout is ... else timeout
        self._busy = True
        self.calls += 1
        try:
            async with asyncio.timeout(bound):  # type: ignore[arg-type]
                return await fn(self._ring, self.calls)
        except TimeoutError:
            exc: BaseException = OperationTimeout(f"rank {self.rank}: {what} took longer than "
                                                  f"{bound} s")
            self._break(exc)
            raise exc from None
        except BaseException as e:
            self._break(e)
            raise
        finally:
            self._busy = False

    def _break(self, exc: BaseException) -> None:
        if self._broken is None:
            self._broken = exc
        self.abort()

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> bool:
        return self._broken is not None

    async def aclose(self) -> None:
        """Close the ring gracefully (messages in flight are delivered), then release
        everything; bounded by the endpoints' ``Config.close_timeout``. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for ep in (self._right, self._left):
                if ep is not None:
                    await ep.aclose()
        finally:
            self._release()
            if self._listener is not None:
                await self._listener.aclose()
            if self._server is not None:
                await self._server.aclose()

    def abort(self) -> None:
        """Close everything at once; the neighbours' collectives fail with
        :class:`~aiordma.BrokenResourceError`. Idempotent."""
        self._closed = self._closed or self._broken is None
        for ep in (self._right, self._left):
            if ep is not None:
                ep.abort()
        self._release()
        if self._listener is not None:
            self._listener.abort()
        if self._server is not None and self._server.listener is not None:
            self._server.listener.abort()
        if self._client is not None:
            self._client.endpoint.abort()
        for fut in (self._left_fut, self._token_fut):
            if fut is not None and not fut.done():
                fut.cancel()

    def _release(self) -> None:
        if self._ring is not None:
            self._ring.close()
        self._released.set()

    async def _abort_quietly(self) -> None:
        """Formation failed: release everything. Rank 0 first gives the other ranks a moment
        to collect the rendezvous' answer (a refusal reaches everyone that way), bounded."""
        server = self._server
        if server is not None and server.listener is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    while server.listener.endpoints:
                        await asyncio.sleep(0.02)
        self.abort()
        with contextlib.suppress(Exception):
            if self._listener is not None:
                await self._listener.aclose()
            if server is not None:
                await server.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self._broken else "open"
        return f"<Group rank {self.rank} of {self.world_size} {state}>"


def _as_array(array: Any, what: str) -> np.ndarray:
    arr = np.asarray(array)
    if arr.dtype.hasobject:
        raise CollectiveArgumentError(f"{what} cannot send Python objects (dtype {arr.dtype})")
    return arr


def _writable(array: Any, what: str) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise CollectiveArgumentError(f"{what} fills a numpy array in place, not "
                                      f"{type(array).__name__}")
    if not array.flags.writeable:
        raise CollectiveArgumentError(f"{what} needs a writable array")
    if array.dtype.hasobject:
        raise CollectiveArgumentError(f"{what} cannot send Python objects (dtype {array.dtype})")
    return array

