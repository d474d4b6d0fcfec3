"""The RPC protocol's events: what :class:`~aiordma.protocols.rpc.RpcConnection` sends and
delivers, and the checks of their header fields. Sans-I/O; re-exported by
:mod:`aiordma.protocols.rpc`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from ._codec import short
from ._state import MAX_ID

__all__ = ["BY_KIND", "MAX_NAME", "STREAM_KINDS", "Cancel", "Credit", "Data", "End", "Error",
           "Request", "Response", "RpcEvent", "bad", "new_data", "new_request", "new_response",
           "ok_id", "ok_name"]

MAX_NAME = 256  # characters in a method name or an error's type name


# -- events -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RpcEvent:
    """Base class of RPC events. Every event names its call by ``id``."""

    kind: ClassVar[int] = 0
    id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Request(RpcEvent):
    """Client -> server: call ``method(*args, **kwargs)``, giving up after ``deadline_ms``.
    With ``stream``, a stream call: items may then flow both ways (:class:`Data`, under
    :class:`Credit`) until the call's answer. ``metadata``: the call's key/value pairs (see
    :mod:`aiordma.protocols.rpc._meta`), None for none."""

    kind: ClassVar[int] = 1
    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    deadline_ms: int | None = None
    stream: bool = False
    metadata: dict[str, str | bytes] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Response(RpcEvent):
    """Server -> client: the call returned ``result``; ``metadata``: the answer's key/value
    pairs, None for none."""

    kind: ClassVar[int] = 2
    result: Any
    metadata: dict[str, str | bytes] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Error(RpcEvent):
    """Server -> client: the call raised an exception of type name ``type`` with ``message``;
    ``metadata``: the answer's key/value pairs, None for none."""

    kind: ClassVar[int] = 3
    type: str
    message: str
    metadata: dict[str, str | bytes] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Cancel(RpcEvent):
    """Client -> server: the caller no longer wants the answer (the server still answers)."""

    kind: ClassVar[int] = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class Data(RpcEvent):
    """Either way, in a stream call: the next item, ``value``. Each one spends one of the
    receiver's credits."""

    kind: ClassVar[int] = 5
    value: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class Credit(RpcEvent):
    """Either way, in a stream call: the sender of this frame takes ``count`` more items
    (1..2**32-1) from its peer."""

    kind: ClassVar[int] = 6
    count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class End(RpcEvent):
    """Client -> server, in a stream call: the client sends no more items (the server's
    answer ends the other direction)."""

    kind: ClassVar[int] = 7


def _maker(cls: type[RpcEvent], *names: str) -> Any:
    """A constructor of ``cls`` from positional field values (``names``' order) for the hot
    paths: the same frozen event as ``cls(**fields)``, built without the frozen ``__init__``'s
    ``object.__setattr__`` per field (about 2.5x faster). Every field must be given."""
    new = object.__new__
    setters = tuple(getattr(cls, n).__set__ for n in names)  # the slots' own descriptors
    if {f.name for f in fields(cls)} != set(names):
        raise TypeError(f"{cls.__name__} has other fields than {names}")
    if len(setters) == 2:
        set_a, set_b = setters

        def make2(a: Any, b: Any) -> Any:
            obj = new(cls)
            set_a(obj, a)
            set_b(obj, b)
            return obj
        return make2
    if len(setters) == 3:
        set_a, set_b, set_c = setters

        def make3(a: Any, b: Any, c: Any) -> Any:
            obj = new(cls)
            set_a(obj, a)
            set_b(obj, b)
            set_c(obj, c)
            return obj
        return make3
    set_a, set_b, set_c, set_d, set_e, set_f, set_g = setters

    def make7(a: Any, b: Any, c: Any, d: Any, e: Any, f: Any, g: Any) -> Any:
        obj = new(cls)
        set_a(obj, a)
        set_b(obj, b)
        set_c(obj, c)
        set_d(obj, d)
        set_e(obj, e)
        set_f(obj, f)
        set_g(obj, g)
        return obj
    return make7


new_request = _maker(Request, "id", "method", "args", "kwargs", "deadline_ms", "stream",
                     "metadata")
new_response = _maker(Response, "id", "result", "metadata")
new_data = _maker(Data, "id", "value")

BY_KIND: dict[int, type[RpcEvent]] = {c.kind: c for c in (Request, Response, Error, Cancel,
                                                          Data, Credit, End)}
STREAM_KINDS: dict[type[RpcEvent], int] = {Data: 5, Credit: 6, End: 7}
"""The events that only stream calls carry."""


def ok_id(v: Any) -> bool:
    return type(v) is int and 0 <= v <= MAX_ID


def ok_name(v: Any) -> bool:
    return isinstance(v, str) and 1 <= len(v) <= MAX_NAME


def bad(cls: type[RpcEvent], name: str, v: Any, error: type[Exception]) -> Exception:
    return error(f"{cls.__name__}.{name}: {short(v)} is not a valid value")
