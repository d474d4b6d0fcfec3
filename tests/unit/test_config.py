"""Config checks and the TCP keepalive it sets on the liveness connection (a real TCP socket on
the host; no RDMA device involved)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from aiordma import Config, LocalProtocolError
from aiordma._endpoint.connect import _keepalive


@pytest.mark.parametrize("field", ["keepalive_idle", "keepalive_interval", "keepalive_probes",
                                   "data_slots", "max_onesided", "max_message"])
def test_a_limit_below_one_is_refused(field: str) -> None:
    with pytest.raises(LocalProtocolError, match=field):
        Config(**{field: 0}).validate()


@pytest.mark.parametrize(("field", "bad", "good"), [
    ("ctrl_slots", 2, 3), ("recv_buffer", -1, 0), ("send_slots", 1, 2),
    ("close_timeout", 0.0, 0.1), ("close_timeout", float("nan"), 1.0),
    ("handshake_timeout", -1.0, 1.0), ("handshake_timeout", float("inf"), 30.0),
])
def test_the_other_bounds(field: str, bad: float, good: float) -> None:
    with pytest.raises(LocalProtocolError, match=field):
        Config(**{field: bad}).validate()
    Config(**{field: good}).validate()


def test_the_defaults_are_valid() -> None:
    Config().validate()
    assert Config().eager_max == Config().slot_size - 12


def test_the_liveness_connection_gets_the_configured_keepalive() -> None:
    async def main() -> tuple[int, ...]:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            _keepalive(writer, Config(keepalive_idle=7, keepalive_interval=3, keepalive_probes=4))
            sock = writer.get_extra_info("socket")
            return (sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                    sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT))
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    on, idle, interval, probes = asyncio.run(main())
    assert on and (idle, interval, probes) == (7, 3, 4)
