"""Call metadata on the RPC wire: everything about the key/value pairs that a Request, a
Response or an Error may carry lives here (sans-I/O).

A frame flagged ``F_META`` (wire version 5) has its *metadata* in front of its body: one
msgpack map, then the body the frame's kind has without the flag. The map has 1 to
:data:`MAX_ENTRIES` entries; each key is a str of 1 to :data:`MAX_KEY` characters from
``0-9 a-z _ . -`` (gRPC's metadata keys: lower case, so that keys map one to one onto HTTP/2
headers when bridged), each value a ``str`` or ``bytes`` of at most :data:`MAX_VALUE`
characters or bytes; the packed map is at most :data:`MAX_SIZE` bytes. No metadata (or an
empty mapping, which travels as none) means no flag and no map: a frame without metadata is
exactly what it was in version 4.

Sending anything outside these rules is a :class:`LocalProtocolError` (nothing is sent);
receiving it is a :class:`RemoteProtocolError`, as any malformed frame is. Both sides check
the same sizes on the same bytes (the sender measures the map it packs, the receiver the map
it reads), so what one side sends the other accepts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgpack

from ._rpc_codec import short
from .errors import LocalProtocolError, RemoteProtocolError

__all__ = ["MAX_ENTRIES", "MAX_KEY", "MAX_SIZE", "MAX_VALUE", "Metadata", "check", "pack",
           "unpack"]

MAX_ENTRIES = 64
"""The most entries in one frame's metadata."""
MAX_KEY = 128
"""The longest key, in characters (ASCII: bytes too)."""
MAX_VALUE = 4096
"""The longest value: characters of a ``str``, bytes of a ``bytes``."""
MAX_SIZE = 16384
"""The largest packed metadata map of one frame, in bytes."""

Metadata = dict[str, str | bytes]
"""What metadata is once checked or received: keys to ``str`` or ``bytes`` values."""

_KEY = re.compile(r"[0-9a-z_.\-]+\Z")


def _problem(key: Any, value: Any) -> str | None:
    """What is wrong with one entry, or None."""
    if type(key) is not str or not 1 <= len(key) <= MAX_KEY or not _KEY.match(key):
        return (f"metadata key {short(key)} is not 1..{MAX_KEY} characters of 0-9, a-z, "
                f"'_', '.' and '-'")
    if type(value) is not str and type(value) is not bytes:
        return f"metadata value of {key!r} is a {type(value).__name__}, not a str or bytes"
    if len(value) > MAX_VALUE:
        return f"metadata value of {key!r} is {len(value)} long (at most {MAX_VALUE})"
    if type(value) is str and not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:  # e.g. a lone surrogate: msgpack could not pack it
            return f"metadata value of {key!r} is not valid text (UTF-8)"
    return None


def check(metadata: Any) -> Metadata:
    """``metadata`` as a new dict, checked: a mapping of at most :data:`MAX_ENTRIES` entries
    whose keys and values follow the rules above (an empty one is returned empty).

    Raises:
        LocalProtocolError: ``metadata`` is not a mapping, or an entry breaks a rule.
    """
    if not isinstance(metadata, Mapping):
        raise LocalProtocolError(f"metadata is a mapping of str to str or bytes, not "
                                 f"{type(metadata).__name__}")
    if len(metadata) > MAX_ENTRIES:
        raise LocalProtocolError(f"{len(metadata)} metadata entries (at most {MAX_ENTRIES})")
    out: Metadata = dict(metadata)
    for key, value in out.items():
        problem = _problem(key, value)
        if problem is not None:
            raise LocalProtocolError(problem)
    return out


def pack(metadata: Any, packer: Any) -> bytes:
    """The metadata map as it travels in front of a body, checked (see :func:`check`); empty
    for an empty mapping (which travels as none).

    Raises:
        LocalProtocolError: it breaks a rule, or packs to more than :data:`MAX_SIZE` bytes.
    """
    checked = check(metadata)
    if not checked:
        return b""
    try:
        data: bytes = packer.pack(checked)
    except Exception as exc:  # e.g. a lone surrogate in a str
        raise LocalProtocolError(f"metadata cannot be packed: {exc}") from exc
    if len(data) > MAX_SIZE:
        raise LocalProtocolError(f"metadata packs to {len(data)} B (at most {MAX_SIZE} B)")
    return data


def unpack(body: memoryview) -> tuple[Metadata, int]:
    """The metadata in front of ``body`` (a frame flagged ``F_META``), and where the rest of
    the body starts. Reads at most :data:`MAX_SIZE` bytes (nothing larger is allocated).

    Raises:
        RemoteProtocolError: no map of 1..:data:`MAX_ENTRIES` entries within :data:`MAX_SIZE`
            bytes, or an entry that breaks a rule.
    """
    head = body[:MAX_SIZE]
    reader = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=MAX_SIZE,
                              max_str_len=MAX_SIZE, max_bin_len=MAX_SIZE, max_array_len=0,
                              max_map_len=MAX_ENTRIES, max_ext_len=0)
    try:
        reader.feed(head)
        metadata = reader.unpack()
    except msgpack.OutOfData:
        raise RemoteProtocolError(f"metadata that is not whole within {min(MAX_SIZE, len(head))}"
                                  f" B of the body (at most {MAX_SIZE} B)") from None
    except Exception as exc:  # msgpack raises several types for malformed input
        raise RemoteProtocolError(f"malformed metadata: {exc}") from exc
    if type(metadata) is not dict or not metadata:
        raise RemoteProtocolError(f"metadata is a map of 1..{MAX_ENTRIES} entries, not "
                                  f"{short(metadata) if metadata != {} else 'an empty map'}")
    for key, value in metadata.items():
        problem = _problem(key, value)
        if problem is not None:
            raise RemoteProtocolError(problem)
    return metadata, reader.tell()
