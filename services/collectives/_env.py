"""Reading a rank's place in the group from the environment that launchers set.

torchrun (and ``torch.distributed.launch``, and :mod:`aiordma.services.collectives.launch`) set
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` for every process. Slurm's srun
sets ``SLURM_PROCID`` (the rank) and ``SLURM_NTASKS`` (the world size) but no rendezvous
address: export ``MASTER_ADDR`` (a host of the allocation, e.g. the first one) and
``MASTER_PORT`` in the batch script before ``srun``. Open MPI's ``mpirun`` sets
``OMPI_COMM_WORLD_RANK`` and ``OMPI_COMM_WORLD_SIZE``, and passes others on with ``-x``
(``mpirun -x MASTER_ADDR=node1 -x MASTER_PORT=29500 ...``). When several sets are present, the
torchrun variables win, then Open MPI's, then Slurm's: each describes the process that the
launcher after it started (torchrun under mpirun, mpirun in an allocation).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ._errors import LaunchEnvironmentError

__all__ = ["LaunchEnvironment", "launch_environment"]

_MPIRUN_HINT = ("under mpirun, pass them on: mpirun -x MASTER_ADDR=<rank 0's host> "
                "-x MASTER_PORT=29500 ...")
_SLURM_HINT = ("under srun, export them in the batch script, e.g. "
               "MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1) "
               "and MASTER_PORT=29500")


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchEnvironment:
    """Where a rank belongs: its rank, the world size and the rendezvous address (rank 0's).

    Attributes:
        source: ``"torchrun"`` (``RANK``/``WORLD_SIZE``), ``"mpirun"``
            (``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE``) or ``"slurm"``
            (``SLURM_PROCID``/``SLURM_NTASKS``).
    """

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    source: str


def _int(env: Mapping[str, str], name: str, low: int, high: int | None = None) -> int:
    raw = env[name].strip()
    try:
        value = int(raw, 10)
    except ValueError:
        raise LaunchEnvironmentError(f"{name}={env[name]!r} is not an integer") from None
    if value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise LaunchEnvironmentError(f"{name}={value} is outside {bound}")
    return value


def launch_environment(environ: Mapping[str, str] | None = None) -> LaunchEnvironment:
    """Parse ``environ`` (default ``os.environ``).

    Raises:
        LaunchEnvironmentError: the variables are missing (``missing`` names them) or invalid.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        source, rank_var, size_var, hint = "torchrun", "RANK", "WORLD_SIZE", ""
    elif "OMPI_COMM_WORLD_RANK" in env or "OMPI_COMM_WORLD_SIZE" in env:
        source, rank_var, size_var, hint = ("mpirun", "OMPI_COMM_WORLD_RANK",
                                            "OMPI_COMM_WORLD_SIZE", _MPIRUN_HINT)
    elif "SLURM_PROCID" in env or "SLURM_NTASKS" in env:
        source, rank_var, size_var, hint = "slurm", "SLURM_PROCID", "SLURM_NTASKS", _SLURM_HINT
    else:
        raise LaunchEnvironmentError(
            "no launcher environment: set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (as "
            "torchrun and `python -m aiordma.services.collectives.launch` do), or run under "
            "mpirun (OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE) or srun (SLURM_PROCID, "
            "SLURM_NTASKS) with MASTER_ADDR and MASTER_PORT passed on",
            missing=("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    required = (rank_var, size_var, "MASTER_ADDR", "MASTER_PORT")
    missing = tuple(n for n in required if not env.get(n, "").strip())
    if missing:
        found = ", ".join(f"{n}={env[n]}" for n in required if n not in missing)
        raise LaunchEnvironmentError(
            f"{source} environment is incomplete: {', '.join(missing)} missing or empty "
            f"(found {found})" + (f"; {hint}" if hint and ("MASTER_ADDR" in missing
                                                          or "MASTER_PORT" in missing) else ""),
            missing=missing)
    world = _int(env, size_var, 1)
    rank = _int(env, rank_var, 0, world - 1)
    port = _int(env, "MASTER_PORT", 1, 65535)
    return LaunchEnvironment(rank=rank, world_size=world, master_addr=env["MASTER_ADDR"].strip(),
                             master_port=port, source=source)
