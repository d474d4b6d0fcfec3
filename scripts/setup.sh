#!/usr/bin/env bash
# aiordma set-up: idempotent, and a matter of seconds once done.
#
#   1. Debian packages the machine lacks (build tools for rdma-core; QEMU, Debian's kernel and a
#      static busybox for the VM when the host kernel has no RDMA; perftest for C baselines).
#   2. A virtual environment in .venv with aiordma and its test dependencies.
#   3. pyverbs >= 57 (for CompChannel.fd). When the interpreter already has one (a cluster with
#      rdma-core >= 57), the venv sees it. Otherwise the part of rdma-core that aiordma uses
#      (libibverbs, librdmacm, the rxe provider and the pyverbs modules that `import pyverbs.qp`
#      and friends load) is built from the PyPI pyverbs sdist into a private, version-keyed
#      prefix under ~/.cache/aiordma; no system library is touched. pyverbs finds that prefix's
#      libraries through its RPATH, so nobody sets LD_LIBRARY_PATH. A real NIC's provider is
#      not built: on such a machine, use the distribution's rdma-core >= 57 (step 3's first case).
#
# Each phase prints its time. Environment: AIORDMA_CACHE (default ~/.cache/aiordma),
# PYTHON (default python3).
set -euo pipefail

RDMA_CORE_VERSION=59.0   # the PyPI pyverbs sdist carries the rdma-core tree of the same version
CYTHON_VERSION=3.0.12    # pyverbs 59 fails to compile with Cython 3.3
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${AIORDMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/aiordma}
venv=$here/.venv
py=${PYTHON:-python3}
t0=$(date +%s)
tphase=$t0

log() { printf '[setup] %s\n' "$*" >&2; }
phase_done() {  # print how long the phase that just ended took
    local now; now=$(date +%s); log "$1 in $(( now - tphase )) s"; tphase=$now
}

# -- 1. Debian packages ------------------------------------------------------------------------
host_has_rdma() {
    # A device already exists, or the kernel can load Soft-RoCE.
    [ -n "$(ls /sys/class/infiniband 2>/dev/null)" ] && return 0
    modinfo rdma_rxe >/dev/null 2>&1
}

need_pkgs=(cmake ninja-build pkg-config gcc libnl-3-dev libnl-route-3-dev libudev-dev
           iproute2 kmod perftest ibverbs-utils
           openmpi-bin)  # Open MPI's mpirun: a launcher the collectives' tests run a group under
if ! host_has_rdma; then
    # The host kernel cannot do RDMA: tests run in a VM booted with Debian's kernel (rdma_rxe=m).
    need_pkgs+=(qemu-system-x86 linux-image-amd64 busybox-static)
fi
missing=()
for p in "${need_pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    if ! command -v apt-get >/dev/null; then
        log "missing packages (${missing[*]}) and no apt-get: install them with your package manager"
        exit 1
    fi
    sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    log "installing Debian packages: ${missing[*]}"
    $sudo apt-get update -qq || { log "apt-get update failed (exit status $?)"; exit 1; }
    # One transaction, only what is named (no recommended extras: QEMU's GUI, firmware, ...).
    # INITRD=No: the kernel package's hook skips building an initramfs; the VM brings its own.
    $sudo env DEBIAN_FRONTEND=noninteractive INITRD=No \
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
        || { log "apt-get install ${missing[*]} failed (exit status $?)"; exit 1; }
    phase_done "Debian packages installed"
fi

# -- 2. pyverbs: the interpreter's own, or a private build -------------------------------------
system_pyverbs_ok() {
    "$py" - <<'PY' 2>/dev/null
import pyverbs.cq
raise SystemExit(0 if hasattr(pyverbs.cq.CompChannel, "fd") else 1)
PY
}

pyabi=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
prefix=$cache/rdma-core-$RDMA_CORE_VERSION-$pyabi
use_system=0
if system_pyverbs_ok; then
    use_system=1
    log "using the interpreter's own pyverbs (it has CompChannel.fd)"
fi

# -- 3. the virtual environment ----------------------------------------------------------------
# A clone with no venv yet gets a copy of one a set-up here finished before for the same
# pyproject.toml, Cython, interpreter and pyverbs (scripts/venv_cache.py: seconds, where pip
# takes 14-40 s, and the docs extra 11 s more); pip then has nothing left to do.
venv_key=$( { sha256sum < "$here/pyproject.toml"; echo "cython $CYTHON_VERSION system-pyverbs $use_system"
              "$py" -c 'import sys; print(sys.executable, sys.version)'; } | sha256sum | cut -c1-16)
if [ ! -e "$venv" ] && "$py" "$here/scripts/venv_cache.py" restore "$venv" "$cache" "$venv_key"; then
    phase_done "venv copied from $cache/venv/$venv_key"
fi
if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv"
    if [ $use_system = 1 ]; then "$py" -m venv --system-site-packages "$venv"; else "$py" -m venv "$venv"; fi
fi
stamp=$venv/.aiordma-installed
want=$(cat "$here/pyproject.toml" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "installing aiordma (editable) and its dependencies into $venv"
    # pip's output goes to a log, shown when it fails (the set-up then stops, saying so)
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$here[test]" \
        "cython==$CYTHON_VERSION" >"$venv/pip.log" 2>&1 \
        || { tail -30 "$venv/pip.log" >&2; log "pip install failed: see $venv/pip.log"; exit 1; }
    echo "$want" > "$stamp"
    echo "$venv_key" > "$venv/.aiordma-venv-key"  # (docs.sh saves under it again, docs extra added)
    "$py" "$here/scripts/venv_cache.py" save "$venv" "$cache" "$venv_key" \
        || log "could not keep a copy of the venv in $cache/venv (the next clone installs again)"
    phase_done "venv ready"
fi
# Every run, not only after an install: aiordma and every dependency pyproject.toml names for it
# and its tests (the test extra: pytest-timeout, pytest-asyncio, pytest-xdist, hypothesis,
# numpy, ...) are installed in a wanted version and import; else the set-up fails, naming them.
"$venv/bin/python" "$here/scripts/check_deps.py" "$here/pyproject.toml" \
    || { log "the venv lacks what aiordma or its tests need (above); 'rm $stamp' and run again"
         exit 1; }

# What the private prefix holds; a prefix built for another list is built again.
PYVERBS_MODULES="addr base cmid cq device dmabuf flow libibverbs_enums librdmacm_enums mr pd qp
                 srq wq wr xrcd"   # what `import pyverbs.{addr,cq,device,mr,pd,qp,wr}` loads
layout="rdma-core $RDMA_CORE_VERSION: libibverbs librdmacm rxe; pyverbs: $(echo $PYVERBS_MODULES); pxd, include"
if [ $use_system = 0 ]; then
    if [ "$(cat "$prefix/.complete" 2>/dev/null)" != "$layout" ]; then
        log "building rdma-core $RDMA_CORE_VERSION (libibverbs, librdmacm, rxe) + pyverbs into $prefix"
        work=$cache/build-$RDMA_CORE_VERSION-$pyabi
        rm -rf "$work" "$prefix"
        mkdir -p "$work"
        "$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
            "pyverbs==$RDMA_CORE_VERSION" -d "$work" >"$work/download.log" 2>&1 \
            || { cat "$work/download.log" >&2; log "downloading the pyverbs sdist failed"; exit 1; }
        tar -xzf "$work/pyverbs-$RDMA_CORE_VERSION.tar.gz" -C "$work"
        src=$work/pyverbs-$RDMA_CORE_VERSION/rdma-core
        # The pyverbs modules are compiled at -O1, the libraries at the build's -O3: the C that
        # Cython generates for pyverbs is large and slow to optimize (libibverbs_enums.c alone
        # took 194 s at -O3 and 11 s at -O1 on a busy 2-core machine), and none of it is on the
        # per-message path, which is libibverbs, the rxe provider and aiordma's own compiled
        # fast path. (A flag later on gcc's command line wins: this one follows -O3.)
        sed -i 's/-Wno-deprecated-declarations /-Wno-deprecated-declarations -O1 /' \
            "$src/buildlib/pyverbs_functions.cmake"
        grep -q -- '-Wno-deprecated-declarations -O1 ' "$src/buildlib/pyverbs_functions.cmake" \
            || { log "rdma-core's pyverbs_functions.cmake changed: cannot set -O1"; exit 1; }
        # Binaries carry the prefix's RPATH from the start, so they can be copied, not installed
        # (`ninja install` would build everything: every provider, the diagnostics, daemons).
        (cd "$work" && PATH="$venv/bin:$PATH" cmake -S "$src" -B build -GNinja \
            -DCMAKE_BUILD_TYPE=Release \
            -DCMAKE_INSTALL_PREFIX="$prefix" \
            -DCMAKE_INSTALL_RPATH="$prefix/lib" \
            -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON \
            -DCMAKE_INSTALL_PYTHON_ARCH_LIB="$prefix/python" \
            -DPYTHON_EXECUTABLE="$venv/bin/python" \
            -DNO_MAN_PAGES=1 >"$work/cmake.log" 2>&1) || { log "cmake failed: see $work/cmake.log"; exit 1; }
        ext=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
        rxe=$(ninja -C "$work/build" -t targets all | grep -o '^lib/librxe-rdmav[0-9]*\.so' | head -1)
        [ -n "$rxe" ] || { log "no rxe provider target in rdma-core's build"; exit 1; }
        targets=(lib/libibverbs.so lib/librdmacm.so "$rxe")
        for m in $PYVERBS_MODULES; do targets+=("python/pyverbs/$m$ext"); done
        (cd "$work" && PATH="$venv/bin:$PATH" ninja -C build -j "$(nproc)" "${targets[@]}" >"$work/ninja.log" 2>&1) \
            || { tail -30 "$work/ninja.log" >&2; log "build failed: see $work/ninja.log"; exit 1; }
        b=$work/build
        mkdir -p "$prefix/lib/libibverbs" "$prefix/etc/libibverbs.d" "$prefix/python/pyverbs"
        cp -a "$b"/lib/libibverbs.so* "$b"/lib/librdmacm.so* "$prefix/lib/"
        cp "$b/$rxe" "$prefix/lib/libibverbs/"
        echo "driver rxe" > "$prefix/etc/libibverbs.d/rxe.driver"
        for m in $PYVERBS_MODULES; do cp "$b/python/pyverbs/$m$ext" "$prefix/python/pyverbs/"; done
        cp "$src"/pyverbs/*.py "$prefix/python/pyverbs/"
        # For the compiled fast path (step 4): pyverbs' Cython declarations (not installed by
        # rdma-core's build) and the public verbs headers (the build tree's are symlinks).
        cp "$src"/pyverbs/*.pxd "$prefix/python/pyverbs/"
        cp -rL "$b/include" "$prefix/include"
        echo "$layout" > "$prefix/.complete"
        rm -rf "$work"
        phase_done "rdma-core built (${#targets[@]} targets)"
    fi
    # The venv imports pyverbs from the private prefix.
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$prefix/python" > "$site/aiordma-rdma-core.pth"
fi

# -- 4. the compiled fast path (aiordma/_verbs/_fastpath.pyx, the compiled protocols) ---------------
# The verbs module is built against the private prefix's pyverbs declarations, cached per
# source and prefix; with the interpreter's own pyverbs (no .pxd files) its pure-Python path
# runs instead. The message protocol and the RPC protocol's common frames need no rdma-core:
# they are compiled either way.
if [ $use_system = 0 ]; then
    "$venv/bin/python" "$here/scripts/build_fastpath.py" "$prefix" "$cache" \
        || { log "building the fast path failed"; exit 1; }
else
    rm -f "$here"/aiordma/_verbs/_fastpath.*.so
    log "no verbs fast path with the interpreter's pyverbs: its pure-Python path runs"
    "$venv/bin/python" "$here/scripts/build_fastpath.py" - "$cache" \
        || { log "compiling the protocols failed"; exit 1; }
fi
phase_done "fast path ready"

"$venv/bin/python" - <<'PY' || { log "pyverbs does not import from the venv"; exit 1; }
import pyverbs.addr, pyverbs.cq, pyverbs.device, pyverbs.mr, pyverbs.pd, pyverbs.qp, pyverbs.srq
import pyverbs.wr
import pyverbs.libibverbs_enums, pyverbs.pyverbs_error  # every pyverbs module aiordma imports
assert hasattr(pyverbs.cq.CompChannel, "fd"), "pyverbs is too old: CompChannel.fd needs rdma-core >= 57"
PY
log "ready in $(( $(date +%s) - t0 )) s: $venv (pyverbs from $( [ $use_system = 1 ] && echo the interpreter || echo "$prefix" ))"
