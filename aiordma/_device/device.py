"""An opened RDMA device port to build on: :class:`Device`.

A :class:`Device` owns a verbs context and protection domain and the choice of port and GID
that every queue pair created on it uses. Resource lifetimes follow pyverbs: children
(reactors, queue pairs, memory regions) hold a strong reference to their device, and
``Device.close()`` closes the children it still has before releasing its own resources.

Finding devices is :mod:`aiordma._verbs.discovery`; noticing that one went away,
:mod:`.watch`
(once an event loop uses a device, a :class:`~aiordma.lowlevel.CompletionReactor` calls
:meth:`Device.watch`); a lost device fails every pending operation with
:class:`~aiordma.BrokenResourceError` and releases its resources, and a later ``connect()``
opens the device afresh when it is back. Live counts are :mod:`._resources`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import weakref
from typing import Any, Protocol, Self

from aiordma._device.watch import LossWatch
from aiordma._errors import BrokenResourceError, BusyResourceError, ClosedResourceError, DeviceError
from aiordma._resources import count_resource, resource_counts
from aiordma._verbs.context import open_context
from aiordma._verbs.discovery import (
    MTU_BYTES,
    DeviceInfo,
    GidInfo,
    PortInfo,
    choose_gid,
    gid_to_bytes,
    list_devices,
    no_device_reason,
)

__all__ = ["Device", "DeviceInfo", "GidInfo", "PortInfo", "list_devices", "no_device_reason",
           "open_devices", "resource_counts"]


class _Closeable(Protocol):
    def close(self) -> None: ...


class Device:
    """An opened RDMA device port: a verbs context, a protection domain, a port and a GID.

    Args:
        name: device name (``"rxe0"``); default: the first device with an ACTIVE port.
        port: port number; default: the first ACTIVE port.
        gid_index: GID table index; default: the RoCE v2 GID of ``local_ip``, or the first
            IPv4 RoCE v2 GID (InfiniBand: index 0).
        local_ip: pick the GID that encodes this local address.

    Raises:
        DeviceError: no such device, no ACTIVE port or no usable GID.

    ``close()`` is idempotent and closes the reactors, queue pairs and memory regions created
    on this device that are still open. Use it as a context manager to close on exit.
    """

    def __init__(self, name: str | None = None, *, port: int | None = None,
                 gid_index: int | None = None, local_ip: str | None = None) -> None:
        self._children: weakref.WeakSet[_Closeable] = weakref.WeakSet()
        self._reactors: weakref.WeakSet[Any] = weakref.WeakSet()  # open ones (see watch())
        self._closed = True  # until _open() succeeds
        self._lost: BrokenResourceError | None = None
        self._open(name, port=port, gid_index=gid_index, local_ip=local_ip)

    def _open(self, name: str | None, *, port: int | None, gid_index: int | None,
              local_ip: str | None) -> None:
        """Choose the port and GID, open the context and protection domain (``__init__`` and
        :meth:`reopen`)."""
        info = self._select(list_devices(), name, port)
        pinfo = next(p for p in info.ports if port is None or p.port == port)
        if port is None:
            pinfo = next(p for p in info.ports if p.active)
        if gid_index is None:
            g = choose_gid(pinfo, local_ip)
            if g is None:
                raise DeviceError(f"{info.name} port {pinfo.port} has no usable GID"
                                  + (f" for {local_ip}" if local_ip else ""))
        else:
            matches = [x for x in pinfo.gids if x.index == gid_index]
            if not matches:
                raise DeviceError(f"{info.name} port {pinfo.port} has no GID at index {gid_index}")
            g = matches[0]
        self.info: DeviceInfo = info
        self.port_info: PortInfo = pinfo
        self.name: str = info.name
        self.port: int = pinfo.port
        self.gid_index: int = g.index
        self.gid: bytes = gid_to_bytes(g.gid)
        self.gid_info: GidInfo = g
        opened = open_context(info.name, self.port)
        self.context = opened.context
        self.pd = opened.pd
        self.attr = opened.attr
        self.active_mtu_enum: int = opened.active_mtu
        self._watch = LossWatch(self.context, opened.async_fd, check_present=self.check_present,
                                lose=self._lose)
        self._closed = False
        self._lost = None
        count_resource("contexts", 1)
        count_resource("pds", 1)
        _open_devices.add(self)

    @staticmethod
    def _select(devs: list[DeviceInfo], name: str | None, port: int | None) -> DeviceInfo:
        if not devs:
            raise DeviceError(no_device_reason())
        if name is not None:
            named = [d for d in devs if d.name == name]
            if not named:
                raise DeviceError(f"no RDMA device named {name!r} (have: "
                                  f"{', '.join(d.name for d in devs)})")
            devs = named
        for d in devs:
            for p in d.ports:
                if (port is None and p.active) or (port is not None and p.port == port):
                    if not p.active:
                        raise DeviceError(f"{d.name} port {p.port} is {p.state}, not ACTIVE")
                    return d
        raise DeviceError(f"no ACTIVE port on {', '.join(d.name for d in devs)}")

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def mtu(self) -> int:
        """The port's active MTU in bytes."""
        return MTU_BYTES[self.active_mtu_enum]

    def _adopt(self, child: _Closeable) -> None:
        """Register a child so that ``close()`` closes it first."""
        if self._closed:
            raise ClosedResourceError(f"device {self.name} is closed")
        self._children.add(child)

    @property
    def lost(self) -> BrokenResourceError | None:
        """Why the device was lost (removed, or a fatal error), or None."""
        return self._lost

    def watch(self) -> None:
        """Watch this device from the running event loop, so that its loss is noticed.

        Reactors call this; call it yourself for a device that has no reactor on the running
        loop. A device is watched by one loop at a time (the last one that asked), until the
        last reactor of that loop on this device closes (a loop that no longer uses the device
        keeps no watch: no socket left open, no reader left on a closed loop). When the
        device is removed or reports ``IBV_EVENT_DEVICE_FATAL``, it is lost: :attr:`lost` is
        set, every pending operation on it fails with :class:`BrokenResourceError` and the
        device closes (which lets the kernel finish removing it).

        Raises:
            ClosedResourceError: the device is closed.
            RuntimeError: no event loop is running.
        """
        if self._closed:
            raise ClosedResourceError(f"device {self.name} is closed")
        self._watch.watch(asyncio.get_running_loop())

    def _reactor_opened(self, reactor: Any) -> None:
        self._reactors.add(reactor)

    def _reactor_closed(self, reactor: Any) -> None:
        """``reactor`` closed: if it was the last reactor of its loop on this device, the watch
        leaves that loop (else it would keep a uevent socket and two readers registered with a
        loop that nothing on this device uses any more, often one that is closing)."""
        self._reactors.discard(reactor)
        loop = reactor.loop
        if not any(r.loop is loop for r in self._reactors):
            self._watch.unwatch(only=loop)

    @property
    def port_events(self) -> dict[str, int]:
        """Asynchronous events the device reported while watched, by name."""
        return self._watch.port_events

    def check_present(self) -> bool:
        """Whether the device behind this context still exists; if not, lose it now.

        The context's command fd is the device's character device
        (``/dev/infiniband/uverbsN``); the kernel deletes that node first when it removes the
        device, so the open file then shows as deleted.

        Returns:
            False if the device is lost (now or before) or closed.
        """
        if self._closed:
            return False
        try:
            target = os.readlink(f"/proc/self/fd/{self.context.cmd_fd}")
        except OSError:
            return True  # no /proc: nothing to tell
        if target.endswith(" (deleted)"):
            self._lose(f"the device was removed ({target})")
            return False
        return True

    def _lose(self, why: str) -> None:
        """The device is gone: fail everything pending with :class:`BrokenResourceError`,
        release every resource on it (reactors close with :attr:`lost` as the error)."""
        if self._closed:
            return
        self._lost = BrokenResourceError(f"RDMA device {self.name} was lost: {why}")
        self.close()

    def reopen(self) -> None:
        """Open the same device, port and GID index again after :meth:`close` or a loss.

        Resources created before stay closed; :attr:`lost` is cleared.

        Raises:
            BusyResourceError: the device is still open.
            DeviceError: the device is not (yet) back, or its port or GID index is gone.
        """
        if not self._closed:
            raise BusyResourceError(f"device {self.name} is open")
        self._open(self.name, port=self.port, gid_index=self.gid_index, local_ip=None)

    def close(self) -> None:
        """Close the children still open, then the protection domain and the context."""
        self._close(best_effort=self._lost is not None)

    def _close(self, *, best_effort: bool) -> None:
        """:meth:`close`; ``best_effort``: release everything whatever fails (a lost device,
        or the interpreter's exit)."""
        if self._closed:
            return
        self._closed = True
        self._watch.unwatch()
        _open_devices.discard(self)
        while self._children:
            try:
                child = self._children.pop()
            except KeyError:
                break
            if not best_effort:
                child.close()
            else:
                with contextlib.suppress(Exception):
                    child.close()
        try:
            self.pd.close()
            self.context.close()
        except Exception:
            if not best_effort:
                raise
        finally:
            count_resource("contexts", -1)
            count_resource("pds", -1)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ("lost" if self._lost else "closed" if self._closed
                 else f"port {self.port}, gid {self.gid_index}")
        return f"<Device {self.name} {state}>"


# Every open Device, so that a test (or a debugger) can find what holds a device open.
_open_devices: weakref.WeakSet[Device] = weakref.WeakSet()


def _close_at_exit() -> None:
    """Close the devices a program left open when the interpreter exits, children first, as
    :meth:`Device.close` does. Otherwise the garbage collector frees pyverbs' objects in any
    order, and a completion channel destroyed before its CQ (``EBUSY``) or a memory region
    after its context (``EBADF``) prints a traceback for each at exit."""
    for device in list(_open_devices):
        device._close(best_effort=True)


atexit.register(_close_at_exit)


def open_devices() -> list[Device]:
    """Every :class:`Device` open in this process: what holds a device open (a device that
    goes away is released by the kernel only once every process closed it)."""
    return list(_open_devices)
