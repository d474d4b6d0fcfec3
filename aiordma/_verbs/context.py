"""A device context and its protection domain: opening them, and the context's asynchronous
events."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

from aiordma._errors import DeviceError
from aiordma._verbs.load import require_pyverbs

__all__ = ["OpenedContext", "event_fds", "open_context", "read_async_event"]


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenedContext:
    """What :func:`open_context` opened: pyverbs' ``Context`` and ``PD`` (close the PD first),
    the device's attributes, the port's active MTU (``ibv_mtu``) and the context's
    asynchronous event fd (None if it could not be told apart)."""

    context: Any
    pd: Any
    attr: Any
    active_mtu: int
    async_fd: int | None


def event_fds() -> set[int]:
    """This process's fds that are verbs event files (async event fds, completion channels)."""
    out = set()
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[infinibandevent]":
                    out.add(int(name))
    return out


def open_context(name: str, port: int) -> OpenedContext:
    """Open device ``name``'s context and a protection domain, and query ``port``.

    Raises:
        DeviceError: pyverbs is not available, or the device refused.
    """
    require_pyverbs()
    from pyverbs.device import Context
    from pyverbs.pd import PD
    from pyverbs.pyverbs_error import PyverbsError

    before = event_fds()
    try:
        context = Context(name=name)
    except PyverbsError as exc:
        raise DeviceError(f"cannot open {name}: {exc}") from exc
    # pyverbs does not expose the context's async event fd; libibverbs opens it together
    # with the context, so it is the one new verbs event file (None if that is ambiguous).
    new = event_fds() - before
    try:
        pd = PD(context)
        attr = context.query_device()
        pa = context.query_port(port)
    except PyverbsError as exc:
        context.close()
        raise DeviceError(f"cannot open {name}: {exc}") from exc
    return OpenedContext(context=context, pd=pd, attr=attr, active_mtu=int(pa.active_mtu),
                         async_fd=new.pop() if len(new) == 1 else None)


def read_async_event(context: Any) -> int | None:
    """Read and acknowledge one asynchronous event of ``context`` (its fd non-blocking); its
    ``ibv_event_type``, or None when there was none to read or the device is gone."""
    from pyverbs.pyverbs_error import PyverbsError

    try:
        event = context.get_async_event()
    except PyverbsError:
        return None
    kind = int(event.event_type)
    event.ack()  # destroying a QP/CQ waits until its events are acknowledged
    return kind
