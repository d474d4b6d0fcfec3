"""Protocol errors, shared by every sans-I/O protocol here.

They mirror :mod:`aiordma`'s exceptions without importing aiordma (protocols/ stands alone):
aiordma re-raises them as :class:`aiordma.LocalProtocolError` /
:class:`aiordma.RemoteProtocolError`.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base class: a protocol rule was broken."""


class LocalProtocolError(ProtocolError):
    """This side tried to send something the protocol does not allow now (a caller bug)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes the protocol does not allow; the connection must be closed."""
