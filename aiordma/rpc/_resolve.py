"""Where a pool's replicas are (:func:`aiordma.rpc.connect_pool`): addresses and resolvers.

A pool is given one of:

* a ``"host:port"`` string or a ``(host, port)`` pair: a host name may resolve to several
  addresses (a DNS name with several A records, a line per address in ``/etc/hosts``), each a
  replica;
* a list or tuple of those: every address of every name;
* a resolver: an ``async`` callable with no arguments that returns such a list, for anything
  else that knows where the replicas are (a registry, a scheduler's API, a file).

Whatever the form, :func:`as_resolver` makes it a :data:`Resolver` that the pool calls when it
starts and again every ``resolve_interval`` seconds (bounded by ``resolve_timeout``), so that
replicas added or removed behind a name are found. Names are resolved to IPv4 addresses
(``getaddrinfo``, ``AF_INET``: what RoCE v2 over IPv4 uses), IP literals stay as they are; the
result is a sorted list without duplicates.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from aiordma._args import check_host, check_port
from aiordma._errors import LocalProtocolError

__all__ = ["Address", "Resolver", "as_resolver", "format_address", "parse_address"]

Address = tuple[str, int]
"""An IPv4 address and a port."""

Resolver = Callable[[], Awaitable[Iterable[Any]]]
"""An ``async`` callable returning addresses: ``"host:port"`` strings or ``(host, port)``
pairs (host names are resolved after it)."""


def parse_address(value: Any) -> Address:
    """``"host:port"`` or ``(host, port)`` as ``(host, port)``.

    Raises:
        LocalProtocolError: neither form, or a bad host or port.
    """
    if isinstance(value, str):
        host, sep, port_text = value.rpartition(":")
        if not sep or not port_text.isdigit() or len(port_text) > 5:
            raise LocalProtocolError(f"an address is 'host:port' or (host, port), not "
                                     f"{value!r:.80}")
        return check_host(host, name="an address's host"), check_port(int(port_text))
    if isinstance(value, tuple) and len(value) == 2:
        return check_host(value[0], name="an address's host"), check_port(value[1])
    raise LocalProtocolError(f"an address is 'host:port' or (host, port), not {value!r:.80}")


def format_address(address: Address) -> str:
    return f"{address[0]}:{address[1]}"


async def resolve(addresses: Iterable[Address]) -> list[Address]:
    """Every IPv4 address of every ``(name, port)``, sorted, without duplicates.

    Raises:
        OSError: a name did not resolve (``socket.gaierror``).
    """
    loop = asyncio.get_running_loop()
    found: set[Address] = set()
    for host, port in addresses:
        infos = await loop.getaddrinfo(host, port, family=socket.AF_INET,
                                       type=socket.SOCK_STREAM)
        found.update((str(info[4][0]), port) for info in infos)
    return sorted(found)


def as_resolver(target: Any) -> Resolver:
    """``target`` (an address, a list of them, or a resolver) as a resolver that returns
    resolved IPv4 addresses; addresses given directly are checked now.

    Raises:
        LocalProtocolError: ``target`` is none of those forms, an empty list, or holds a bad
            address.
    """
    if callable(target):
        given: Resolver = target

        async def resolve_given() -> list[Address]:
            got = await given()
            if isinstance(got, (str, bytes)) or not isinstance(got, Iterable):
                raise LocalProtocolError(f"a resolver returns a list of addresses, not "
                                         f"{got!r:.80}")
            return await resolve([parse_address(a) for a in got])

        return resolve_given
    if isinstance(target, str) or (isinstance(target, tuple) and len(target) == 2
                                   and not isinstance(target[1], (str, tuple))):
        target = [target]  # one address (a tuple of two addresses is a list of them)
    if not isinstance(target, Sequence) or isinstance(target, bytes) or not target:
        raise LocalProtocolError(f"connect_pool() takes 'host:port', (host, port), a list of "
                                 f"them or a resolver (an async callable), not {target!r:.80}")
    static = [parse_address(a) for a in target]

    async def resolve_static() -> list[Address]:
        return await resolve(static)

    return resolve_static
