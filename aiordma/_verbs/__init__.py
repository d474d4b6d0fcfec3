"""The verbs layer: native code behind one door.

Every ``import pyverbs`` of the library is in this package, and so is the one choice between
aiordma's compiled fast path (``_fastpath.pyx``, Cython against pyverbs' declarations) and
pyverbs' own objects. The rest of the library drives completion queues, queue pairs and memory
registrations through the interfaces here and never branches on which one runs.

- :mod:`.load`: finding pyverbs and the private rdma-core prefix that set-up built.
- :mod:`.compiled`: which compiled parts load (``AIORDMA_FASTPATH=0`` switches them off).
"""
