"""Both builds of the RPC protocol's connection for a test module (no device).

``from .rpc_builds import rpc_build`` in a module of the RPC protocol's tests runs each of its
tests twice: with :class:`aiordma.protocols.rpc.RpcConnection`, the Python reference, and
with the class whose common frames are compiled (``protocols/rpc/_plain_c.pyx``, what RPC
clients and servers use where it is built), put in place of the module's ``RpcConnection``
(and of the helpers' in ``test_protocol_rpc``), and the compiled :class:`Outbox` in place of
the module's ``Outbox``. The compiled build must behave as the
reference does in every test written for the reference; where it is not built the
``compiled`` runs fail, as ``test_protocol_compiled`` does for the message protocol.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

import aiordma._verbs.compiled as _fast
from aiordma.protocols import rpc

HELPERS = f"{__package__}.test_protocol_rpc"  # (conn() and the shared helpers live there)


@pytest.fixture(scope="module", autouse=True, params=["python", "compiled"])
def rpc_build(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "python":
        yield request.param
        return
    cls = _fast._load_rpc()
    if cls is None:
        pytest.fail(f"the RPC protocol's compiled frames are missing: {_fast.describe()} "
                    f"(scripts/setup.sh builds them)")
    patch = pytest.MonkeyPatch()
    for module in {request.module, sys.modules.get(HELPERS)}:
        if module is not None and getattr(module, "RpcConnection", None) is rpc.RpcConnection:
            patch.setattr(module, "RpcConnection", cls)
        if module is not None and getattr(module, "Outbox", None) is rpc.Outbox:
            patch.setattr(module, "Outbox", _fast._rpc_outbox)
    try:
        yield request.param
    finally:
        patch.undo()


@pytest.fixture(scope="module", autouse=True, params=["python", "compiled"])
def rpc_layer_build(request: pytest.FixtureRequest) -> Iterator[str]:
    """For a module of the RPC layer's tests (``RpcClient`` and ``RpcServer`` over the
    in-memory, TCP or plain channels): each test twice, the clients and servers it makes
    running the Python connection and outbox, then the compiled ones (what they run by default
    where they are built), so that the Python path stays tested by the default run too."""
    cls = rpc.RpcConnection if request.param == "python" else _fast._load_rpc()
    if cls is None:
        pytest.fail(f"the RPC protocol's compiled frames are missing: {_fast.describe()} "
                    f"(scripts/setup.sh builds them)")
    import aiordma.rpc._client as client
    import aiordma.rpc._sender as sender
    import aiordma.rpc._server as server

    outbox = rpc.Outbox if request.param == "python" else _fast._rpc_outbox
    patch = pytest.MonkeyPatch()
    for module in (client, server):
        patch.setattr(module, "rpc_connection", lambda: cls)
    patch.setattr(sender, "rpc_outbox", lambda: outbox)
    try:
        yield request.param
    finally:
        patch.undo()
