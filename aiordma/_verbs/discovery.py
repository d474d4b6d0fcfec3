"""Finding RDMA devices: their ports, GID tables and the GID to use, and why there is none.

Plain data (:class:`DeviceInfo`, :class:`PortInfo`, :class:`GidInfo`) read with a short-lived
verbs context per device; :class:`aiordma.lowlevel.Device` opens one to build on.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Any

from aiordma._verbs.load import require_pyverbs

__all__ = ["DeviceInfo", "GidInfo", "PortInfo", "bytes_to_gid", "choose_gid", "gid_to_bytes",
           "list_devices", "no_device_reason"]

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
                    "ib_core module to load); in a checkout of aiordma, `python -m harness run "
                    "-- CMD` boots a VM with Debian's kernel and Soft-RoCE")
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


def choose_gid(port: PortInfo, want_ip: str | None) -> GidInfo | None:
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
