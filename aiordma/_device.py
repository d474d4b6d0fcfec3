"""RDMA devices: discovery (ports, GIDs) and :class:`Device`, an opened port to build on.

A :class:`Device` owns a verbs context and protection domain and the choice of port and GID
that every queue pair created on it uses. Resource lifetimes follow pyverbs: children
(reactors, queue pairs, memory regions) hold a strong reference to their device, and
``Device.close()`` closes the children it still has before releasing its own resources.

Device loss
    A device can go away under a running process (``rdma link delete``, a driver unload, a
    fatal hardware error). Measured on Soft-RoCE (kernel 6.1): deleting the link raises *no*
    asynchronous event and traffic keeps flowing, while the kernel's unregister blocks until
    every process has closed its context on the device. So a process that does not notice
    would both keep the device half-alive and hang the administrator's command. Once an event
    loop uses a device (a :class:`~aiordma.lowlevel.CompletionReactor` calls
    :meth:`Device.watch`), the loop watches two file descriptors for it: the context's
    asynchronous event fd (``IBV_EVENT_DEVICE_FATAL`` from drivers that report it; port
    events are counted) and a kernel uevent socket, on which any ``infiniband`` uevent makes
    the device check that its own character device still exists. A lost device fails every
    pending operation with :class:`~aiordma.BrokenResourceError` and releases its resources;
    a later ``connect()`` opens the device afresh when it is back.

Resource counts
    :func:`resource_counts` reports how many verbs objects and loop registrations aiordma
    holds right now, counted at creation and at close only (never on the data path): the
    numbers a leak check compares against a baseline.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import weakref
from dataclasses import dataclass
from typing import Any, Protocol, Self

from ._errors import BrokenResourceError, ClosedResourceError, DeviceError
from ._native import require_pyverbs

__all__ = ["Device", "DeviceInfo", "GidInfo", "PortInfo", "list_devices", "no_device_reason",
           "resource_counts"]

# -- live resource counts ------------------------------------------------------------------------

RESOURCE_KINDS = ("contexts", "pds", "completion_channels", "cqs", "qps", "mrs", "endpoints",
                  "fd_readers")
_live: dict[str, int] = dict.fromkeys(RESOURCE_KINDS, 0)


def resource_counts() -> dict[str, int]:
    """How many of aiordma's resources are open in this process right now.

    Counted when a resource is created and when it is closed (once: ``close()`` is
    idempotent), never on the data path. Keys:

    * ``contexts``, ``pds``: verbs contexts and protection domains (one each per open
      :class:`Device`);
    * ``completion_channels``, ``cqs``: one each per open ``CompletionReactor``;
    * ``qps``: open ``QueuePair`` objects; ``mrs``: registered ``MemoryRegion`` objects;
    * ``endpoints``: :class:`~aiordma.Endpoint` objects not yet closed (``abort()``/
      ``aclose()`` release them);
    * ``fd_readers``: file descriptors aiordma registered with an event loop
      (``loop.add_reader``): completion channels, and the device watches.

    Returns:
        A new dict; compare two snapshots to find a leak.
    """
    return dict(_live)


def count_resource(kind: str, delta: int) -> None:
    """Adjust a live count (creation: +1, close: -1). Private to aiordma's modules."""
    _live[kind] += delta


_EVENT_NAMES = {9: "IBV_EVENT_PORT_ACTIVE", 10: "IBV_EVENT_PORT_ERR",
                15: "IBV_EVENT_DEVICE_FATAL", 18: "IBV_EVENT_GID_CHANGE"}
IBV_EVENT_DEVICE_FATAL = 15
_NETLINK_KOBJECT_UEVENT = 15  # linux/netlink.h; Python's socket module does not name it


def _event_fds() -> set[int]:
    """This process's fds that are verbs event files (async event fds, completion channels)."""
    out = set()
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[infinibandevent]":
                    out.add(int(name))
    return out

MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
_PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
_LINK_LAYERS = {0: "Unspecified", 1: "InfiniBand", 2: "Ethernet"}
_GID_TYPES = {0: "IB", 1: "RoCE v1", 2: "RoCE v2"}  # ibv_gid_type (query_gid_table)
PORT_ACTIVE = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class GidInfo:
    """One valid entry of a port's GID table."""

    index: int
    gid: str  # 'xxxx:xxxx:...' as verbs prints it
    type: str  # "IB", "RoCE v1" or "RoCE v2"
    netdev: str | None  # the network interface a RoCE GID belongs to
    ip: str | None  # the IP address a RoCE GID encodes (IPv4-mapped or IPv6)


@dataclass(frozen=True, slots=True, kw_only=True)
class PortInfo:
    """A port of a device, as ``ibv_query_port`` and the GID table describe it."""

    port: int
    state: str
    link_layer: str
    active_mtu: int  # bytes
    max_mtu: int  # bytes
    lid: int
    gids: tuple[GidInfo, ...]

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceInfo:
    """A device and its ports."""

    name: str
    node_guid: str
    ports: tuple[PortInfo, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "node_guid": self.node_guid,
            "ports": [
                {
                    "port": p.port, "state": p.state, "link_layer": p.link_layer,
                    "active_mtu": p.active_mtu, "max_mtu": p.max_mtu, "lid": p.lid,
                    "gids": [
                        {"index": g.index, "gid": g.gid, "type": g.type, "netdev": g.netdev,
                         "ip": g.ip}
                        for g in p.gids
                    ],
                }
                for p in self.ports
            ],
        }


def gid_to_bytes(gid: str) -> bytes:
    """``'fe80:0000:...'`` (8 groups of 4 hex digits) to 16 bytes."""
    return bytes.fromhex(gid.replace(":", ""))


def bytes_to_gid(raw: bytes) -> str:
    h = raw.hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


def _gid_ip(raw: bytes) -> str | None:
    if raw == bytes(16):
        return None
    addr = ipaddress.IPv6Address(raw)
    if addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


def no_device_reason() -> str:
    """Say, for humans, why this host has no RDMA device."""
    if not os.path.isdir("/sys/class/infiniband"):
        if not os.path.isdir("/sys/module/ib_core") and not _kernel_has_module("ib_core"):
            return ("the running kernel has no RDMA support (no /sys/class/infiniband, and no "
                    "ib_core module to load); use `aiordma rxe run -- CMD`, which boots a VM with "
                    "Debian's kernel and Soft-RoCE")
        return ("no RDMA device: the kernel supports RDMA but none is configured; "
                "`aiordma rxe up` creates a Soft-RoCE device")
    if not os.listdir("/sys/class/infiniband"):
        return "no RDMA device is configured; `aiordma rxe up` creates a Soft-RoCE device"
    return "RDMA devices exist but none has an ACTIVE port"


def _kernel_has_module(name: str) -> bool:
    release = os.uname().release
    root = f"/lib/modules/{release}"
    if not os.path.isdir(root):
        return False
    for _dir, _subdirs, files in os.walk(root):
        if any(f.startswith(name + ".ko") for f in files):
            return True
    return False


def list_devices() -> list[DeviceInfo]:
    """Every RDMA device with its ports and valid GIDs; an empty list when there is none.

    Raises:
        DeviceError: pyverbs is not available (see ``scripts/setup.sh``).
    """
    require_pyverbs()
    from pyverbs.device import Context, get_device_list
    from pyverbs.pyverbs_error import PyverbsError

    try:
        devs = get_device_list()
    except PyverbsError:
        return []  # libibverbs reports no device list when the kernel has no RDMA at all
    out = []
    for dev in devs:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        with Context(name=name) as ctx:
            attr = ctx.query_device()
            ports = []
            for port_num in range(1, attr.phys_port_cnt + 1):
                ports.append(_port_info(ctx, name, port_num))
            guid = f"{dev.guid:016x}"
            guid = ":".join(guid[i:i + 4] for i in range(0, 16, 4))
        out.append(DeviceInfo(name=name, node_guid=guid, ports=tuple(ports)))
    return out


def _port_info(ctx: Any, name: str, port_num: int) -> PortInfo:
    pa = ctx.query_port(port_num)
    gids = _gid_table(ctx, name, port_num, pa.gid_tbl_len)
    return PortInfo(
        port=port_num,
        state=_PORT_STATES.get(pa.state, str(pa.state)),
        link_layer=_LINK_LAYERS.get(pa.link_layer, str(pa.link_layer)),
        active_mtu=MTU_BYTES.get(pa.active_mtu, 0),
        max_mtu=MTU_BYTES.get(pa.max_mtu, 0),
        lid=int(pa.lid),
        gids=tuple(sorted(gids, key=lambda g: g.index)),
    )


def _gid_table(ctx: Any, name: str, port_num: int, table_len: int) -> list[GidInfo]:
    """Valid GIDs of a port: ``ibv_query_gid_table``, else sysfs (kernel 6.1's rxe refuses
    the table query with EINVAL), else ``ibv_query_gid`` on the first entries."""
    from pyverbs.pyverbs_error import PyverbsError

    out = []
    try:
        entries = ctx.query_gid_table(max(table_len, 1))
    except PyverbsError:
        entries = None
    if entries is not None:
        for ent in entries:
            if ent.port_num == port_num:
                gid = str(ctx.query_gid(port_num, ent.gid_index))
                out.append(_gid_info(ent.gid_index, gid, _GID_TYPES.get(ent.gid_type, "?"),
                                     _ifname(ent.ndev_ifindex)))
        return out
    base = f"/sys/class/infiniband/{name}/ports/{port_num}"
    if os.path.isdir(f"{base}/gids"):
        for i in range(table_len):
            sysfs_gid = _read(f"{base}/gids/{i}")
            if not sysfs_gid or gid_to_bytes(sysfs_gid) == bytes(16):
                continue
            kind = _read(f"{base}/gid_attrs/types/{i}") or "?"
            kind = "RoCE v2" if "v2" in kind else ("RoCE v1" if "RoCE" in kind else kind)
            out.append(_gid_info(i, sysfs_gid, kind, _read(f"{base}/gid_attrs/ndevs/{i}")))
        return out
    for i in range(min(table_len, 16)):
        try:
            gid = str(ctx.query_gid(port_num, i))
            kind = {0: "RoCE v1", 1: "RoCE v2"}.get(ctx.query_gid_type(port_num, i), "?")
        except PyverbsError:
            continue
        if gid_to_bytes(gid) != bytes(16):
            out.append(_gid_info(i, gid, kind, None))
    return out


def _gid_info(index: int, gid: str, kind: str, netdev: str | None) -> GidInfo:
    return GidInfo(index=index, gid=gid, type=kind, netdev=netdev, ip=_gid_ip(gid_to_bytes(gid)))


def _ifname(ifindex: int) -> str | None:
    try:
        return socket.if_indextoname(ifindex) if ifindex else None
    except OSError:
        return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


class _Closeable(Protocol):
    def close(self) -> None: ...


def _choose_gid(port: PortInfo, want_ip: str | None) -> GidInfo | None:
    """The GID to use on a port: the RoCE v2 GID of ``want_ip`` if given, else IPv4 RoCE v2
    first."""
    if port.link_layer != "Ethernet":
        return port.gids[0] if port.gids else None

    def rank(g: GidInfo) -> tuple[int, int, int]:
        return (g.type != "RoCE v2", not (g.ip and "." in g.ip), g.index)

    cands = [g for g in port.gids if g.ip is not None]
    if want_ip is not None:
        cands = [g for g in cands if g.ip == want_ip]
    return min(cands, key=rank) if cands else None


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
        require_pyverbs()
        from pyverbs.device import Context
        from pyverbs.pd import PD
        from pyverbs.pyverbs_error import PyverbsError

        info = self._select(list_devices(), name, port)
        pinfo = next(p for p in info.ports if port is None or p.port == port)
        if port is None:
            pinfo = next(p for p in info.ports if p.active)
        if gid_index is None:
            g = _choose_gid(pinfo, local_ip)
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
        self._children: weakref.WeakSet[_Closeable] = weakref.WeakSet()
        self._closed = False
        self._lost: BrokenResourceError | None = None
        self._watch_loop: asyncio.AbstractEventLoop | None = None
        self._uevents: socket.socket | None = None
        self.port_events: dict[str, int] = {}
        before = _event_fds()
        try:
            self.context = Context(name=info.name)
        except PyverbsError as exc:
            raise DeviceError(f"cannot open {info.name}: {exc}") from exc
        # pyverbs does not expose the context's async event fd; libibverbs opens it together
        # with the context, so it is the one new verbs event file (None if that is ambiguous).
        new = _event_fds() - before
        self._async_fd: int | None = new.pop() if len(new) == 1 else None
        try:
            self.pd = PD(self.context)
            self.attr = self.context.query_device()
            pa = self.context.query_port(self.port)
        except PyverbsError as exc:
            self.context.close()
            raise DeviceError(f"cannot open {info.name}: {exc}") from exc
        self.active_mtu_enum: int = int(pa.active_mtu)
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
        loop. A device is watched by one loop at a time (the last one that asked). When the
        device is removed or reports ``IBV_EVENT_DEVICE_FATAL``, it is lost: :attr:`lost` is
        set, every pending operation on it fails with :class:`BrokenResourceError` and the
        device closes (which lets the kernel finish removing it).

        Raises:
            ClosedResourceError: the device is closed.
            RuntimeError: no event loop is running.
        """
        if self._closed:
            raise ClosedResourceError(f"device {self.name} is closed")
        loop = asyncio.get_running_loop()
        if self._watch_loop is loop:
            return
        self._unwatch()
        self._watch_loop = loop
        if self._async_fd is not None:
            os.set_blocking(self._async_fd, False)
            loop.add_reader(self._async_fd, self._on_async_event)
            count_resource("fd_readers", 1)
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_KOBJECT_UEVENT)
            sock.bind((0, 1))  # group 1: kernel uevents (receiving needs no privilege)
            sock.setblocking(False)
        except OSError:
            return  # no uevents here (a sandbox): only the async event fd is watched
        self._uevents = sock
        loop.add_reader(sock.fileno(), self._on_uevent)
        count_resource("fd_readers", 1)

    def _unwatch(self) -> None:
        loop, self._watch_loop = self._watch_loop, None
        if loop is None:
            return
        if self._async_fd is not None:
            if not loop.is_closed():
                loop.remove_reader(self._async_fd)
            count_resource("fd_readers", -1)
        if self._uevents is not None:
            if not loop.is_closed():
                loop.remove_reader(self._uevents.fileno())
            self._uevents.close()
            self._uevents = None
            count_resource("fd_readers", -1)

    def _on_async_event(self) -> None:
        from pyverbs.pyverbs_error import PyverbsError

        try:
            event = self.context.get_async_event()
        except PyverbsError:  # nothing to read (the fd is non-blocking), or the device is gone
            self.check_present()
            return
        kind = int(event.event_type)
        event.ack()  # destroying a QP/CQ waits until its events are acknowledged
        name = _EVENT_NAMES.get(kind, f"event {kind}")
        self.port_events[name] = self.port_events.get(name, 0) + 1
        if kind == IBV_EVENT_DEVICE_FATAL:
            self._lose("the device reported a fatal error (IBV_EVENT_DEVICE_FATAL)")

    def _on_uevent(self) -> None:
        assert self._uevents is not None
        relevant = False
        while True:
            try:
                msg = self._uevents.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # ENOBUFS: uevents were dropped; look anyway
                relevant = True
                break
            relevant = relevant or b"infiniband" in msg
        if relevant:
            self.check_present()

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
        from ._errors import BusyResourceError

        if not self._closed:
            raise BusyResourceError(f"device {self.name} is open")
        self.__init__(self.name, port=self.port, gid_index=self.gid_index)  # type: ignore[misc]

    def close(self) -> None:
        """Close the children still open, then the protection domain and the context."""
        if self._closed:
            return
        self._closed = True
        self._unwatch()
        _open_devices.discard(self)
        while self._children:
            try:
                child = self._children.pop()
            except KeyError:
                break
            if self._lost is None:
                child.close()
            else:  # a lost device: release everything whatever fails
                with contextlib.suppress(Exception):
                    child.close()
        try:
            self.pd.close()
            self.context.close()
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
