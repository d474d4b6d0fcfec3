"""The key-value service: put/get/delete by RPC, and GETs by one-sided RDMA READ.

    from aiordma.rpc import serve
    from aiordma.services import kv

    async with await serve(kv.KvStore(), "0.0.0.0", 7100) as server:     # the server
        ...
    async with await kv.connect(host, 7100) as store:                     # a client
        await store.put(b"k", b"v")
        assert await store.get(b"k") == b"v"        # one RDMA READ, validated; RPC if torn
        assert await store.get(b"k", one_sided=False) == b"v"              # by RPC
        assert await store.delete(b"k")

The server mirrors its dictionary into a table of fixed-size slots, exposed read-only to each
client; the layout, the seqlock-and-checksum validation and the placement rules are in
:mod:`aiordma.protocols.kv`. From the command line: ``aiordma serve kv``, ``aiordma kv get|put|delete``.
"""

from ._client import KvClient, connect
from ._store import KvStore

__all__ = ["KvClient", "KvStore", "connect"]
