"""Finding and loading pyverbs and the rdma-core userspace it was built against.

Distributions ship pyverbs too old for ``CompChannel.fd`` (it appeared in rdma-core 57), and
PyPI's pyverbs needs rdma-core's matching libraries. ``scripts/setup.sh`` therefore builds
rdma-core + pyverbs into a private prefix, ``~/.cache/aiordma/rdma-core-<version>-<abi>``, and
adds it to the project's venv. This module makes ``import pyverbs`` work from anywhere else too
(another venv, the VM guest, a plain ``python``): it adds the newest complete prefix to
``sys.path`` and preloads that prefix's ``libibverbs``/``librdmacm`` with ``RTLD_GLOBAL``, so
nobody needs ``LD_LIBRARY_PATH``. A pyverbs that is already importable and new enough wins.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

from aiordma._errors import DeviceError

__all__ = ["cache_dir", "private_prefix", "require_pyverbs"]

_ready = False


def cache_dir() -> Path:
    """The directory where set-up keeps its builds (``$AIORDMA_CACHE`` overrides it)."""
    env = os.environ.get("AIORDMA_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "aiordma"


def private_prefix() -> Path | None:
    """The newest complete private rdma-core prefix for this interpreter, if set-up built one."""
    env = os.environ.get("AIORDMA_RDMA_PREFIX")
    if env:
        return Path(env)
    abi = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    found = []
    for p in cache_dir().glob(f"rdma-core-*-{abi}"):
        if (p / ".complete").exists():
            version = p.name[len("rdma-core-"): -len(abi) - 1]
            try:
                key = tuple(int(x) for x in version.split("."))
            except ValueError:
                continue
            found.append((key, p))
    return max(found)[1] if found else None


def _preload(prefix: Path) -> None:
    for lib in ("libibverbs.so.1", "librdmacm.so.1"):
        path = prefix / "lib" / lib
        if path.exists():
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def require_pyverbs() -> None:
    """Make ``import pyverbs`` give a pyverbs with ``CompChannel.fd``, or raise
    :class:`DeviceError`.

    Idempotent and cheap after the first call.
    """
    global _ready
    if _ready:
        return
    prefix = private_prefix()
    if "pyverbs" not in sys.modules and prefix is not None:
        # Prefer the private build: load its libraries first so its modules bind to them.
        _preload(prefix)
        py = str(prefix / "python")
        if py not in sys.path:
            sys.path.insert(0, py)
    try:
        import pyverbs.cq
    except ImportError as exc:
        raise DeviceError(
            "pyverbs is not importable: run scripts/setup.sh (it builds rdma-core + pyverbs into "
            f"{cache_dir()}), or install pyverbs >= 57 with its rdma-core ({exc})"
        ) from exc
    if not hasattr(pyverbs.cq.CompChannel, "fd"):
        raise DeviceError(
            f"pyverbs at {pyverbs.__file__} is too old: CompChannel.fd needs rdma-core >= 57; "
            "run scripts/setup.sh"
        )
    _ready = True
