"""1,000 connections to one server in another process, whose receives come from one shared
pool (issue 37): its CQ entries spread over several reactors (``join_pool``). Bounded by
counts, never by a rate: every connection set up (16 in flight, as a pool's connect would)
and served, the server's kernel objects counted with them open, every count back after the
close (:func:`tests.rxe.test_many_connections.served`).

Both ends' slots are small, so that both processes fit the VM's 2 GiB (1,000 connections of
the default ``Config`` pin about 1.1 GiB on the client's side and 0.5 GiB of send slots on the
server's), and the clients' receives come from their own pools (``client_pool``). Both ends' TCP keepalive is patient (10 s idle, then 10 probes 1 s apart), as a
host holding a thousand connections wants it: with the default (1 s idle, 2 probes 1 s
apart: a peer is dead after 3 s unanswered) the 2,000 control sockets of one VM send about
2,000 probes a second over the loopback, a stalled guest lets them expire together, and some
probes and their answers are lost (the kernel counted 92 retransmission time-outs on the
loopback, and keepalive aborts); healthy connections then broke with ``ETIMEDOUT`` and, on
their peers, ``ECONNRESET`` (250 of the 1,000 in one run of the pool2 branch, 1 in another).
"""

from __future__ import annotations

import pytest

import aiordma

from .test_many_connections import served

pytestmark = pytest.mark.serial  # (alone: it takes most of the VM's memory and CPU for minutes)

MANY = 1000  # connections on one pool
MANY_BUFFERS = 4096  # its slots: 3 control slots reserved per connection, the rest for data
KEEPALIVE = 10  # both ends: 10 s idle, then 10 probes 1 s apart
SMALL = aiordma.Config(receive_pool=True, client_pool=True, data_slots=8, ctrl_slots=4,
                       send_slots=8,
                       keepalive_idle=KEEPALIVE, keepalive_interval=1,
                       keepalive_probes=KEEPALIVE)


@pytest.mark.timeout(1200)  # about 5 minutes on a busy host (set-up at 6/s); a hang guard
async def test_a_thousand_connections_share_one_pool(rdma_device) -> None:
    objects = await served(rdma_device, "uvloop", MANY, pool=MANY_BUFFERS,
                           send_slots=SMALL.send_slots, keepalive=KEEPALIVE, config=SMALL)
    assert objects["srq"] == 1, objects  # one pool, however many CQs its connections use
