"""Revocable exposure: a byte range reachable by one endpoint's peer until it is revoked.

``await endpoint.expose(region[a:b], read=True)`` returns an :class:`Exposure`; send
``exposure.remote.to_wire()`` to the peer; ``exposure.revoke()`` ends the access: after it
returns, the peer's RDMA READ/WRITE/atomic with that rkey fails with a remote access error
(:class:`aiordma.RemoteAccessError` on the peer, whose connection then breaks, as it does for
any bad rkey). Only that exposure is affected; the region and other exposures stay usable.

Two mechanisms, chosen per device:

``"window"`` (type-2 memory windows, where the device has them; rxe does)
    The range gets a registration of its own that grants *no* remote access (local write if
    the buffer is writable, plus ``IBV_ACCESS_MW_BIND``), so its rkey reaches nothing. A
    type-2 memory window is allocated and bound to exactly the range and the access asked
    for by a bind work request posted on the endpoint's queue pair (``IBV_WR_BIND_MW``): its
    rkey is accepted on that queue pair only, so no other connection can use it even if the
    key leaks. ``revoke()`` deallocates the window (``ibv_dealloc_mw``, synchronous: the key
    is invalid when it returns, even if the queue pair is already in the error state), then
    deregisters the range.
``"registration"`` (fallback, where memory windows are missing)
    A registration of exactly the range with exactly the access asked for; ``revoke()``
    deregisters it. Its rkey works on every queue pair of the device's protection domain
    (other connections of this process on the same device) until revoked.

Measured on rxe (Debian kernel 6.1, pyverbs 59), which shaped this design:

* a window's rkey reached bytes *outside* the window but inside its memory region (the
  responder checked the region's bounds only), so each exposure registers exactly its range:
  the registration's bounds are what actually bounds the access there;
* a window cannot be bound again after invalidation through pyverbs (``SendWR.set_bind_wr``
  derives the new key from the window's original rkey, which the provider never updates, and
  the kernel refuses the stale key: ``IBV_WC_MW_BIND_ERR``), so a window is used once;
* destroying a queue pair while a type-2 window is still bound to it blocked the calling
  thread for about 51 s (the kernel waits for the window's reference to the queue pair), so
  the endpoint revokes its exposures before it destroys its queue pair (its
  :class:`Exposures`), and a region revokes its exposures before it deregisters.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Callable
from typing import Any, Literal, Protocol, Self

from aiordma._args import check_bool
from aiordma._device.device import Device
from aiordma._errors import ClosedResourceError, DeviceError, LocalProtocolError
from aiordma._memory.region import LocalSlice, MemoryRegion, RemoteBuffer, remote_access
from aiordma._resources import count_resource
from aiordma._verbs import mr as verbs_mr

__all__ = ["Exposure", "Exposures", "Mechanism", "supports_memory_windows"]

Mechanism = Literal["window", "registration"]


class Endpoint(Protocol):
    """What an exposure needs of the endpoint that makes it (an :class:`aiordma.Endpoint`):
    its device. The endpoint also supplies the bind's posting (:data:`PostWindowWR`) and owns
    the :class:`Exposures`; this module does not import the endpoint."""

    @property
    def device(self) -> Device: ...

PostWindowWR = Callable[[Any, str], "asyncio.Future[Any]"]
"""Posts a memory-window work request on the endpoint's queue pair now and returns the future
of its completion (``Endpoint.expose`` supplies it; the endpoint's abort fails the future)."""



class Exposures:
    """An endpoint's live exposures, owned by the endpoint: revoked by :meth:`release` before
    its queue pair is destroyed (a queue pair with a type-2 window still bound took ~51 s to
    destroy on rxe); one window bind in flight at a time (the queue pair has one spare send
    entry for it)."""

    def __init__(self) -> None:
        self._live: set[Exposure] = set()
        self.bind_lock = asyncio.Lock()

    def __len__(self) -> int:
        return len(self._live)

    def add(self, exposure: Exposure) -> None:
        self._live.add(exposure)

    def discard(self, exposure: Exposure) -> None:
        self._live.discard(exposure)

    def release(self) -> None:
        """Revoke every exposure; never raises (teardown must go on)."""
        live, self._live = self._live, set()
        for exposure in list(live):
            try:
                exposure.revoke()
            except DeviceError:
                pass

# devices where allocating a window failed with EOPNOTSUPP: the fallback from then on
_no_windows: weakref.WeakSet[Device] = weakref.WeakSet()


def supports_memory_windows(device: Device) -> bool:
    """Whether ``device`` reports type-2 memory windows (``max_mw`` > 0 and
    ``IBV_DEVICE_MEM_WINDOW_TYPE_2A`` or ``_2B`` in ``device_cap_flags``)."""
    return device not in _no_windows and verbs_mr.supports_memory_windows(device.attr)


class Exposure:
    """Access for one endpoint's peer to a byte range, until :meth:`revoke`.

    Made by ``await Endpoint.expose(...)``; not constructed directly. Use it as ``with`` or
    ``async with`` to revoke on exit. It keeps its region alive; the region revokes it when
    it is closed, and the endpoint revokes it when it closes.

    Attributes:
        remote: the descriptor to send to the peer (``remote.to_wire()``).
        mechanism: ``"window"`` (a type-2 memory window bound to the endpoint's queue pair)
            or ``"registration"`` (a registration of exactly the range; the fallback).
        region: the region the range belongs to.
    """

    def __init__(self, *, endpoint: Endpoint, owner: Exposures, region: MemoryRegion,
                 remote: RemoteBuffer, mechanism: Mechanism, mr: Any, mw: Any = None) -> None:
        # Built by create(); the pyverbs objects are owned from here on.
        self.endpoint = endpoint
        self._owner = owner
        self.region = region
        self.remote = remote
        self.mechanism: Mechanism = mechanism
        self._mr = mr
        self._mw = mw
        self._revoked = False

    @classmethod
    async def create(cls, endpoint: Endpoint, local: LocalSlice, *, read: bool, write: bool,
                     atomic: bool, post: PostWindowWR, owner: Exposures,
                     mechanism: Mechanism | None = None) -> Exposure:
        """Expose ``local`` to ``endpoint``'s peer; see ``Endpoint.expose``.

        Args:
            post: posts the bind work request on the endpoint's queue pair.
            owner: the endpoint's :class:`Exposures` (it revokes them at teardown).
            mechanism: force one (tests); default: ``"window"`` where supported.

        Raises:
            LocalProtocolError: not a slice of an open region on the endpoint's device, a flag
                that is not a bool, an empty range, no access asked for, write/atomic on
                read-only memory, or a ``mechanism`` other than ``"window"`` or
                ``"registration"`` (or ``"window"`` on a device without memory windows).
            DeviceError: a verbs call failed (registration, window allocation, posting).
            CompletionError: the bind work request failed (the endpoint is then broken).
            ClosedResourceError, BrokenResourceError: the endpoint is closed or broken.
        """
        if not isinstance(local, LocalSlice):
            raise LocalProtocolError("expose() takes a slice of a registered region: "
                                     "region[start:stop]")
        for name, flag in (("read", read), ("write", write), ("atomic", atomic)):
            check_bool(flag, name=name)
        if mechanism is not None and (not isinstance(mechanism, str)
                                      or mechanism not in ("window", "registration")):
            raise LocalProtocolError(f"mechanism is 'window' or 'registration', not "
                                     f"{mechanism!r:.80}")
        region = local.region
        if region.closed:
            raise ClosedResourceError("the memory region is deregistered")
        if region.device is not endpoint.device:
            raise LocalProtocolError("the region is registered on another device")
        if not (read or write or atomic):
            raise LocalProtocolError("expose() needs at least one of read, write, atomic")
        if local.length == 0:
            raise LocalProtocolError("expose() needs a non-empty range")
        if region.readonly and (write or atomic):
            raise LocalProtocolError("read-only memory cannot be exposed for remote write/atomic")
        if atomic and local.address % 8:
            raise LocalProtocolError("an atomic exposure starts 8-byte aligned")
        windows = supports_memory_windows(endpoint.device)
        if mechanism is None:
            mechanism = "window" if windows else "registration"
        elif mechanism == "window" and not windows:
            raise LocalProtocolError(f"{endpoint.device.name} has no type-2 memory windows")
        remote = RemoteBuffer(address=local.address, rkey=0, length=local.length,
                              readable=read, writable=write, atomic=atomic)
        if mechanism == "window":
            made = await cls._bind(endpoint, owner, region, local, remote, post)
            if made is not None:
                return made
        mr = region.register_range(read, write, atomic, offset=local.offset, length=local.length)
        count_resource("mrs", 1)
        exposure = cls(endpoint=endpoint, owner=owner, region=region, mechanism="registration",
                       mr=mr,
                       remote=RemoteBuffer(address=local.address, rkey=int(mr.rkey),
                                           length=local.length, readable=read,
                                           writable=write, atomic=atomic))
        exposure._track()
        return exposure

    @classmethod
    async def _bind(cls, endpoint: Endpoint, exposures: Exposures, region: MemoryRegion,
                    local: LocalSlice, remote: RemoteBuffer,
                    post: PostWindowWR) -> Exposure | None:
        """A window bound to ``local`` on the endpoint's queue pair; ``None`` if the device
        refused to allocate one (EOPNOTSUPP): the caller falls back."""
        device = endpoint.device
        mw = verbs_mr.allocate_window(device.pd, device_name=device.name)
        if mw is None:  # EOPNOTSUPP
            _no_windows.add(device)
            return None
        range_mr = None
        try:
            # No remote access: only the window grants any, and only to this queue pair.
            range_mr = region.register_range(False, False, False, mw_bind=True,
                                             offset=local.offset, length=local.length)
            count_resource("mrs", 1)
            wr, rkey = verbs_mr.bind_request(mw, range_mr, local.address, local.length,
                                       remote_access(remote.readable, remote.writable,
                                                     remote.atomic))
            exposure = cls(endpoint=endpoint, owner=exposures, region=region, mechanism="window",
                           mr=range_mr, mw=mw,
                           remote=RemoteBuffer(address=remote.address, rkey=rkey,
                                               length=remote.length, readable=remote.readable,
                                               writable=remote.writable, atomic=remote.atomic))
            # Tracked before the bind completes: if the endpoint closes meanwhile, its
            # teardown deallocates the window before destroying the queue pair.
            exposure._track()
        except BaseException:
            _close_mw(mw)
            if range_mr is not None:
                _close_mr(range_mr)
            raise
        async with exposures.bind_lock:
            try:
                fut = post(wr, "bind memory window")
            except BaseException:
                exposure.revoke()
                raise
            try:
                await asyncio.shield(fut)
            except asyncio.CancelledError:
                # The key must not stay valid, but deallocating the window while its bind is
                # still queued would fail the bind and break the endpoint: revoke once the
                # bind has completed (a local operation: milliseconds).
                if fut.done():
                    exposure.revoke()
                else:
                    fut.add_done_callback(lambda _f: _quietly(exposure.revoke))
                raise
            except BaseException:
                exposure.revoke()  # the bind failed, or the endpoint closed or broke
                raise
        return exposure

    def _track(self) -> None:
        self._owner.add(self)
        self.region.add_dependent(self)

    @property
    def revoked(self) -> bool:
        return self._revoked

    def revoke(self) -> None:
        """End the peer's access now (idempotent).

        When this returns, the rkey is invalid: a window is deallocated (which invalidates
        it), then the range's registration is deregistered. Synchronous (two system calls):
        safe in ``finally`` blocks and from teardown.

        Raises:
            DeviceError: a verbs call failed (the exposure is still marked revoked; its
                remaining resources go with the device).
        """
        if self._revoked:
            return
        self._revoked = True
        self._owner.discard(self)
        self.region.remove_dependent(self)
        mw, self._mw = self._mw, None
        mr, self._mr = self._mr, None
        try:
            if mw is not None:
                _close_mw(mw)
        finally:
            if mr is not None:
                _close_mr(mr)

    close = revoke

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.revoke()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.revoke()

    def __repr__(self) -> str:
        r = self.remote
        access = "".join(c for c, on in (("r", r.readable), ("w", r.writable),
                                         ("a", r.atomic)) if on)
        state = "revoked" if self._revoked else f"rkey {r.rkey:#x}"
        return f"<Exposure {self.mechanism} {r.length} B at {r.address:#x} {access} {state}>"


def _quietly(fn: Callable[[], None]) -> None:
    with contextlib.suppress(DeviceError):
        fn()


def _close_mw(mw: Any) -> None:
    verbs_mr.close(mw, "deallocate a memory window")


def _close_mr(obj: Any) -> None:
    try:
        verbs_mr.close(obj, "deregister an exposed range")
    finally:
        count_resource("mrs", -1)
