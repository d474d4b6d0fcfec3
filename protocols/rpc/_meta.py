"""Call metadata on the RPC wire: everything about the key/value pairs that a Request, a
Response or an Error may carry lives here (sans-I/O).

A frame flagged ``F_META`` (wire version 5) has the body ``[metadata, body]``: a msgpack array
of two, the *metadata* (a map) and the body the frame's kind has without the flag. The map has
1 to :data:`MAX_ENTRIES` entries; each key is a str of 1 to :data:`MAX_KEY` characters from
``0-9 a-z _ . -`` (gRPC's metadata keys: lower case, so that keys map one to one onto HTTP/2
headers when bridged), each value a ``str`` or ``bytes`` of at most :data:`MAX_VALUE`
characters or bytes; the keys and values of one frame are at most :data:`MAX_SIZE` long
together. No metadata (or an empty mapping, which travels as none) means no flag and no
array: a frame without metadata is exactly what it was in version 4.

Sending anything outside these rules is a :class:`LocalProtocolError` (nothing is sent);
receiving it is a :class:`RemoteProtocolError`, as any malformed frame is. Both sides apply
the same rules to the same values, so what one side sends the other accepts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..errors import LocalProtocolError, RemoteProtocolError
from ._codec import short

__all__ = ["MAX_ENTRIES", "MAX_KEY", "MAX_SIZE", "MAX_VALUE", "Metadata", "check", "problem",
           "take"]

MAX_ENTRIES = 64
"""The most entries in one frame's metadata."""
MAX_KEY = 128
"""The longest key, in characters (ASCII: bytes too)."""
MAX_VALUE = 4096
"""The longest value: characters of a ``str``, bytes of a ``bytes``."""
MAX_SIZE = 16384
"""The most characters (``str``) and bytes (``bytes``) of one frame's keys and values
together."""

Metadata = dict[str, str | bytes]
"""What metadata is once checked or received: keys to ``str`` or ``bytes`` values."""

_KEY = re.compile(r"[0-9a-z_.\-]+\Z")
_known_keys: set[str] = set()  # keys that passed the pattern (the common ones: a few)
_KNOWN_MOST = 1024  # (a bound: a peer's new keys are checked again, not remembered)


def problem(metadata: dict[Any, Any]) -> str | None:
    """What is wrong with the entries of ``metadata`` (a dict), or None: the rules above,
    but for the mapping's type and its emptiness. (The common case, a few known keys with
    short ASCII or bytes values, is checked in a few steps per entry; :func:`_explain` words
    what is wrong.)"""
    n = len(metadata)
    if n > MAX_ENTRIES:
        return f"{n} metadata entries (at most {MAX_ENTRIES})"
    known = _known_keys
    for key, value in metadata.items():
        if key not in known and not _new_key(key):
            return _explain(metadata)
        t = type(value)
        if t is str:
            if len(value) > MAX_VALUE or not (value.isascii() or _utf8(value)):
                return _explain(metadata)
        elif t is not bytes or len(value) > MAX_VALUE:
            return _explain(metadata)
    # (3 entries or fewer never are too large: 3 x (128 + 4096) < 16384)
    if n > 3 and sum(len(k) + len(v) for k, v in metadata.items()) > MAX_SIZE:
        return _explain(metadata)
    return None


def _new_key(key: Any) -> bool:
    """Whether ``key`` (not known yet) is a valid key; if so, it is known from now on."""
    if type(key) is not str or not 1 <= len(key) <= MAX_KEY or not _KEY.match(key):
        return False
    if len(_known_keys) < _KNOWN_MOST:
        _known_keys.add(key)
    return True


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # e.g. a lone surrogate: msgpack cannot pack it
        return False
    return True


def _explain(metadata: dict[Any, Any]) -> str:
    """The first rule ``metadata``'s entries break, in words."""
    size = 0
    for key, value in metadata.items():
        if not _new_key(key):
            return (f"metadata key {short(key)} is not 1..{MAX_KEY} characters of 0-9, "
                    f"a-z, '_', '.' and '-'")
        t = type(value)
        if t is not str and t is not bytes:
            return f"metadata value of {key!r} is a {t.__name__}, not a str or bytes"
        if len(value) > MAX_VALUE:
            return f"metadata value of {key!r} is {len(value)} long (at most {MAX_VALUE})"
        if t is str and not _utf8(value):
            return f"metadata value of {key!r} is not valid text (UTF-8)"
        size += len(key) + len(value)
    return f"metadata of {size} characters and bytes (at most {MAX_SIZE})"


def check(metadata: Any) -> Metadata:
    """``metadata`` checked (see the rules above), as a dict: the same dict if it is one, a new
    one for another mapping. An empty one is returned empty (it travels as none).

    Raises:
        LocalProtocolError: ``metadata`` is not a mapping, or breaks a rule.
    """
    if type(metadata) is not dict:
        if not isinstance(metadata, Mapping):
            raise LocalProtocolError(f"metadata is a mapping of str to str or bytes, not "
                                     f"{type(metadata).__name__}")
        metadata = dict(metadata)
    wrong = problem(metadata)
    if wrong is not None:
        raise LocalProtocolError(wrong)
    return metadata


def take(value: Any) -> Metadata:
    """Received metadata (the first item of an ``F_META`` frame's body), checked.

    Raises:
        RemoteProtocolError: not a map of 1..:data:`MAX_ENTRIES` entries that follow the
            rules.
    """
    if type(value) is not dict or not value:
        raise RemoteProtocolError(f"metadata is a map of 1..{MAX_ENTRIES} entries, not "
                                  f"{'an empty map' if value == {} else short(value)}")
    wrong = problem(value)
    if wrong is not None:
        raise RemoteProtocolError(wrong)
    return value
