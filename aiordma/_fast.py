"""Which per-operation path runs: the compiled fast path or pyverbs' objects.

The compiled module (``aiordma/_fastpath.pyx``, built by ``scripts/setup.sh``) does the verbs
calls of each operation without pyverbs' Python objects; see its docstring. Where it is not
built (an interpreter's own pyverbs has no ``.pxd`` files to compile against) or
``AIORDMA_FASTPATH=0`` is set, the same code runs through pyverbs' ``CQ.poll`` and
``QP.post_send``. The choice is made when a reactor or a queue pair is created, so a test can
run both paths in one process.
"""

from __future__ import annotations

import os
from types import ModuleType

__all__ = ["describe", "fastpath"]

_module: ModuleType | None = None
_why_not: str | None = None  # why the compiled module is not importable (None: not tried yet)


def _load() -> ModuleType | None:
    global _module, _why_not
    if _module is None and _why_not is None:
        from ._native import require_pyverbs

        require_pyverbs()  # the compiled module binds to the pyverbs loaded here
        try:
            from . import _fastpath  # type: ignore[attr-defined]
        except ImportError as exc:
            _why_not = f"not built ({exc}); scripts/setup.sh builds it"
        except (ValueError, RuntimeError) as exc:  # pyverbs' layout differs from its build
            _why_not = f"built for another pyverbs ({exc}); run scripts/setup.sh"
        else:
            _module = _fastpath
    return _module


def _switched_off() -> bool:
    return os.environ.get("AIORDMA_FASTPATH", "1") == "0"


def fastpath() -> ModuleType | None:
    """The compiled module, or ``None`` when the pure-Python path is to run."""
    if _switched_off():
        return None
    return _load()


def describe() -> str:
    """One line for ``aiordma devices`` and the bench: which path new endpoints use."""
    if _switched_off():
        return "python (AIORDMA_FASTPATH=0)"
    from ._errors import DeviceError

    try:
        mod = _load()
    except DeviceError as exc:  # no usable pyverbs at all
        return f"none: {exc}"
    if mod is None:
        return f"python: the compiled fast path is {_why_not}"
    return f"compiled ({os.path.basename(mod.__file__ or '_fastpath')})"
