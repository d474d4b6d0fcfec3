"""Noticing that an open device went away, from the event loop.

A device can go away under a running process (``rdma link delete``, a driver unload, a fatal
hardware error). Measured on Soft-RoCE (kernel 6.1): deleting the link raises *no*
asynchronous event and traffic keeps flowing, while the kernel's unregister blocks until every
process has closed its context on the device. So a process that does not notice would both
keep the device half-alive and hang the administrator's command. :class:`LossWatch` watches
two file descriptors for a :class:`~aiordma.lowlevel.Device` from one event loop: the context's
asynchronous event fd (``IBV_EVENT_DEVICE_FATAL`` from drivers that report it; port events are
counted) and a kernel uevent socket, on which any ``infiniband`` uevent makes the device check
that its own character device still exists.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable
from typing import Any

from aiordma._resources import count_resource
from aiordma._verbs.context import read_async_event

__all__ = ["LossWatch"]

_EVENT_NAMES = {9: "IBV_EVENT_PORT_ACTIVE", 10: "IBV_EVENT_PORT_ERR",
                15: "IBV_EVENT_DEVICE_FATAL", 18: "IBV_EVENT_GID_CHANGE"}
IBV_EVENT_DEVICE_FATAL = 15
_NETLINK_KOBJECT_UEVENT = 15  # linux/netlink.h; Python's socket module does not name it


class LossWatch:
    """The loss watch of one device context, registered with one event loop at a time.

    Args:
        context: the device's pyverbs ``Context``.
        async_fd: the context's asynchronous event fd, or None if it is not known.
        check_present: the device's check (loses the device if its character device is gone).
        lose: called with the reason when the device reports a fatal error.

    Attributes:
        port_events: asynchronous events seen, by name.
    """

    def __init__(self, context: Any, async_fd: int | None, *, check_present: Callable[[], bool],
                 lose: Callable[[str], None]) -> None:
        self._context = context
        self._async_fd = async_fd
        self._check_present = check_present
        self._lose = lose
        self._loop: asyncio.AbstractEventLoop | None = None
        self._uevents: socket.socket | None = None
        self.port_events: dict[str, int] = {}

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch from ``loop`` (moving from the loop that watched before, if another)."""
        if self._loop is loop:
            return
        self.unwatch()
        self._loop = loop
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

    def unwatch(self, only: asyncio.AbstractEventLoop | None = None) -> None:
        """Stop watching (with ``only``: if ``only`` is the loop that watches)."""
        if only is not None and self._loop is not only:
            return
        loop, self._loop = self._loop, None
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
        kind = read_async_event(self._context)
        if kind is None:  # nothing to read (the fd is non-blocking), or the device is gone
            self._check_present()
            return
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
            self._check_present()
