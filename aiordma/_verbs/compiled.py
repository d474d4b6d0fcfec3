"""Which per-operation path runs: the compiled fast path or pure Python.

Three compiled parts, all built by ``scripts/setup.sh`` (``scripts/build_fastpath.py``):

- the verbs module (``aiordma/_verbs/_fastpath.pyx``) does the verbs calls of each operation without
  pyverbs' Python objects; see its docstring. Where it is not built (an interpreter's own
  pyverbs has no ``.pxd`` files to compile against), the same code runs through pyverbs'
  ``CQ.poll`` and ``QP.post_send``;
- the message protocol (``protocols/messages/_credits.py`` and ``_protocol.py``) compiled by
  Cython from the same source, with the C types of ``protocols/messages/_credits_c.pxd`` and
  ``_protocol_c.pxd``: :func:`message_protocol` gives endpoints its class. A build of other
  sources (the Python files changed since) is not loaded;
- the RPC protocol's common frames (``protocols/rpc/_plain_c.pyx``: the reference connection
  with its receive and its plain request and response compiled, and the outbox that batches
  a tick's frames): :func:`rpc_connection` gives RPC clients and servers its connection class,
  :func:`rpc_outbox` their senders its outbox. A build of another ``.pyx`` is not loaded.

``AIORDMA_FASTPATH=0`` switches them all off. The choice is made when a reactor, a queue pair or
an endpoint is created, so a test can run both paths in one process.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import ModuleType

from aiordma.protocols import messages, rpc

__all__ = ["describe", "fastpath", "message_protocol", "protocol_source_digest",
           "rpc_connection", "rpc_outbox", "rpc_source_digest"]

PROTOCOL_SOURCES = ("_credits.py", "_protocol.py")
"""The sources of the compiled message protocol (in ``protocols/messages/``), in the order of
:func:`protocol_source_digest`."""

_module: ModuleType | None = None
_why_not: str | None = None  # why the compiled module is not importable (None: not tried yet)


def _load() -> ModuleType | None:
    global _module, _why_not
    if _module is None and _why_not is None:
        from aiordma._verbs.load import require_pyverbs

        require_pyverbs()  # the compiled module binds to the pyverbs loaded here
        try:
            from aiordma._verbs import _fastpath  # type: ignore[attr-defined]
        except ImportError as exc:
            _why_not = f"not built ({exc}); scripts/setup.sh builds it"
        except (ValueError, RuntimeError) as exc:  # pyverbs' layout differs from its build
            _why_not = f"built for another pyverbs ({exc}); run scripts/setup.sh"
        else:
            _module = _fastpath
    return _module


def protocol_source_digest() -> str:
    """The digest of the Python sources of the message protocol (a compiled build records the
    one it was made from)."""
    here = Path(messages.__file__).parent
    h = hashlib.sha256()
    for source in PROTOCOL_SOURCES:
        h.update(hashlib.sha256((here / source).read_bytes()).digest())
    return h.hexdigest()[:16]


_protocol: type[messages.MessageProtocol] | None = None
_protocol_why_not: str | None = None


def _load_protocol() -> type[messages.MessageProtocol] | None:
    global _protocol, _protocol_why_not
    if _protocol is None and _protocol_why_not is None:
        try:
            from aiordma.protocols.messages import _protocol_c  # type: ignore[attr-defined]
        except ImportError as exc:
            _protocol_why_not = f"not built ({exc}); scripts/setup.sh builds it"
        else:
            if _protocol_c.SOURCE_DIGEST != protocol_source_digest():
                _protocol_why_not = ("built from other sources than protocols/messages/"
                                     "_credits.py and _protocol.py; run scripts/setup.sh")
            else:
                _protocol = _protocol_c.MessageProtocol
    return _protocol


def message_protocol() -> type[messages.MessageProtocol]:
    """The :class:`~aiordma.protocols.messages.MessageProtocol` class new endpoints use: the
    compiled build where it is built and current, else the Python one."""
    if _switched_off():
        return messages.MessageProtocol
    return _load_protocol() or messages.MessageProtocol


def rpc_source_digest() -> str:
    """The digest of ``protocols/rpc/_plain_c.pyx`` (a build records the one it was made
    from)."""
    source = Path(rpc.__file__).parent / "_plain_c.pyx"
    return hashlib.sha256(source.read_bytes()).hexdigest()[:16]


_rpc: type[rpc.RpcConnection] | None = None
_rpc_outbox: type[rpc.Outbox] | None = None
_rpc_why_not: str | None = None


def _load_rpc() -> type[rpc.RpcConnection] | None:
    global _rpc, _rpc_outbox, _rpc_why_not
    if _rpc is None and _rpc_why_not is None:
        try:
            from aiordma.protocols.rpc import _plain_c  # type: ignore[attr-defined]
        except ImportError as exc:
            _rpc_why_not = f"not built ({exc}); scripts/setup.sh builds it"
        else:
            try:
                current = rpc_source_digest()
            except OSError:  # (an install without the .pyx: nothing to check the build by)
                current = None
            if _plain_c.SOURCE_DIGEST != current:
                _rpc_why_not = ("built from another protocols/rpc/_plain_c.pyx; run "
                                "scripts/setup.sh")
            else:
                _rpc, _rpc_outbox = _plain_c.RpcConnection, _plain_c.Outbox
    return _rpc


def rpc_connection() -> type[rpc.RpcConnection]:
    """The :class:`~aiordma.protocols.rpc.RpcConnection` class new RPC clients and servers
    use: the one with its common frames compiled where it is built and current, else the
    Python one."""
    if _switched_off():
        return rpc.RpcConnection
    return _load_rpc() or rpc.RpcConnection


def rpc_outbox() -> type[rpc.Outbox]:
    """The :class:`~aiordma.protocols.rpc.Outbox` class RPC senders use: the compiled one
    (built beside the compiled connection, in the same module) where it is built and current,
    else the Python one."""
    if _switched_off() or _load_rpc() is None:
        return rpc.Outbox
    return _rpc_outbox  # type: ignore[return-value]


# The environment as os.environ keeps it encoded (a dict: one lookup, where os.environ.get
# is five Python calls, 2 % of a connection's set-up in the VM, read once per queue pair and
# once per endpoint); os.environ's changes (a test's monkeypatch) are in it at once.
_ENVIRON: dict[object, object] | None = getattr(os.environ, "_data", None)
_KEY, _OFF = os.environ.encodekey("AIORDMA_FASTPATH"), os.environ.encodevalue("0")


def _switched_off() -> bool:
    if _ENVIRON is not None:
        return _ENVIRON.get(_KEY) == _OFF
    return os.environ.get("AIORDMA_FASTPATH", "1") == "0"


def fastpath() -> ModuleType | None:
    """The compiled module, or ``None`` when the pure-Python path is to run."""
    if _switched_off():
        return None
    return _load()


def describe() -> str:
    """One line for ``aiordma devices`` and the bench: which path new endpoints use."""
    if _switched_off():
        return "python (AIORDMA_FASTPATH=0)"
    from aiordma._errors import DeviceError

    if _load_protocol() is not None:
        protocol = "message protocol compiled"
    else:
        protocol = f"message protocol python: its compiled build is {_protocol_why_not}"
    if _load_rpc() is not None:
        protocol += ", RPC frames compiled"
    else:
        protocol += f", RPC frames python: their compiled build is {_rpc_why_not}"
    try:
        mod = _load()
    except DeviceError as exc:  # no usable pyverbs at all
        return f"none: {exc}"
    if mod is None:
        return f"python: the compiled fast path is {_why_not}; {protocol}"
    return f"compiled ({os.path.basename(mod.__file__ or '_fastpath')}; {protocol})"
