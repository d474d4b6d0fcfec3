"""Sans-I/O wire protocols of aiordma.

Bytes (or memoryviews) go in, typed events come out, and outgoing bytes are drained; nothing
here imports asyncio, sockets or pyverbs (a unit test proves it), so every protocol is tested
with hypothesis on any machine and can be reused over another transport.
"""
