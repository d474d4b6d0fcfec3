"""Build aiordma's compiled verbs fast path (aiordma/_fastpath.pyx) against a private prefix.

Usage: python scripts/build_fastpath.py PREFIX CACHE

PREFIX is the rdma-core prefix that scripts/setup.sh built (its pyverbs ``.pxd`` files in
``python/pyverbs/``, its headers in ``include/``, its libraries in ``lib/``). The module is
compiled once per (source, Cython, prefix layout, interpreter) and kept under
``CACHE/fastpath/<key>/``; a clone of the project on the same machine copies it from there.
The result goes next to the source, ``aiordma/_fastpath<EXT_SUFFIX>``.

``infiniband/driver.h`` (which pyverbs' ``libibverbs.pxd`` includes) is an internal rdma-core
header that needs the build tree's generated kernel-ABI headers; nothing the fast path uses is
declared there, so an empty stand-in comes first on the include path.
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
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
SOURCE = HERE / "aiordma" / "_fastpath.pyx"


def cache_key(prefix: Path) -> str:
    import Cython

    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), Path(__file__).read_bytes(),
                 (prefix / ".complete").read_bytes(), Cython.__version__.encode(),
                 sys.version.encode(), sysconfig.get_config_var("EXT_SUFFIX").encode()):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def build(prefix: Path, out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="aiordma-fastpath-") as tmp:
        t = Path(tmp)
        (t / "stub" / "infiniband").mkdir(parents=True)
        (t / "stub" / "infiniband" / "driver.h").write_text("/* stand-in: see build_fastpath.py */\n")
        c_file = t / "_fastpath.c"
        subprocess.run([sys.executable, "-m", "cython", "-3", "-I", str(prefix / "python"),
                        "-o", str(c_file), str(SOURCE)], check=True)
        cc = os.environ.get("CC", "gcc")
        cmd = [cc, "-shared", "-fPIC", "-O2", "-g0", "-fno-strict-aliasing",
               f"-I{t / 'stub'}", f"-I{prefix / 'include'}",
               f"-I{sysconfig.get_paths()['include']}",
               str(c_file), "-o", str(out),
               f"-L{prefix / 'lib'}", "-l:libibverbs.so.1", f"-Wl,-rpath,{prefix / 'lib'}"]
        subprocess.run(cmd, check=True)


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    prefix, cache = Path(sys.argv[1]), Path(sys.argv[2])
    for need in (prefix / "python" / "pyverbs" / "cq.pxd", prefix / "include" / "infiniband"):
        if not need.exists():
            print(f"[fastpath] {need} is missing: the prefix predates the fast path",
                  file=sys.stderr)
            return 1
    name = "_fastpath" + sysconfig.get_config_var("EXT_SUFFIX")
    target = HERE / "aiordma" / name
    cached = cache / "fastpath" / cache_key(prefix) / name
    t0 = time.monotonic()
    if not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_suffix(".partial")
        build(prefix, partial)
        partial.replace(cached)
        for old in cached.parent.parent.iterdir():  # builds of earlier sources
            if old != cached.parent:
                shutil.rmtree(old, ignore_errors=True)
        print(f"[fastpath] compiled in {time.monotonic() - t0:.1f} s: {cached}", file=sys.stderr)
    if not target.exists() or target.read_bytes() != cached.read_bytes():
        shutil.copyfile(cached, target.with_suffix(".tmp"))
        target.with_suffix(".tmp").replace(target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
