"""Protocol errors, shared by every sans-I/O protocol here.

They mirror :mod:`aiordma`'s exceptions without importing aiordma (protocols/ stands alone):
aiordma re-raises them as :class:`aiordma.LocalProtocolError` /
:class:`aiordma.RemoteProtocolError` / :class:`aiordma.AuthenticationError`.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base class: a protocol rule was broken."""


class LocalProtocolError(ProtocolError):
    """This side tried to send something the protocol does not allow now (a caller bug)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes the protocol does not allow; the connection must be closed."""


class AuthenticationError(RemoteProtocolError):
    """The shared-secret check of a connection set-up failed.

    The peer's proof does not match (it holds another secret, or none), or one side requires a
    shared secret and the other does not use one. The connection has already moved to the
    state in which this side may only refuse it (send ``Reject``); nothing else is allowed.
    A :class:`RemoteProtocolError`, since what the peer sent is at fault; catch it first to
    tell the two apart.
    aiordma re-raises it as :class:`aiordma.AuthenticationError`.
    """
