"""Driving a group of ``collective_worker.py`` processes from a test.

``WorkerGroup`` starts ``world`` workers with torchrun's variables (or srun's), waits for
every ``READY`` line, then sends JSON commands to all of them and reads one answer line from
each, every read bounded by a deadline (a hung worker fails the test, it cannot hang it).
``play`` runs a list of ``collective_ops`` cases on a group and checks every rank's results
against numpy.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

import numpy as np

from aiordma.services.collectives.launch import free_port

from ..bounds import STEP
from . import warm
from .collective_ops import expected

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "collective_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WorkerError(AssertionError):
    """A worker answered ERR."""

    def __init__(self, message: str, *, usable: bool) -> None:
        super().__init__(message)
        self.usable = usable


class LineReader:
    """Lines from a pipe, each read bounded by a deadline (no thread, no hang)."""

    def __init__(self, pipe: Any) -> None:
        self.fd = pipe.fileno()
        self.buf = b""

    def readline(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no line within {timeout} s (have {self.buf!r})")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    raise EOFError(f"the worker closed its output (have {self.buf!r})")
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()


class WorkerGroup:
    def __init__(self, world: int, *, loop: str = "asyncio", device: str | None = None,
                 slot_bytes: str = "262144", slots: str = "4", timeout: float = STEP,
                 env_style: str = "torchrun", thresholds: str = "{}",
                 transport: str = "auto") -> None:
        self.world = world
        port = free_port()
        self.procs: list[subprocess.Popen[bytes]] = []
        args = [sys.executable, WORKER, "--loop", loop, "--slot-bytes", slot_bytes,
                "--slots", slots, "--timeout", str(timeout), "--thresholds", thresholds,
                "--transport", transport]
        if device:
            args += ["--device", device]
        for r in range(world):
            env = {k: v for k, v in os.environ.items()
                   if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            if env_style == "torchrun":
                env.update(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r))
            else:
                env.update(SLURM_PROCID=str(r), SLURM_NTASKS=str(world))
            self.procs.append(warm.popen(args, stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, env=env, cwd=ROOT))
        self.readers = [LineReader(p.stdout) for p in self.procs]
        self.ready: list[str] = []

    def wait_ready(self, timeout: float = 240.0) -> list[str]:
        # Generous: a bound against hangs, not a performance check. In a loaded VM, importing
        # numpy, pyverbs and aiordma took 30-60 s per process (4 processes on 2 vCPUs).
        self.ready = [r.readline(timeout) for r in self.readers]
        return self.ready

    def send(self, cmd: dict[str, Any], ranks: list[int] | None = None) -> None:
        data = (json.dumps(cmd) + "\n").encode()
        for r in ranks if ranks is not None else range(self.world):
            stdin = self.procs[r].stdin
            assert stdin is not None
            stdin.write(data)
            stdin.flush()

    def answers(self, timeout: float, ranks: list[int] | None = None) -> list[str]:
        return [self.readers[r].readline(timeout)
                for r in (ranks if ranks is not None else range(self.world))]

    def run(self, cmd: dict[str, Any], timeout: float = STEP) -> list[dict[str, Any]]:
        """Send ``cmd`` to every worker; their ``OK`` payloads.

        Raises:
            WorkerError: a worker answered ``ERR`` (``usable`` says whether every rank
                answered and the group is still usable).
        """
        self.send(cmd)
        lines = self.answers(timeout)
        errors = {r: json.loads(line[4:]) for r, line in enumerate(lines)
                  if line.startswith("ERR ")}
        if errors:
            usable = not any(e["group_broken"] for e in errors.values())
            raise WorkerError(f"{errors}", usable=usable)
        for r, line in enumerate(lines):
            assert line.startswith("OK "), f"rank {r}: {line}"
        return [json.loads(line[3:]) for line in lines]

    def kill(self, rank: int) -> None:
        self.procs[rank].send_signal(signal.SIGKILL)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(timeout=30)
            for f in (p.stdin, p.stdout):
                if f is not None:
                    f.close()


class Groups:
    """One live worker group per world size, started on first use, replaced after a failure;
    ``specs[world]`` gives its workers' loop, slots, environment style, thresholds and
    (optionally) transport."""

    def __init__(self, device: str | None, specs: dict[int, dict[str, str]]) -> None:
        self.device = device
        self.specs = specs
        self.live: dict[int, WorkerGroup] = {}

    def get(self, world: int) -> WorkerGroup:
        g = self.live.get(world)
        if g is None:
            t0 = time.monotonic()
            spec = self.specs[world]
            g = WorkerGroup(world, device=self.device, loop=spec["loop"],
                            slot_bytes=spec["slot_bytes"], slots=spec["slots"],
                            env_style=spec["env"], thresholds=spec["thresholds"],
                            transport=spec.get("transport", "auto"))
            try:
                ready = g.wait_ready()
            except BaseException:
                g.close()
                raise
            assert sorted(ready) == [f"READY {r} {world}" for r in range(world)]
            print(f"group of {world}: started and formed in {time.monotonic() - t0:.1f} s")
            self.live[world] = g
        return g

    def discard(self, world: int) -> None:
        g = self.live.pop(world, None)
        if g is not None:
            g.close()

    def close(self) -> None:
        for w in list(self.live):
            self.discard(w)


def same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Equal shape, dtype (byte order aside) and bytes (NaN bit patterns included)."""
    native = want.dtype.newbyteorder("=")
    assert got.shape == want.shape and got.dtype.newbyteorder("=") == native, (
        f"{what}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
    a = np.ascontiguousarray(got.astype(native)).tobytes()
    b = np.ascontiguousarray(want.astype(native)).tobytes()
    assert a == b, f"{what}: got {got!r:.300}, want {want!r:.300}"


def run_cases(groups: Groups, world: int, cmd: dict[str, Any]) -> None:
    """Run ``cmd`` on the group of ``world`` workers; after a failure that leaves it unusable
    (or out of step), the next use gets a fresh group."""
    g = groups.get(world)
    try:
        g.run(cmd, timeout=STEP)
    except WorkerError as exc:
        if not exc.usable:
            groups.discard(world)  # the next example gets a fresh group
        raise
    except BaseException:  # a worker did not answer: the group is out of step
        groups.discard(world)
        raise


def play(groups: Groups, world: int, ops: list[dict[str, Any]], out_dir: str) -> None:
    """Run ``ops`` on the group of ``world`` workers and check every rank's results."""
    run_cases(groups, world, {"ops": ops, "out": out_dir})
    want: list[dict[str, np.ndarray]] = [{} for _ in range(world)]
    for i, case in enumerate(ops):
        for r, got in enumerate(expected(case, world, str(i))):
            want[r].update(got)
    for r in range(world):
        with np.load(os.path.join(out_dir, f"rank{r}.npz")) as saved:
            assert sorted(saved.keys()) == sorted(want[r]), f"rank {r}"
            for key, w in want[r].items():
                same(saved[key], w, f"rank {r}, result {key}")
