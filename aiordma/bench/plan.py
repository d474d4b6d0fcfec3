"""How much each benchmark does: the full plan and ``--quick`` (a smoke test)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AREAS", "DEVICE_FREE", "RUN_AREAS", "Plan", "size_name"]

AREAS = {
    "a": "64 B send/recv round trip",
    "b": "RDMA WRITE and READ bandwidth",
    "c": "64 B message rate",
    "d": "large two-sided messages (rendezvous)",
    "e": "RPC echo",
    "f": "key-value GET: one-sided vs RPC",
    "g": "scaling with endpoints",
    "h": "collectives: allreduce, broadcast, allgather, reduce_scatter, alltoall",
    "t": "RPC echo over aiordma's TCP transport (no device needed)",
    "i": "CPU per operation on this host, no device (--host-cpu)",
    "s": "many connections to one server: set-up rate, memory, kernel objects (opt-in)",
}
RUN_AREAS = "abcdefghts"
"""The areas ``aiordma bench`` runs (those of ``--only``; by default all but (s), which is
opt-in: ``--only s``); (i) runs on the host with ``--host-cpu``."""
DEVICE_FREE = "t"
"""The areas that need no RDMA device: a run of only these runs on any host."""

KIB, MIB = 1 << 10, 1 << 20


def size_name(n: int) -> str:
    """``n`` bytes in words: "4 MiB", "64 KiB", "64 B"."""
    return f"{n // MIB} MiB" if n >= MIB and n % MIB == 0 else (
        f"{n // KIB} KiB" if n >= KIB and n % KIB == 0 else f"{n} B")


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Iteration counts and sizes; every figure in the table names the ones it used.

    In the rxe VM (Python under software emulation runs about 8x slower than on the host) the
    full plan took about 7.5 minutes per repeat, ``quick`` under 2 minutes, on a quiet host.
    """

    rtt_iters: int = 1000
    warmup: int = 50
    bw_sizes: tuple[int, ...] = (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB)
    bw_bytes: int = 32 * MIB  # per size and operation (at least min_iters operations)
    bw_window: int = 16  # one-sided operations in flight (aiordma's max_rd_atomic default)
    min_iters: int = 5  # perftest's minimum
    rate_count: int = 10_000
    rate_window: int = 64  # the peer's receive slots (aiordma's Config.data_slots default)
    rdv_size: int = 4 * MIB
    rpc_calls: int = 2000
    rpc_in_flight: tuple[int, ...] = (1, 16, 64)
    rpc_payload: int = 64
    kv_keys: int = 256
    kv_value: int = 64
    kv_gets: int = 1000
    kv_in_flight: tuple[int, ...] = (1, 16)
    scale_endpoints: tuple[int, ...] = (1, 8, 64)
    scale_in_flight: int = 64  # round trips in flight, spread over the endpoints
    scale_ops: int = 3200
    coll_worlds: tuple[int, ...] = (2, 4)  # ranks
    coll_sizes: tuple[int, ...] = (4 * KIB, 64 * KIB, MIB, 4 * MIB, 16 * MIB)  # per rank
    coll_warmup: int = 1  # untimed calls per case
    coll_calls: int = 5  # timed calls per case (the figure is their median)
    coll_timeout: float = 2400.0  # seconds for one launch (every case of one world size)
    coll_concurrent: tuple[int, int] = (4, MIB)  # (ranks, bytes) of the 8 allreduces at once
    cpu_ops: int = 50_000  # (i), on the host: operations per CPU figure
    cpu_warmup: int = 2000
    cpu_in_flight: tuple[int, ...] = (1, 64)  # RPC calls in flight
    row_timeout: float = 300.0  # seconds for one row (one repeat)
    perftest_timeout: float = 180.0
    conn_counts: tuple[int, ...] = (32, 128, 256)  # area (s): connections to one server
    conn_in_flight: int = 16  # area (s): set-ups at a time
    conn_pool_counts: tuple[int, ...] = (1, 32, 256, 1000)  # area (s): both ends on pools
    conn_rounds: int = 500  # area (s): round trips, then pipelined echoes, on one of N

    @classmethod
    def quick(cls) -> Plan:
        return cls(rtt_iters=200, warmup=10, bw_sizes=(4 * KIB, MIB, 4 * MIB), bw_bytes=4 * MIB,
                   rate_count=1000, rpc_calls=256, kv_keys=64, kv_gets=128, scale_ops=640,
                   coll_worlds=(2,), coll_sizes=(64 * KIB, MIB), coll_calls=3,
                   coll_concurrent=(2, 64 * KIB),
                   coll_timeout=300.0, cpu_ops=1000, cpu_warmup=100,
                   row_timeout=120.0, perftest_timeout=90.0, conn_counts=(32,),
                   conn_pool_counts=(1, 32), conn_rounds=100)

    def bw_iters(self, size: int) -> int:
        """Operations per bandwidth figure: ``bw_bytes`` worth, at least ``min_iters``."""
        return max(self.min_iters, self.bw_bytes // size)

    @property
    def rdv_count(self) -> int:
        """Large messages per figure: as many as ``ib_read_bw`` reads at that size in (b), so
        that one perftest run serves both."""
        return self.bw_iters(self.rdv_size)
