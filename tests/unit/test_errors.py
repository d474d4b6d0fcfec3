"""Work-completion statuses map to typed errors through one table. No device."""

import pytest

import aiordma
import aiordma.rpc
from aiordma import (
    BrokenResourceError,
    CompletionError,
    LocalAccessError,
    PeerUnreachableError,
    RemoteAccessError,
)
from aiordma._errors import error_from_status


@pytest.mark.parametrize(("status", "cls", "name"), [
    (10, RemoteAccessError, "IBV_WC_REM_ACCESS_ERR"),
    (9, RemoteAccessError, "IBV_WC_REM_INV_REQ_ERR"),
    (12, PeerUnreachableError, "IBV_WC_RETRY_EXC_ERR"),
    (13, PeerUnreachableError, "IBV_WC_RNR_RETRY_EXC_ERR"),
    (4, LocalAccessError, "IBV_WC_LOC_PROT_ERR"),
    (1, LocalAccessError, "IBV_WC_LOC_LEN_ERR"),
    (5, CompletionError, "IBV_WC_WR_FLUSH_ERR"),
])
def test_status_maps_to_its_class(status: int, cls: type, name: str) -> None:
    exc = error_from_status(status, opcode=1, vendor_err=7, what="rdma write")
    assert type(exc) is cls
    assert isinstance(exc, BrokenResourceError)
    assert exc.status == status and exc.status_name == name and exc.vendor_err == 7
    assert str(exc).startswith("rdma write: " + name)


def test_unknown_status_is_still_a_completion_error() -> None:
    exc = error_from_status(250)
    assert type(exc) is CompletionError and exc.status == 250 and "250" in str(exc)


def test_protocol_errors_become_aiordma_errors_in_one_place() -> None:
    from aiordma import AuthenticationError, LocalProtocolError, RemoteProtocolError
    from aiordma._errors import from_protocol_error
    from aiordma.protocols import errors as wire

    for exc, cls in ((wire.AuthenticationError("no secret"), AuthenticationError),
                     (wire.LocalProtocolError("bug"), LocalProtocolError),
                     (wire.RemoteProtocolError("garbage"), RemoteProtocolError),
                     (wire.ProtocolError("other"), RemoteProtocolError)):
        err = from_protocol_error(exc, "rpc")
        assert type(err) is cls and err.__cause__ is exc and str(err) == f"rpc: {exc}"
        assert str(from_protocol_error(exc)) == str(exc)
    assert from_protocol_error(wire.AuthenticationError("why")).reason == "why"  # type: ignore[attr-defined]


@pytest.mark.parametrize("exc", [
    aiordma.PeerUnreachableError(12, what="message transfer"),
    aiordma.RemoteAccessError(10, opcode=2, vendor_err=7, what="rdma write"),
    aiordma.BrokenResourceError("the peer disconnected"),
    aiordma.rpc.RemoteError("ValueError", "boom"),
], ids=lambda e: type(e).__name__)
def test_again_gives_a_fresh_exception_of_the_same_kind(exc: Exception) -> None:
    """Each waiter of a failed endpoint gets its own exception object, the same as the first in
    type, message and attributes (it used to call __init__ with the message as the status: a
    PeerUnreachableError said 'status message transfer: ... (unknown status)')."""
    from aiordma._errors import again

    new = again(exc)  # type: ignore[arg-type]
    assert new is not exc and type(new) is type(exc)
    assert str(new) == str(exc) and new.args == exc.args and new.__cause__ is exc
    assert vars(new) == vars(exc)
