"""What a connection without RDMA answers to one-sided operations: a typed error naming its
transport, never an ``AttributeError``, so code written for an :class:`~aiordma.Endpoint` that
meets a TCP channel (``transport="auto"`` where a side has no device) fails plainly."""

from __future__ import annotations

from typing import Any, NoReturn

from aiordma._errors import UnsupportedOperationError

__all__ = ["OneSidedNeedsRdma"]


class OneSidedNeedsRdma:
    """The one-sided half of an :class:`~aiordma.Endpoint`'s API, each method raising
    :class:`~aiordma.UnsupportedOperationError` (nothing is done; the connection is
    unchanged)."""

    transport = "tcp"

    def _unsupported(self, operation: str) -> NoReturn:
        raise UnsupportedOperationError(
            f"{operation}() needs RDMA; this connection's messages travel over TCP (transport "
            f"'tcp'): move the data in messages, or connect with transport='rdma'",
            operation=operation, transport=self.transport)

    def register(self, buffer: Any, **access: Any) -> NoReturn:
        """Raises :class:`~aiordma.UnsupportedOperationError` (memory is registered for RDMA)."""
        self._unsupported("register")

    async def write(self, src: Any, dst: Any) -> NoReturn:
        """Raises :class:`~aiordma.UnsupportedOperationError` (an RDMA WRITE)."""
        self._unsupported("write")

    async def post_write(self, src: Any, dst: Any, *, notify: Any = None) -> NoReturn:
        """Raises :class:`~aiordma.UnsupportedOperationError` (an RDMA WRITE)."""
        self._unsupported("post_write")

    async def read(self, dst: Any, src: Any) -> NoReturn:
        """Raises :class:`~aiordma.UnsupportedOperationError` (an RDMA READ)."""
        self._unsupported("read")

    async def fetch_add(self, target: Any, add: int) -> NoReturn:
        """Raises :class:`~aiordma.UnsupportedOperationError` (an RDMA atomic)."""
        self._unsupported("fetch_add")

    async def compare_swap(self, target: Any, *, expected: int, new: int) -> NoReturn:
        """Raises :class:`~aiordma.UnsupportedOperationError` (an RDMA atomic)."""
        self._unsupported("compare_swap")

    async def expose(self, local: Any, **access: Any) -> NoReturn:
        """Raises :class:`~aiordma.UnsupportedOperationError` (a memory window for RDMA)."""
        self._unsupported("expose")
