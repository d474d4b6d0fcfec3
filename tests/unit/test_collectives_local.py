"""What the collectives take and give, without a device: the arrays they accept (numpy, the
buffer protocol, DLPack, a torch CPU tensor when torch is installed), ``out=``, the op/dtype
rules, and every operation's result on a group of one (which runs no algorithm, so this is
the argument handling and the result's shape, dtype and identity; the algorithms are tested
over rxe in tests/rxe/test_collectives*.py)."""

from __future__ import annotations

import array
import asyncio
import gc
import mmap
import weakref
from typing import Any

import numpy as np
import pytest

from aiordma import ClosedResourceError
from aiordma.services.collectives import CollectiveArgumentError, Group
from aiordma.services.collectives._arrays import as_input, as_output, mapped, reduce_op


def one() -> Group:
    return asyncio.run(Group.join(0, 1, "127.0.0.1", 29500))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_inputs_come_from_numpy_buffers_dlpack_and_sequences() -> None:
    a = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert as_input(a, "x") is a
    got = as_input(array.array("d", [1.0, 2.0]), "x")
    assert got.dtype == np.float64 and got.tolist() == [1.0, 2.0]
    assert as_input(b"ab", "x").tolist() == [97, 98]
    assert as_input([1, 2], "x").tolist() == [1, 2]
    dl = as_input(np.arange(4.0)[::2], "x")  # numpy's own __dlpack__ path is not taken for
    assert dl.tolist() == [0.0, 2.0]  # ndarrays, but a non-contiguous view is still readable
    with pytest.raises(CollectiveArgumentError):
        as_input(np.array([object()]), "x")


def test_outputs_share_the_callers_memory_or_are_refused() -> None:
    buf = bytearray(8)
    view = as_output(buf, "x")
    view[:] = 7
    assert buf == bytearray([7] * 8)
    ro = np.arange(3)
    ro.setflags(write=False)
    for bad in (ro, b"abc", [1, 2], 3.0, "text"):
        with pytest.raises(CollectiveArgumentError):
            as_output(bad, "x")


def test_ops_are_checked_against_the_dtype() -> None:
    assert reduce_op("avg", np.dtype("float32"), "x").name == "avg"
    assert reduce_op("bxor", np.dtype("uint8"), "x").ufunc is np.bitwise_xor
    for op, dt in (("avg", "int32"), ("band", "float64"), ("sum", "S3"), ("max", "M8[ns]"),
                   ("sum", "[('a', '<i4')]"), ("mean", "float32")):
        dtype = np.dtype(eval(dt) if dt.startswith("[") else dt)
        with pytest.raises(CollectiveArgumentError, match="allreduce"):
            reduce_op(op, dtype, "allreduce")


def test_every_operation_on_a_group_of_one() -> None:
    async def main() -> None:
        g = await Group.join(0, 1, "127.0.0.1", 29500)
        a = np.arange(6, dtype=np.float64).reshape(3, 2)
        assert await g.allreduce(a, "avg") is a
        out = np.zeros_like(a)
        assert await g.allreduce(a, "sum", out=out) is out and (out == a).all()
        assert await g.reduce(a, "max", root=0) is a
        assert await g.reduce(a, out=out) is out
        rs = await g.reduce_scatter(a, "prod")
        assert rs.shape == (3, 2) and (rs == a).all() and rs is not a
        assert (await g.alltoall(a) == a).all()
        v = await g.alltoallv(a, [3])
        assert (v == a).all() and v.shape == (3, 2)
        (ga,) = await g.gather(a)
        assert (ga == a).all() and ga is not a
        stacked = np.zeros((1, 3, 2))
        assert await g.gather(a, out=stacked) is stacked and (stacked[0] == a).all()
        assert (await g.scatter([a]) == a).all()
        assert (await g.scatter(a[None]) == a).all()
        (ag,) = await g.allgather(a)
        assert (ag == a).all()
        assert await g.allgather(a, out=stacked) is stacked
        sub = await g.split(0)
        assert sub is not None and sub.world_size == 1 and sub.rank == 0
        assert await g.split(None) is None
        s2 = g.subgroup([0])
        assert s2 is not None and s2.members == (0,)
        assert (await s2.allreduce(a.copy()) == a).all()
        await s2.aclose()
        with pytest.raises(ClosedResourceError):
            await s2.barrier()
        await g.barrier()  # closing a subgroup leaves its parent usable
        with pytest.raises(CollectiveArgumentError):
            await g.send(a, 0)  # no other rank to send to
        with pytest.raises(CollectiveArgumentError):
            await g.recv(None, 0)
        await g.aclose()

    run(main())


@pytest.mark.parametrize(("call", "needle"), [
    (lambda g: g.reduce_scatter(np.float64(1.0)), "first axis"),
    (lambda g: g.alltoall(np.float64(1.0)), "first axis"),
    (lambda g: g.alltoallv(np.arange(3), [2]), "add up"),
    (lambda g: g.alltoallv(np.arange(3), [3], [2]), "expects"),
    (lambda g: g.alltoallv(np.arange(3), [3, 0]), "2 counts for 1 ranks"),
    (lambda g: g.alltoallv(np.arange(3), "3"), "sequence"),
    (lambda g: g.alltoallv(np.arange(3), [3], out=np.zeros(3, np.int64)), "recv_counts"),
    (lambda g: g.allreduce(np.arange(3.0), out=np.zeros(4)), "out"),
    (lambda g: g.allreduce(np.arange(3), "avg"), "floating"),
    (lambda g: g.allreduce(np.arange(3.0), "bor"), "integer"),
    (lambda g: g.allgather(np.arange(3), out=np.zeros((2, 3), np.int64)), "out"),
    (lambda g: g.gather(np.arange(3), out=np.zeros((1, 3), np.int32)), "out"),
    (lambda g: g.scatter([np.arange(3), np.arange(3)]), "1 parts"),
    (lambda g: g.scatter([np.arange(3)], out=np.zeros(2)), "out"),
    (lambda g: g.reduce_scatter(np.arange(3.0), out=np.zeros(2)), "out"),
    (lambda g: g.subgroup([0, 0]), "distinct"),
    (lambda g: g.subgroup([]), "distinct"),
    (lambda g: g.subgroup([1]), "rank"),
    (lambda g: g.subgroup("0"), "sequence"),
    (lambda g: g.split(0, key="k"), "key"),
    (lambda g: g.send(np.arange(3), 0, tag=-1), "dst"),
    (lambda g: g.recv(b"ro", 0), "src"),
])
def test_bad_arguments_are_typed(call: Any, needle: str) -> None:
    async def main() -> None:
        g = await Group.join(0, 1, "127.0.0.1", 29500)
        try:
            with pytest.raises(CollectiveArgumentError, match=needle):
                result = call(g)
                if asyncio.iscoroutine(result):
                    await result
            await g.barrier()  # still usable
        finally:
            await g.aclose()

    run(main())


def test_a_torch_cpu_tensor_works_unchanged() -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed (it is optional: "
                                                "pip install torch==2.13.0 for this test)")

    async def main() -> None:
        g = await Group.join(0, 1, "127.0.0.1", 29500)
        t = torch.arange(6, dtype=torch.float32)
        assert await g.allreduce(t, "avg") is t
        out = torch.zeros(6)
        assert await g.allreduce(t * 2, out=out) is out
        assert out.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
        got = await g.broadcast(t)
        assert got is t
        with pytest.raises(CollectiveArgumentError, match="DLPack"):
            await g.allreduce(torch.ones(3, requires_grad=True))
        with pytest.raises(CollectiveArgumentError, match="DLPack"):
            await g.allreduce(torch.ones(3, dtype=torch.bfloat16))
        await g.aclose()

    run(main())


@pytest.mark.parametrize("nbytes", [0, 1, 4095, 4096, 1 << 20])
def test_mapped_buffers_are_zeroed_page_aligned_and_let_go(nbytes: int) -> None:
    """The group's registered buffers (work, engine, receive slots) are each on a mapping of
    their own, returned to the system when the last view goes (not left in malloc's heap)."""
    arr = mapped(nbytes)
    assert arr.dtype == np.uint8 and arr.shape == (nbytes,) and arr.flags.writeable
    assert not arr.any()
    if nbytes == 0:
        return
    mapping = arr.base.obj  # (numpy.frombuffer: the array's base is a memoryview of it)
    assert isinstance(mapping, mmap.mmap) and arr.ctypes.data % mmap.PAGESIZE == 0
    arr[-1] = 7
    view = arr[nbytes // 2:]
    gone = weakref.ref(mapping)
    del mapping
    del arr
    gc.collect()
    assert gone() is not None and view[-1] == 7  # a view keeps the mapping
    del view
    gc.collect()
    assert gone() is None
