"""The peers of ``aiordma bench --peers``: where ``scripts/setup-peers.sh`` put them, how they
are started, and the proof, read from their own logs, that each ran over the rxe device.

* ucxx 0.52 in its own venv, on Debian's UCX 1.13.1 (older than ucxx supports; the set-up
  lowers ucxx's version check in that venv only), restricted to ``UCX_TLS=rc_verbs,self`` on
  the bench's device. Proof: in a short run with UCX's info log, UCX's
  ``ep_cfg[..]: tag(rc_verbs/<dev>:<port>) ...`` lines name only rc_verbs (and self) for every
  endpoint, in both processes; the timed run, in the same environment with the log at error
  level (silent), then reads ``get_active_transports()``: rc_verbs and self only.
* Open MPI 4.1 (mpi4py) over rxe: ``pml cm``, ``mtl ofi``, libfabric's ``verbs;ofi_rxm``
  provider, ``FI_UNIVERSE_SIZE=8`` (without it the verbs provider asks for a completion queue
  larger than rxe's 32767 entries). Proof: every rank's verbose selection output says pml cm,
  mtl ofi, on the bench's device as libfabric domain, and rank 0 had rxe's verbs provider
  mapped. For context, over shared memory (``ob1``, ``vader``) and kernel TCP (``ob1``,
  ``tcp`` on the device's netdev), each proven by the BTL it reports using.

A route that falls back silently fails its rows (:class:`PeerRouteError`) instead of giving a
fast-looking figure. Parsing is pure (unit-tested on captured output).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MPI_TRANSPORTS", "PeerInstall", "PeerRouteError", "PeersNotInstalled",
           "find_peers", "mpi_route", "mpirun_argv", "ucx_route", "ucx_transports_route"]

SETUP = "scripts/setup-peers.sh"


class PeersNotInstalled(Exception):
    """The peers are not installed where the bench looks (``--peers`` was asked for)."""


class PeerRouteError(Exception):
    """A peer ran, but its own output does not show the route the row claims (e.g. UCX used
    TCP, or Open MPI selected another component): the row fails."""


def cache_dir() -> Path:
    """``$AIORDMA_CACHE``, else ``$XDG_CACHE_HOME/aiordma``, else ``~/.cache/aiordma`` (as
    ``scripts/setup.sh`` and ``scripts/setup-peers.sh`` choose it)."""
    env = os.environ.get("AIORDMA_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aiordma"


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerInstall:
    """What ``scripts/setup-peers.sh`` recorded in ``peers/ready.json``."""

    ucxx: str
    ucx: str
    ucx_min_supported: str
    venv_python: str
    ucxx_env: dict[str, str]
    open_mpi: str
    mpi4py: str
    libfabric: str
    mpi_python: str
    mpirun: str

    @property
    def ucxx_note(self) -> str:
        return (f"ucxx {self.ucxx} on UCX {self.ucx}, older than the UCX >= "
                f"{self.ucx_min_supported} it supports")


def parse_env_file(text: str) -> dict[str, str]:
    """``NAME=value`` lines (``#`` comments and blank lines skipped)."""
    env = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, sep, value = line.partition("=")
            if not sep:
                raise ValueError(f"not NAME=value: {line!r}")
            env[name.strip()] = value.strip()
    return env


def find_peers(cache: Path | None = None) -> PeerInstall:
    """The installed peers, checked to be there.

    Raises:
        PeersNotInstalled: something is missing; the message says what, and to run
            ``bash scripts/setup-peers.sh``.
    """
    root = (cache or cache_dir()) / "peers"
    fix = f"install them with: bash {SETUP}"
    ready = root / "ready.json"
    try:
        doc = json.loads(ready.read_text())
        env = parse_env_file(Path(doc["env_file"]).read_text())
    except (OSError, ValueError, KeyError) as exc:
        raise PeersNotInstalled(f"the peers (ucxx, Open MPI) are not installed: {ready} is "
                                f"missing or unreadable ({exc}); {fix}") from None
    mpirun = shutil.which("mpirun")
    missing = [what for what, ok in (
        (doc.get("venv_python", "the ucxx venv"), Path(doc.get("venv_python", "")).is_file()),
        (doc.get("mpi_python", "/usr/bin/python3"), Path(doc.get("mpi_python", "")).is_file()),
        ("mpirun (Debian's openmpi-bin)", mpirun is not None),
        ("fi_info (Debian's libfabric-bin)", shutil.which("fi_info") is not None),
    ) if not ok]
    if missing:
        raise PeersNotInstalled(f"the peers are not fully installed (missing: "
                                f"{', '.join(missing)}); {fix}")
    assert mpirun is not None
    return PeerInstall(ucxx=doc["ucxx"], ucx=doc["ucx"],
                       ucx_min_supported=doc["ucx_min_supported"],
                       venv_python=doc["venv_python"], ucxx_env=env,
                       open_mpi=doc["open_mpi"], mpi4py=doc["mpi4py"],
                       libfabric=doc["libfabric"], mpi_python=doc["mpi_python"],
                       mpirun=mpirun)


# -- ucxx ----------------------------------------------------------------------------------------

def ucxx_environment(peers: PeerInstall, device: str, port: int,
                     base: dict[str, str] | None = None, *,
                     log_level: str = "error") -> dict[str, str]:
    """The environment of a ucxx process: the set-up's, on ``device:port`` only, with UCX's
    log at ``log_level`` on stderr: ``info`` for the short run whose endpoint lines prove the
    route, ``error`` (silent in a healthy run) for the timed one."""
    env = dict(os.environ if base is None else base)
    env.update(peers.ucxx_env)
    env.update(UCX_NET_DEVICES=f"{device}:{port}", UCX_LOG_LEVEL=log_level,
               UCX_LOG_FILE="stderr", UCX_WARN_UNUSED_ENV_VARS="n")
    return env


_EP_CFG = re.compile(r"ep_cfg\[\d+\]:(.*)$", re.MULTILINE)
_LANE = re.compile(r"\b[a-z_]+\(([^)]*)\)")


def ucx_route(log: str, device: str, port: int) -> str:
    """What UCX's info log says the endpoints used: a short summary if every endpoint's lanes
    are ``rc_verbs`` on ``device:port`` (or ``self``, a process's loopback).

    Raises:
        PeerRouteError: no endpoint configuration was logged, or a lane used anything else.
    """
    configs = [m.group(1).strip() for m in _EP_CFG.finditer(log)]
    if not configs:
        raise PeerRouteError("UCX logged no endpoint configuration (ep_cfg): the route is "
                             "unproven")
    want = f"rc_verbs/{device}:{port}"
    seen: set[str] = set()
    for cfg in configs:
        for lane in _LANE.findall(cfg):
            for resource in lane.split():
                seen.add(resource)
                if resource != want and not resource.startswith("self/"):
                    raise PeerRouteError(f"UCX used {resource} (endpoint: {cfg}), not only "
                                         f"{want}")
    if want not in seen:
        raise PeerRouteError(f"UCX never used {want} (endpoints: {'; '.join(configs)})")
    return f"UCX endpoints over {want} only ({len(configs)} logged)"


#: What ``UCX_TLS`` lets ucxx's processes use (the set-up's ``ucxx.env``).
UCX_TRANSPORTS = frozenset({"rc_verbs", "self"})


def ucx_transports_route(active: Sequence[str]) -> str:
    """What ``ucxx.get_active_transports()`` said after a timed run: a short summary if it is
    rc_verbs (and self) only.

    Raises:
        PeerRouteError: another transport was active, or rc_verbs was not.
    """
    extra = sorted(set(active) - UCX_TRANSPORTS)
    if extra or "rc_verbs" not in active:
        raise PeerRouteError(f"UCX's active transports were {sorted(active)}, not rc_verbs "
                             f"(and self) only")
    return f"active transports {', '.join(sorted(active))}"


# -- Open MPI ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class MpiTransport:
    name: str
    label: str  # the row's system


MPI_TRANSPORTS = {
    "rxe": MpiTransport("rxe", "Open MPI over rxe"),
    "shm": MpiTransport("shm", "Open MPI over shared memory"),
    "tcp": MpiTransport("tcp", "Open MPI over TCP"),
}


def mpirun_argv(peers: PeerInstall, transport: str, ranks: int, *, device: str,
                netdev: str, program: Sequence[str], bind_to_core: bool = False) -> list[str]:
    """``mpirun`` for ``ranks`` copies of ``program`` on one host, on ``transport`` (rxe: on
    ``device``; TCP: on ``netdev``), with the verbose selection output that :func:`mpi_route`
    reads. ``bind_to_core``: each rank bound to a core of its own (Open MPI's default for up
    to 2 ranks, which needs a core per rank), else not bound."""
    base = [peers.mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(ranks),
            "--bind-to", "core" if bind_to_core else "none"]
    if transport == "rxe":
        route = ["--mca", "pml", "cm", "--mca", "mtl", "ofi",
                 "--mca", "mtl_ofi_provider_include", "verbs;ofi_rxm",
                 "-x", "FI_UNIVERSE_SIZE=8", "-x", f"FI_VERBS_DEVICE_NAME={device}",
                 "--mca", "pml_base_verbose", "100", "--mca", "mtl_base_verbose", "100"]
    elif transport == "shm":
        route = ["--mca", "pml", "ob1", "--mca", "btl", "self,vader",
                 "--mca", "btl_base_verbose", "30"]
    elif transport == "tcp":
        route = ["--mca", "pml", "ob1", "--mca", "btl", "self,tcp",
                 "--mca", "btl_tcp_if_include", netdev, "--mca", "btl_base_verbose", "30"]
    else:
        raise ValueError(f"unknown transport {transport!r}")
    return base + route + list(program)


#: A verbose line's ``[host:pid] `` tag; the group is both (ranks on two hosts may share a pid).
_TAG = r"^\[([^\]:]+:\d+)\] "


def mpi_route(transport: str, output: str, ranks: int, *, device: str,
              mapped: Sequence[str] = ()) -> str:
    """What Open MPI's verbose output (and rank 0's mapped libraries) says the ranks used: a
    short summary if it is ``transport`` for every rank.

    Raises:
        PeerRouteError: a rank's selection is missing or names another route.
    """
    def pids(pattern: str) -> set[str]:
        return set(re.findall(_TAG + pattern, output, re.MULTILINE))

    if transport == "rxe":
        cm = pids(r"select: component cm selected")
        ofi = pids(r"mca:base:select:\(\s*mtl\) Selected component \[ofi\]")
        domains = re.findall(_TAG + r".*mtl:ofi:provider: (\S+)", output, re.MULTILINE)
        on_dev = {pid for pid, dom in domains if dom == device}
        others = sorted({dom for _, dom in domains if dom != device})
        if others:
            raise PeerRouteError(f"Open MPI's ofi MTL chose libfabric domain(s) {others}, "
                                 f"not {device}")
        for what, got in (("pml cm", cm), ("mtl ofi", ofi), (f"ofi domain {device}", on_dev)):
            if len(got) < ranks:
                raise PeerRouteError(f"only {len(got)} of {ranks} ranks reported {what}")
        if not any(m.startswith("librxe") for m in mapped):
            raise PeerRouteError(f"rank 0 had no rxe verbs provider mapped ({list(mapped)})")
        return (f"pml cm + mtl ofi (verbs;ofi_rxm) on {device}, all {ranks} ranks; rank 0 "
                f"mapped {', '.join(m for m in mapped if m.startswith(('librxe', 'libfabric')))}")
    want = {"shm": "vader", "tcp": "tcp"}[transport]
    used = re.findall(_TAG + r"mca: bml: Using (\S+) btl for send to", output, re.MULTILINE)
    btls = {btl for _, btl in used} - {"self"}
    if btls != {want}:
        raise PeerRouteError(f"Open MPI's BTLs to other ranks were {sorted(btls) or 'none'}, "
                             f"not {want}")
    ranks_seen = {pid for pid, btl in used if btl == want}
    if len(ranks_seen) < ranks:
        raise PeerRouteError(f"only {len(ranks_seen)} of {ranks} ranks reported the {want} "
                             f"BTL")
    return f"ob1 + {want} BTL, all {ranks} ranks"
