"""Build aiordma's compiled fast path: the verbs module, the compiled message protocol and
the RPC protocol's compiled frames.

Usage: python scripts/build_fastpath.py PREFIX CACHE
       python scripts/build_fastpath.py - CACHE      (no private prefix: the protocols only)

1. ``aiordma/_verbs/_fastpath.pyx`` (the verbs calls), against PREFIX, the rdma-core prefix that
   scripts/setup.sh built (its pyverbs ``.pxd`` files in ``python/pyverbs/``, its headers in
   ``include/``, its libraries in ``lib/``). ``infiniband/driver.h`` (which pyverbs'
   ``libibverbs.pxd`` includes) is an internal rdma-core header that needs the build tree's
   generated kernel-ABI headers; nothing the fast path uses is declared there, so an empty
   stand-in comes first on the include path.
2. The message protocol, ``protocols/messages/_credits.py`` and ``_protocol.py``, compiled by
   Cython from the same source as ``aiordma.protocols.messages._credits_c`` and
   ``._protocol_c``, with the C types of ``protocols/messages/_credits_c.pxd`` and
   ``_protocol_c.pxd``. The only edit to the source is the import that makes the compiled
   protocol use the compiled credit window; the module records the digest of the sources it
   was built from, and :mod:`aiordma._verbs.compiled` does not load a build of other sources.
   Needs no rdma-core.
3. The RPC protocol's common frames, ``protocols/rpc/_plain_c.pyx`` (a subclass of the Python
   connection), with the digest of the ``.pyx`` added; needs no rdma-core.

Each module is compiled once per (sources, Cython, prefix layout, interpreter) and kept under
``CACHE/fastpath/<kind>-<key>/``; a clone of the project on the same machine copies it from there.
The results go next to their sources.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
SOURCE = HERE / "aiordma" / "_verbs" / "_fastpath.pyx"
MESSAGES = HERE / "protocols" / "messages"  # the message protocol's package
RPC = HERE / "protocols" / "rpc" / "_plain_c.pyx"  # the RPC protocol's compiled frames
EXT = sysconfig.get_config_var("EXT_SUFFIX")
# The compiled protocol: (module, source, declarations), built in this order (the sources
# are aiordma._verbs.compiled.PROTOCOL_SOURCES, whose digest the build records).
COMPILED = (("_credits_c", "_credits.py", "_credits_c.pxd"),
            ("_protocol_c", "_protocol.py", "_protocol_c.pxd"))
# The one edit: the compiled protocol takes the compiled window.
EDITS = {"_protocol_c": ("from ._credits import CreditWindow\n",
                         "from ._credits_c import CreditWindow\n")}
# Where the layout before protocols/messages/ put the compiled protocol (deleted: a stale
# build there would still import, and fail on the modules it names, which are gone).
OLD_BUILDS = [HERE / "protocols" / f"{module}{EXT}" for module in ("_credits_c", "_messages_c")]


def verbs_key(prefix: Path) -> str:
    """The cache key of the verbs module built against ``prefix``."""
    parts = [SOURCE, *sorted(SOURCE.parent.glob("_fastpath_*.pxi"))]  # (its included files)
    return _key(*(p.read_bytes() for p in parts), (prefix / ".complete").read_bytes())


def protocol_key() -> str:
    """The cache key of the compiled message protocol."""
    return _key(*((MESSAGES / f).read_bytes() for _, s, p in COMPILED for f in (s, p)))


def rpc_key() -> str:
    """The cache key of the RPC protocol's compiled frames."""
    return _key(RPC.read_bytes())


def _key(*parts: bytes) -> str:
    import Cython

    h = hashlib.sha256()
    for part in (*parts, Path(__file__).read_bytes(), Cython.__version__.encode(),
                 sys.version.encode(), EXT.encode()):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def _compile(c_file: Path, out: Path, includes: tuple[str, ...] = (),
             libraries: tuple[str, ...] = ()) -> None:
    """Compile and link one module; the libraries come after the source (with --as-needed,
    a library named before the code that uses it is dropped)."""
    cc = os.environ.get("CC", "gcc")
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-g0", "-fno-strict-aliasing", *includes,
                    f"-I{sysconfig.get_paths()['include']}", str(c_file), "-o", str(out),
                    *libraries], check=True)


def build_verbs(prefix: Path, out_dir: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="aiordma-fastpath-") as tmp:
        t = Path(tmp)
        (t / "stub" / "infiniband").mkdir(parents=True)
        (t / "stub" / "infiniband" / "driver.h").write_text("/* stand-in: see build_fastpath.py */\n")
        c_file = t / "_fastpath.c"
        subprocess.run([sys.executable, "-m", "cython", "-3", "-I", str(prefix / "python"),
                        "-o", str(c_file), str(SOURCE)], check=True)
        _compile(c_file, out_dir / f"_fastpath{EXT}",
                 includes=(f"-I{t / 'stub'}", f"-I{prefix / 'include'}"),
                 libraries=(f"-L{prefix / 'lib'}", "-l:libibverbs.so.1",
                            f"-Wl,-rpath,{prefix / 'lib'}"))


def build_protocol(out_dir: Path) -> None:
    from aiordma._verbs.compiled import protocol_source_digest  # (the venv's editable install)

    digest = protocol_source_digest()
    with tempfile.TemporaryDirectory(prefix="aiordma-protocol-") as tmp:
        # Packages as installed, so that Cython names the modules fully
        # (aiordma.protocols.messages._protocol_c).
        pkg = Path(tmp) / "aiordma" / "protocols" / "messages"
        pkg.mkdir(parents=True)
        for package in (pkg.parents[1], pkg.parent, pkg):
            (package / "__init__.py").write_text("")
        for module, source, pxd in COMPILED:
            text = (MESSAGES / source).read_text()
            if module in EDITS:
                old, new = EDITS[module]
                if text.count(old) != 1:
                    raise SystemExit(f"[fastpath] {source} no longer has one {old.strip()!r}: "
                                     f"update EDITS in {Path(__file__).name}")
                text = text.replace(old, new)
            text += f"\nSOURCE_DIGEST = {digest!r}  # added by the build\n"
            (pkg / f"{module}.py").write_text(text)
            shutil.copyfile(MESSAGES / pxd, pkg / pxd)
        for module, _, _ in COMPILED:
            subprocess.run([sys.executable, "-m", "cython", "-3", "-X",
                            "annotation_typing=False", str(pkg / f"{module}.py")],
                           check=True, cwd=tmp)
            _compile(pkg / f"{module}.c", out_dir / f"{module}{EXT}")


def build_rpc(out_dir: Path) -> None:
    from aiordma._verbs.compiled import rpc_source_digest  # (the venv's editable install)

    with tempfile.TemporaryDirectory(prefix="aiordma-rpc-") as tmp:
        pkg = Path(tmp) / "aiordma" / "protocols" / "rpc"  # (named fully, as for the protocol)
        pkg.mkdir(parents=True)
        for package in (pkg.parents[1], pkg.parent, pkg):
            (package / "__init__.py").write_text("")
        text = RPC.read_text() + f"\nSOURCE_DIGEST = {rpc_source_digest()!r}  # added by the build\n"
        (pkg / RPC.name).write_text(text)
        subprocess.run([sys.executable, "-m", "cython", "-3", str(pkg / RPC.name)], check=True,
                       cwd=tmp)
        _compile(pkg / "_plain_c.c", out_dir / f"_plain_c{EXT}")


def cached_build(cache: Path, what: str, key: str, build: Callable[[Path], None],
                 targets: list[Path]) -> None:
    """Build into ``cache/fastpath/<kind>-<key>/`` unless it is there (removing the builds of
    earlier sources that nobody touched for an hour); copy the files to ``targets``. Several
    builds may run at once on one machine (two checkouts' set-ups): each builds in a
    directory of its own and the first to finish puts its build in place."""
    kind = what.split()[0]
    where = cache / "fastpath" / f"{kind}-{key}"
    t0 = time.monotonic()

    def complete() -> bool:
        return all((where / t.name).exists() for t in targets)

    if not complete():
        partial = where.with_name(f"{where.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            build(partial)
            if not complete():  # (else another build finished first: its is used)
                shutil.rmtree(where, ignore_errors=True)
                try:
                    partial.replace(where)
                except OSError:  # another build put its own there meanwhile
                    if not complete():
                        raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        for old in where.parent.iterdir():  # earlier sources' builds (bare keys: older layout)
            if (old != where and (old.name.startswith(f"{kind}-") or "-" not in old.name)
                    and time.time() - old.stat().st_mtime > 3600):
                shutil.rmtree(old, ignore_errors=True)
        print(f"[fastpath] {what} compiled in {time.monotonic() - t0:.1f} s: {where}",
              file=sys.stderr)
    for target in targets:
        built = where / target.name
        if not target.exists() or target.read_bytes() != built.read_bytes():
            tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            shutil.copyfile(built, tmp)
            tmp.replace(target)


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    cache = Path(sys.argv[2])
    if sys.argv[1] != "-":
        prefix = Path(sys.argv[1])
        for need in (prefix / "python" / "pyverbs" / "cq.pxd", prefix / "include" / "infiniband"):
            if not need.exists():
                print(f"[fastpath] {need} is missing: the prefix predates the fast path",
                      file=sys.stderr)
                return 1
        cached_build(cache, "verbs module", verbs_key(prefix), lambda d: build_verbs(prefix, d),
                     [HERE / "aiordma" / "_verbs" / f"_fastpath{EXT}"])
    cached_build(cache, "message protocol", protocol_key(), build_protocol,
                 [MESSAGES / f"{module}{EXT}" for module, _, _ in COMPILED])
    cached_build(cache, "rpc frames", rpc_key(), build_rpc, [RPC.with_name(f"_plain_c{EXT}")])
    for old in OLD_BUILDS:
        old.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
