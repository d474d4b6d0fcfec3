"""The RPC protocol's frame layout (wire version 5): a fixed binary header, then a msgpack body.

Sans-I/O. :mod:`aiordma.protocols.rpc` owns what the fields mean and checks them; this module
holds the layout, the flags, and :func:`frame`, which packs one frame as it travels (the
protocol's own sender and tests that craft frames use it).

Header, 32 bytes, little-endian::

    offset  size  field
    0       1     version   (5)
    1       1     kind      (1 Request, 2 Response, 3 Error, 4 Cancel; streams: 5 Data,
                            6 Credit, 7 End)
    2       2     flags     (F_*, below)
    4       4     nbufs     out-of-band buffer messages that follow the frame's message
    8       4     method    Request: the method's index in the connection's method table;
                            Credit: the count of items granted (1..2**32-1); else 0
    12      4     body      the body's length in bytes (the msgpack value after the header)
    16      8     id        the call's id
    24      8     deadline  Request with F_DEADLINE: the caller's timeout in ms; else 0

A message carries one frame or several back to back (a *batch*); each frame's body length
says where the next one starts.

Version 4 added the stream kinds and ``F_STREAM`` and changed nothing else: a version-3 frame
differs only in its first byte (and is refused by it). Version 5 added ``F_META`` (metadata
beside a Request's, a Response's or an Error's body) and changed nothing else either.
"""

from __future__ import annotations

import struct

__all__ = ["F_DEADLINE", "F_KWARGS", "F_META", "F_NAMED", "F_STREAM", "F_WALK", "HEADER",
           "HEADER_SIZE", "KIND_FLAGS", "MAX_METHODS", "VERSION", "frame", "peer_version"]

VERSION = 5
HEADER = struct.Struct("<BBHIIIQQ")
HEADER_SIZE = HEADER.size  # 32

F_DEADLINE = 0x1
"""Request: the deadline field holds the caller's timeout (without it the field is 0: none)."""
F_NAMED = 0x2
"""Request: the body is ``[method name, args, kwargs]`` and binds the name to the method index,
which must be the next free one (0, 1, 2, ... in the order names are first used)."""
F_KWARGS = 0x4
"""Request (not named): the body is ``[args, kwargs]``; without it the body is ``args``."""
F_WALK = 0x8
"""Request, Response, Data: the values hold containers or extension values (out-of-band buffers,
arrays), so the receiver walks them (depth, map keys, placeholders). Without it every value
(each argument, each keyword value, the result) must be a plain scalar: nil, bool, int, float,
str or bin."""

F_STREAM = 0x10
"""Request: a stream call. Data, Credit and End frames may follow for its id, in both
directions, until its answer (see :mod:`aiordma.protocols.rpc._stream`)."""

F_META = 0x20
"""Request, Response, Error: the body is ``[metadata, body]``, the call's metadata (a msgpack map
of 1..64 entries; keys and values: :mod:`aiordma.protocols.rpc._meta`) and the body the kind
has without the flag."""

KIND_FLAGS = {1: F_DEADLINE | F_NAMED | F_KWARGS | F_WALK | F_STREAM | F_META,
              2: F_WALK | F_META, 3: F_META, 4: 0, 5: F_WALK, 6: 0, 7: 0}
"""The flags each kind may carry."""

MAX_METHODS = 4096
"""The most method names one connection binds (a client that calls more distinct names on one
connection gets LocalProtocolError; a peer that binds more is refused)."""


def frame(kind: int, call_id: int, body: bytes = b"", *, flags: int = 0, nbufs: int = 0,
          method: int = 0, deadline: int = 0, version: int = VERSION) -> bytes:
    """One frame: the header with these fields, then ``body`` (packed msgpack bytes)."""
    return HEADER.pack(version, kind, flags, nbufs, method, len(body), call_id, deadline) + body


def peer_version(first: bytes) -> str:
    """The version a message that is not a version-5 frame speaks, from its first bytes, for the
    error message. Versions 1 and 2 framed each call as a msgpack array whose first item was the
    version (a batch: an array of such arrays)."""
    if not first:
        return "(none: an empty message)"
    b0 = first[0]
    if 0x91 <= b0 <= 0x9F and len(first) > 1:  # a msgpack fixarray: versions 1 and 2
        b1 = first[1]
        if b1 < 0x80:
            return str(b1)
        if 0x91 <= b1 <= 0x9F and len(first) > 2 and first[2] < 0x80:  # a batch
            return str(first[2])
    return str(b0)
