"""Cases for test_collectives_set.py: every operation of a Group, several in flight, on
subgroups; run by the workers (``run``) and predicted with numpy by the test (``expected``)
from the same JSON-able case, so the test never needs the workers' inputs.

A case is a dict with a ``kind``. Leaves: ``allreduce``, ``reduce``, ``reduce_scatter``,
``alltoall``, ``alltoallv``, ``gather``, ``scatter``, ``broadcast``, ``allgather``,
``barrier``, ``p2p`` (messages ``[src, dst, tag, shape, dtype]``). Composites: ``inflight``
(its ``cases`` started at once, in list order, awaited together), ``split`` (``colors`` and
``keys`` per rank; each subgroup runs ``cases``) and ``subgroup`` (``ranks`` run ``cases``).
Results are saved per rank under the case's path (``"0"``, ``"0.2"``...), lists as
``path/j``. Inputs are small integers (exact in every dtype and order), made from the case's
seed, the rank and the group's size; in a subgroup, the subgroup's rank and size, and the
seed plus the subgroup's color (or its first member).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import numpy as np

UFUNCS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
          "avg": np.add, "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
#: (op, dtype) pairs the tests draw from: every op, on dtypes it takes.
OP_DTYPES = [(op, dt) for op in ("sum", "prod", "max", "min")
             for dt in ("int8", "uint16", "int32", "float16", "float32", "float64", ">i4")]
OP_DTYPES += [("avg", dt) for dt in ("float16", "float32", "float64", "complex64")]
OP_DTYPES += [(op, dt) for op in ("band", "bor", "bxor") for dt in ("bool", "uint8", "int64")]
ANY_DTYPES = ["int8", "float64", "complex64", ">i4", "S3", "bool"]


class DLPackOnly:
    """An array seen only through DLPack (as a torch tensor is, without torch)."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.a.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self.a.__dlpack_device__()


def _rng(case: dict[str, Any], *more: Any) -> np.random.Generator:
    return np.random.default_rng([case["seed"], *more])


def _values(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype[Any],
            reducing: bool) -> np.ndarray:
    n = int(np.prod(shape, dtype=np.int64))
    if not reducing:  # any bytes
        return rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(
            shape)
    if dtype.kind == "b":
        base = rng.integers(0, 2, n)
    elif dtype.kind == "u":
        base = rng.integers(0, 4, n)
    elif dtype.kind == "c":
        base = rng.integers(-3, 4, n) + 1j * rng.integers(-3, 4, n)
    else:
        base = rng.integers(-3, 4, n)
    return base.astype(dtype).reshape(shape)


def block_shape(case: dict[str, Any], world: int) -> tuple[int, ...]:
    """The input shape of reduce_scatter and alltoall: ``rows`` per rank."""
    return (world * case["rows"], *case["rest"])


def v_counts(case: dict[str, Any], world: int) -> np.ndarray:
    """alltoallv: ``counts[src][dst]`` rows."""
    return _rng(case, 1_000_001, world).integers(0, case["max_rows"] + 1, (world, world))


def make(case: dict[str, Any], rank: int, world: int) -> Any:
    """Rank ``rank``'s input for a leaf case in a group of ``world``."""
    kind = case["kind"]
    rng = _rng(case, rank)
    if kind in ("allreduce", "reduce"):
        return _values(rng, tuple(case["shape"]), np.dtype(case["dtype"]), True)
    if kind == "reduce_scatter":
        return _values(rng, block_shape(case, world), np.dtype(case["dtype"]), True)
    if kind == "alltoall":
        return _values(rng, block_shape(case, world), np.dtype(case["dtype"]), False)
    if kind == "alltoallv":
        rows = int(v_counts(case, world)[rank].sum())
        return _values(rng, (rows, *case["rest"]), np.dtype(case["dtype"]), False)
    if kind in ("gather", "allgather"):
        i = 0 if case.get("out") else rank % len(case["shapes"])
        return _values(rng, tuple(case["shapes"][i]), np.dtype(case["dtypes"][i]), False)
    if kind == "scatter":  # the root's parts
        same = case.get("out") or not case.get("as_list")
        return [_values(_rng(case, 1_000_002, p), tuple(case["shapes"][0 if same else p % len(
            case["shapes"])]), np.dtype(case["dtypes"][0 if same else p % len(
                case["dtypes"])]), False) for p in range(world)]
    if kind == "broadcast":
        return _values(rng, tuple(case["shape"]), np.dtype(case["dtype"]), False)
    raise ValueError(kind)


def _message(case: dict[str, Any], i: int) -> np.ndarray:
    _, _, _, shape, dtype = case["messages"][i]
    return _values(_rng(case, 1_000_003, i), tuple(shape), np.dtype(dtype), False)


def _messages(case: dict[str, Any], world: int) -> list[tuple[int, int, int, int]]:
    """(index, src, dst, tag) of the messages that fit this group."""
    out = []
    for i, (src, dst, tag, _, _) in enumerate(case["messages"]):
        src, dst = src % world, dst % world
        if src != dst:
            out.append((i, src, dst, tag))
    return out


def _reduced(case: dict[str, Any], inputs: list[np.ndarray]) -> np.ndarray:
    got = functools.reduce(UFUNCS[case["op"]], inputs)
    if case["op"] == "avg":
        got = got / len(inputs)
    return got


def _sub(case: dict[str, Any], world: int) -> list[tuple[list[int], int]]:
    """A composite's subgroups: (members, seed shift) each."""
    if case["kind"] == "subgroup":
        ranks = [r % world for r in case["ranks"]]
        ranks = list(dict.fromkeys(ranks))
        return [(ranks, ranks[0])]
    colors = [case["colors"][r % len(case["colors"])] for r in range(world)]
    keys = [case["keys"][r % len(case["keys"])] for r in range(world)]
    groups = []
    for c in sorted({c for c in colors if c is not None}):
        members = [r for _, r in sorted((keys[r], r) for r in range(world) if colors[r] == c)]
        groups.append((members, c))
    return groups


def _shifted(cases: list[dict[str, Any]], shift: int) -> list[dict[str, Any]]:
    return [{**c, "seed": c.get("seed", 0) + 1000 * (shift + 1)} for c in cases]


def expected(case: dict[str, Any], world: int, path: str = "0") -> list[dict[str, np.ndarray]]:
    """What each rank of a group of ``world`` saves for ``case``."""
    kind = case["kind"]
    outs: list[dict[str, np.ndarray]] = [{} for _ in range(world)]
    if kind == "barrier":
        return outs
    if kind == "inflight":
        for k, sub in enumerate(case["cases"]):
            for r, got in enumerate(expected(sub, world, f"{path}.{k}")):
                outs[r].update(got)
        return outs
    if kind in ("split", "subgroup"):
        for members, shift in _sub(case, world):
            for k, sub in enumerate(_shifted(case["cases"], shift)):
                for i, got in enumerate(expected(sub, len(members), f"{path}.{k}")):
                    outs[members[i]].update(got)
        return outs
    if kind == "p2p":
        for i, _, dst, _ in _messages(case, world):
            outs[dst][f"{path}/m{i}"] = _message(case, i)
        return outs
    inputs = [make(case, r, world) for r in range(world)]
    if kind == "allreduce":
        for r in range(world):
            outs[r][path] = _reduced(case, inputs)
    elif kind == "reduce":
        outs[case["root"] % world][path] = _reduced(case, inputs)
    elif kind == "reduce_scatter":
        full, rows = _reduced(case, inputs), case["rows"]
        for r in range(world):
            outs[r][path] = full[r * rows:(r + 1) * rows]
    elif kind == "alltoall":
        rows = case["rows"]
        for r in range(world):
            outs[r][path] = np.concatenate([inputs[q][r * rows:(r + 1) * rows]
                                            for q in range(world)])
    elif kind == "alltoallv":
        counts = v_counts(case, world)
        for r in range(world):
            outs[r][path] = np.concatenate([
                inputs[q][counts[q][:r].sum():counts[q][:r + 1].sum()] for q in range(world)])
    elif kind in ("gather", "allgather"):
        holders = range(world) if kind == "allgather" else [case["root"] % world]
        for r in holders:
            if case.get("out"):
                outs[r][path] = np.stack(inputs)
            else:
                outs[r].update({f"{path}/{j}": a for j, a in enumerate(inputs)})
    elif kind == "scatter":
        parts = inputs[case["root"] % world]
        for r in range(world):
            outs[r][path] = parts[r]
    elif kind == "broadcast":
        for r in range(world):
            outs[r][path] = inputs[case["root"] % world]
    else:
        raise ValueError(kind)
    return outs


def _wrap(a: np.ndarray, how: str | None) -> Any:
    """``a`` seen through DLPack or the buffer protocol, where those can show it (DLPack has
    no byte-swapped or string dtypes)."""
    if how == "dlpack" and a.dtype.isnative and a.dtype.kind in "biufc":
        return DLPackOnly(a)
    if how == "buffer":
        return memoryview(a) if a.flags.c_contiguous and a.dtype.isnative else a
    return a


async def run(g: Any, case: dict[str, Any], path: str = "0") -> dict[str, np.ndarray]:
    """Run ``case`` on group ``g``; what this rank saves."""
    kind, rank, world = case["kind"], g.rank, g.world_size
    if kind == "barrier":
        await g.barrier()
        return {}
    if kind == "inflight":
        got = await asyncio.gather(*(run(g, sub, f"{path}.{k}")
                                     for k, sub in enumerate(case["cases"])))
        return {k: v for d in got for k, v in d.items()}
    if kind in ("split", "subgroup"):
        if kind == "split":
            color = case["colors"][rank % len(case["colors"])]
            sub = await g.split(color, key=case["keys"][rank % len(case["keys"])])
        else:
            sub = g.subgroup(_sub(case, world)[0][0])
        if sub is None:
            return {}
        shift = color if kind == "split" else _sub(case, world)[0][1]
        out: dict[str, np.ndarray] = {}
        for k, c in enumerate(_shifted(case["cases"], shift)):  # in order (their own order)
            out.update(await run(sub, c, f"{path}.{k}"))
        await sub.aclose()
        return out
    if kind == "p2p":
        mine = _messages(case, world)
        sends = [g.send(_message(case, i), dst, tag=tag) for i, src, dst, tag in mine
                 if src == rank]
        recvs = [(i, g.recv(None if i % 2 else np.zeros_like(_message(case, i)), src, tag=tag))
                 for i, src, dst, tag in mine if dst == rank]
        got = await asyncio.gather(*sends, *(c for _, c in recvs))
        return {f"{path}/m{i}": np.asarray(a) for (i, _), a in zip(recvs, got[len(sends):],
                                                                   strict=True)}
    arr = make(case, rank, world)
    wrap = case.get("wrap")
    if kind == "allreduce":
        if case.get("out"):
            dst = np.zeros_like(arr)
            assert await g.allreduce(_wrap(arr, wrap), case["op"], out=_wrap(dst, wrap)) is not None
            return {path: dst}
        target = _wrap(arr, wrap)
        assert await g.allreduce(target, case["op"]) is target
        return {path: arr}
    if kind == "reduce":
        root = case["root"] % world
        dst = np.zeros_like(arr) if case.get("out") and rank == root else None
        got = await g.reduce(_wrap(arr, wrap), case["op"], root=root, out=dst)
        if rank != root:
            assert got is None
            return {}
        return {path: arr if dst is None else dst}
    if kind == "reduce_scatter":
        if case.get("out"):
            dst = np.zeros((case["rows"], *case["rest"]), arr.dtype)
            await g.reduce_scatter(_wrap(arr, wrap), case["op"], out=dst)
            return {path: dst}
        return {path: await g.reduce_scatter(_wrap(arr, wrap), case["op"])}
    if kind == "alltoall":
        if case.get("out"):
            dst = np.zeros_like(arr)
            await g.alltoall(arr, out=dst)
            return {path: dst}
        return {path: await g.alltoall(_wrap(arr, wrap))}
    if kind == "alltoallv":
        counts = v_counts(case, world)
        recv = counts[:, rank].tolist() if case.get("recv") else None
        return {path: await g.alltoallv(arr, counts[rank].tolist(), recv)}
    if kind in ("gather", "allgather"):
        root = case.get("root", 0) % world
        stacked = np.zeros((world, *arr.shape), arr.dtype) if case.get("out") else None
        if kind == "gather":
            got = await g.gather(arr, root=root, out=stacked)
            if rank != root:
                assert got is None
                return {}
        else:
            got = await g.allgather(arr, out=stacked)
        if stacked is not None:
            assert got is stacked
            return {path: stacked}
        return {f"{path}/{j}": a for j, a in enumerate(got)}
    if kind == "scatter":
        root = case["root"] % world
        parts = arr if rank == root else None
        if parts is not None and not case.get("as_list"):
            parts = np.stack(parts).astype(parts[0].dtype)  # (stack drops a byte order)
        dst = np.zeros_like(arr[rank]) if case.get("out") else None
        got = await g.scatter(parts, root=root, out=dst)
        return {path: got if dst is None else dst}
    if kind == "broadcast":
        root = case["root"] % world
        got = await g.broadcast(arr if rank == root else None, root=root)
        return {path: np.asarray(got)}
    raise ValueError(kind)
