"""Memory registrations (``ibv_reg_mr``) and type-2 memory windows, through pyverbs."""

from __future__ import annotations

import errno
from typing import Any

from aiordma._errors import DeviceError
from aiordma._verbs.enums import value

__all__ = ["access_flags", "allocate_window", "bind_request", "close", "register",
           "supports_memory_windows"]


def access_flags(*, local_write: bool = False, remote_read: bool = False,
                 remote_write: bool = False, atomic: bool = False, mw_bind: bool = False) -> int:
    """The ``IBV_ACCESS_*`` flags granting exactly what is asked."""
    access = 0
    for name, on in (("LOCAL_WRITE", local_write), ("REMOTE_READ", remote_read),
                     ("REMOTE_WRITE", remote_write), ("REMOTE_ATOMIC", atomic),
                     ("MW_BIND", mw_bind)):
        if on:
            access |= value(f"ACCESS_{name}")
    return access


def register(pd: Any, address: int, size: int, access: int, *, device_name: str) -> Any:
    """Register ``size`` bytes at ``address`` with ``access``; pyverbs' ``MR``.

    Raises:
        DeviceError: the device refused the registration (``errno`` set).
    """
    from pyverbs.mr import MR
    from pyverbs.pyverbs_error import PyverbsError

    try:
        return MR(pd, size, access, address=address)
    except PyverbsError as exc:
        raise DeviceError(f"cannot register {size} bytes on {device_name}: {exc}",
                          errno=getattr(exc, "error_code", None)) from exc


def close(obj: Any, what: str) -> None:
    """``obj.close()`` (an MR or a window); a failure as :class:`DeviceError` ("cannot
    <what>")."""
    from pyverbs.pyverbs_error import PyverbsError

    try:
        obj.close()
    except PyverbsError as exc:
        raise DeviceError(f"cannot {what}: {exc}", errno=getattr(exc, "error_code", None)) from exc


def supports_memory_windows(attr: Any) -> bool:
    """Whether a device with attributes ``attr`` reports type-2 memory windows (``max_mw`` > 0
    and ``IBV_DEVICE_MEM_WINDOW_TYPE_2A`` or ``_2B`` in ``device_cap_flags``)."""
    caps = int(getattr(attr, "device_cap_flags", 0))
    type2 = value("DEVICE_MEM_WINDOW_TYPE_2A") | value("DEVICE_MEM_WINDOW_TYPE_2B")
    return int(getattr(attr, "max_mw", 0)) > 0 and bool(caps & type2)


def allocate_window(pd: Any, *, device_name: str) -> Any | None:
    """A type-2 memory window in ``pd``; None if the device does not do them (EOPNOTSUPP).

    Raises:
        DeviceError: the allocation failed otherwise.
    """
    from pyverbs.mr import MW
    from pyverbs.pyverbs_error import PyverbsError

    try:
        return MW(pd, value("MW_TYPE_2"))
    except PyverbsError as exc:
        if getattr(exc, "error_code", None) == errno.EOPNOTSUPP:
            return None
        raise DeviceError(f"cannot allocate a memory window on {device_name}: {exc}",
                          errno=getattr(exc, "error_code", None)) from exc


def bind_request(mw: Any, mr: Any, address: int, length: int, access: int) -> tuple[Any, int]:
    """A signaled bind work request (``IBV_WR_BIND_MW``) of ``mw`` to ``length`` bytes at
    ``address`` of ``mr`` with ``access``, and the rkey the bind gives the window. Post it with
    :meth:`~aiordma._verbs.qp.RCQueuePair.post_request` once its ``wr_id`` is set."""
    from pyverbs.mr import MWBindInfo
    from pyverbs.wr import SendWR

    info = MWBindInfo(mr, address, length, access)
    wr = SendWR(opcode=value("WR_BIND_MW"), send_flags=value("SEND_SIGNALED"))
    wr.set_bind_wr(mw, info)
    return wr, int(wr.rkey)
