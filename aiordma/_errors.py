"""aiordma's exception family.

Every error aiordma raises on purpose derives from :class:`AiordmaError`. The split follows who
is at fault, as trio and h11 do:

* :class:`ClosedResourceError`: *your* code closed the resource (endpoint, reactor, device) that
  the operation needed.
* :class:`BrokenResourceError`: the peer or the network broke it. Work-completion failures are
  :class:`CompletionError` subclasses of it, carrying the verbs status. A connection refused
  during set-up is a :class:`ConnectionRejectedError` (a limit, no resources) or an
  :class:`AuthenticationError` (the shared-secret check).
* :class:`BusyResourceError`: the resource is already in use in a way that allows one user.
* :class:`OperationTimeout`: a bound expired (also a builtin :class:`TimeoutError`).
* :class:`LocalProtocolError` / :class:`RemoteProtocolError`: a wire-protocol rule was broken by
  us (a bug or misuse) or by the peer (garbage bytes). A bad argument to any call is a
  :class:`LocalProtocolError` (also a :class:`ValueError`): the one rule for arguments.

The protocol errors are one family with :mod:`aiordma.protocols.errors`: each of aiordma's
derives from the matching one there (``except aiordma.protocols.errors.ProtocolError`` catches
both), and :func:`from_protocol_error` is the one place a protocol's error becomes aiordma's.
* :class:`DeviceError`: no usable RDMA device, or a verbs call failed outside a work completion.
* :class:`UnsupportedOperationError`: the operation needs a transport the connection does not
  use (a one-sided RDMA operation on a connection over TCP).
"""

from __future__ import annotations

from aiordma.protocols import errors as _wire

__all__ = [
    "AiordmaError",
    "AuthenticationError",
    "BrokenResourceError",
    "BusyResourceError",
    "ClosedResourceError",
    "CompletionError",
    "ConnectionRejectedError",
    "DeviceError",
    "LocalAccessError",
    "LocalProtocolError",
    "OperationTimeout",
    "PeerUnreachableError",
    "RemoteAccessError",
    "RemoteProtocolError",
    "UnsupportedOperationError",
    "error_from_status",
    "from_protocol_error",
]


class AiordmaError(Exception):
    """Base class of every error aiordma raises on purpose."""


class ClosedResourceError(AiordmaError):
    """The resource was closed by this process (``aclose()``, ``abort()`` or ``close()``)."""


class BrokenResourceError(AiordmaError):
    """The resource was broken by the peer, the network or the device; it cannot be used again."""


class ConnectionRejectedError(BrokenResourceError):
    """The listener refused the connection during set-up; nothing was set up.

    The listener's connection limit was reached (per peer address, or in total), or it had no
    RDMA resources for another connection. Trying again later may succeed.

    Attributes:
        reason: why, in the listener's words.
        category: the ``aiordma.protocols.handshake.RejectCategory`` value the listener sent.
    """

    def __init__(self, message: str, *, reason: str = "", category: int = 0) -> None:
        super().__init__(message)
        self.reason = reason
        self.category = category


class AuthenticationError(BrokenResourceError, _wire.AuthenticationError):
    """Connection set-up failed the shared-secret check; no queue pair was connected.

    Raised by ``connect()`` when the listener refused this side's proof (another secret), when
    the listener's own proof does not match (it does not hold this secret, or its answer was
    altered on the way), or when only one side uses a shared secret. A listener drops such a
    connection, logs it, counts it in ``Listener.failed_setups`` and keeps serving others.

    Attributes:
        reason: what failed, in the words of the side that noticed it.
    """

    def __init__(self, message: str, *, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


class BusyResourceError(AiordmaError):
    """The resource allows a single user at a time and already has one."""


class OperationTimeout(AiordmaError, TimeoutError):
    """A bound on an operation expired before the peer answered."""


class LocalProtocolError(AiordmaError, _wire.LocalProtocolError):
    """This side tried to do something the protocol does not allow, or passed an argument the
    call cannot take (a caller bug): the one error for bad arguments, also a
    :class:`ValueError`."""


class RemoteProtocolError(AiordmaError, _wire.RemoteProtocolError):
    """The peer sent something the protocol does not allow; the connection is closed."""


class DeviceError(AiordmaError):
    """No usable RDMA device, or a verbs call failed outside a work completion.

    Attributes:
        errno: the ``errno`` value of the failed verbs call, when there is one.
    """

    def __init__(self, message: str, *, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


class UnsupportedOperationError(AiordmaError):
    """The operation needs a transport this connection does not use: one-sided RDMA (READ,
    WRITE, atomics, registering or exposing memory) on a connection whose messages travel
    over TCP (``transport="tcp"``, or ``"auto"`` where a side has no RDMA device). Nothing
    was done; the connection is unchanged. Move the data in messages, or connect with
    ``transport="rdma"``.

    Attributes:
        operation: what was asked, e.g. ``"write"``.
        transport: the connection's transport, e.g. ``"tcp"``.
    """

    def __init__(self, message: str, *, operation: str = "", transport: str = "") -> None:
        super().__init__(message)
        self.operation = operation
        self.transport = transport


class CompletionError(BrokenResourceError):
    """A work request completed with an error status; its queue pair is now in the error state.

    Attributes:
        status: the ``ibv_wc_status`` value.
        status_name: its name, e.g. ``"IBV_WC_REM_ACCESS_ERR"``.
        opcode: the ``ibv_wc_opcode`` of the completion (meaningful only for some statuses).
        vendor_err: the provider's vendor error code.
    """

    def __init__(self, status: int, *, opcode: int = 0, vendor_err: int = 0,
                 what: str = "") -> None:
        name = _STATUS_NAMES.get(status, f"status {status}")
        detail = f"{what}: " if what else ""
        super().__init__(f"{detail}{name} ({_STATUS_TEXT.get(status, 'unknown status')})")
        self.status = status
        self.status_name = name
        self.opcode = opcode
        self.vendor_err = vendor_err


class RemoteAccessError(CompletionError):
    """The peer refused an access: wrong rkey, out-of-bounds address or missing access flags."""


class LocalAccessError(CompletionError):
    """A local buffer or work request was refused by the device (length, protection, access)."""


class PeerUnreachableError(CompletionError):
    """The transport gave up retrying: the peer is dead or unreachable."""


# ibv_wc_status -> (name, description, exception class). The one place statuses are mapped.
_STATUS_TABLE: dict[int, tuple[str, str, type[CompletionError]]] = {
    1: ("IBV_WC_LOC_LEN_ERR", "local length error", LocalAccessError),
    2: ("IBV_WC_LOC_QP_OP_ERR", "local QP operation error", LocalAccessError),
    3: ("IBV_WC_LOC_EEC_OP_ERR", "local EE context operation error", LocalAccessError),
    4: ("IBV_WC_LOC_PROT_ERR", "local protection error", LocalAccessError),
    5: ("IBV_WC_WR_FLUSH_ERR", "flushed: the queue pair is in the error state", CompletionError),
    6: ("IBV_WC_MW_BIND_ERR", "memory window bind error", LocalAccessError),
    7: ("IBV_WC_BAD_RESP_ERR", "bad response", CompletionError),
    8: ("IBV_WC_LOC_ACCESS_ERR", "local access error", LocalAccessError),
    9: ("IBV_WC_REM_INV_REQ_ERR", "remote invalid request", RemoteAccessError),
    10: ("IBV_WC_REM_ACCESS_ERR", "remote access error", RemoteAccessError),
    11: ("IBV_WC_REM_OP_ERR", "remote operation error", RemoteAccessError),
    12: ("IBV_WC_RETRY_EXC_ERR", "transport retry counter exceeded", PeerUnreachableError),
    13: ("IBV_WC_RNR_RETRY_EXC_ERR", "receiver-not-ready retry counter exceeded",
         PeerUnreachableError),
    14: ("IBV_WC_LOC_RDD_VIOL_ERR", "local RDD violation", LocalAccessError),
    15: ("IBV_WC_REM_INV_RD_REQ_ERR", "remote invalid RD request", RemoteAccessError),
    16: ("IBV_WC_REM_ABORT_ERR", "remote aborted", CompletionError),
    17: ("IBV_WC_INV_EECN_ERR", "invalid EE context number", CompletionError),
    18: ("IBV_WC_INV_EEC_STATE_ERR", "invalid EE context state", CompletionError),
    19: ("IBV_WC_FATAL_ERR", "fatal error", CompletionError),
    20: ("IBV_WC_RESP_TIMEOUT_ERR", "response timeout", PeerUnreachableError),
    21: ("IBV_WC_GENERAL_ERR", "general error", CompletionError),
}
_STATUS_NAMES = {k: v[0] for k, v in _STATUS_TABLE.items()}
_STATUS_TEXT = {k: v[1] for k, v in _STATUS_TABLE.items()}

WC_SUCCESS = 0
WC_WR_FLUSH_ERR = 5


def error_from_status(status: int, *, opcode: int = 0, vendor_err: int = 0,
                      what: str = "") -> CompletionError:
    """Build the typed exception for a failed work completion (``status != IBV_WC_SUCCESS``)."""
    cls = _STATUS_TABLE.get(status, ("", "", CompletionError))[2]
    return cls(status, opcode=opcode, vendor_err=vendor_err, what=what)



def from_protocol_error(exc: _wire.ProtocolError, context: str = "") -> AiordmaError:
    """A ``aiordma.protocols.errors`` exception as aiordma's, with ``exc`` as its cause: a failed
    shared-secret check is :class:`AuthenticationError`, a rule this side broke (a bug or
    misuse) :class:`LocalProtocolError`, anything else the peer's :class:`RemoteProtocolError`.
    The one place where the two families meet. ``context`` prefixes the message."""
    text = f"{context}: {exc}" if context else str(exc)
    err: AiordmaError
    if isinstance(exc, _wire.AuthenticationError):
        err = AuthenticationError(text, reason=str(exc))
    elif isinstance(exc, _wire.LocalProtocolError):
        err = LocalProtocolError(text)
    else:
        err = RemoteProtocolError(text)
    err.__cause__ = exc
    return err


def again(exc: AiordmaError) -> AiordmaError:
    """A fresh exception like ``exc`` for one more waiter (one exception object per raise, so
    tracebacks do not pile up on a shared one): the same type, message and attributes (e.g. a
    :class:`CompletionError`'s ``status``), without calling ``__init__``, whose signature
    differs between subclasses; ``exc`` is its cause."""
    cls = type(exc)
    new = cls.__new__(cls, *exc.args)
    new.args = exc.args
    new.__dict__.update(exc.__dict__)
    new.__cause__ = exc
    return new
