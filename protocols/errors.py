"""Protocol errors, shared by every sans-I/O protocol here.

One family with :mod:`aiordma`'s exceptions: :class:`aiordma.LocalProtocolError`,
:class:`aiordma.RemoteProtocolError` and :class:`aiordma.AuthenticationError` derive from the
classes here (so ``except ProtocolError`` catches both), and aiordma turns one of these into its
own in one place (``aiordma._errors.from_protocol_error``). This module imports nothing of
aiordma: the protocols stand alone.

The rule for arguments, here and in all of aiordma: a caller's bad argument (a value or a type
the call cannot take) raises :class:`LocalProtocolError`, which is also a :class:`ValueError`.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base class: a protocol rule was broken."""


class LocalProtocolError(ProtocolError, ValueError):
    """This side tried to do something the protocol does not allow now, or passed an argument
    it cannot take (a caller bug). Also a :class:`ValueError`."""


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
