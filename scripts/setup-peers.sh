#!/usr/bin/env bash
# The peers `aiordma bench --peers` runs beside aiordma: Open MPI (mpi4py) and ucxx, on rxe.
# Idempotent; each phase prints its time. Never needed by `make demo` or `make test`.
#
#   1. Debian packages: Open MPI 4.1 with mpi4py and numpy for the system interpreter
#      (/usr/bin/python3), libfabric (Open MPI reaches rxe through its verbs provider), and
#      UCX 1.13 (libucx0, ucx-utils), which Debian builds with verbs.
#   2. ucxx (PyPI `ucxx-cu12`, pinned) and numpy in their own venv under
#      ${AIORDMA_CACHE:-~/.cache/aiordma}/peers/venv.
#   3. ucxx pointed at Debian's UCX instead of the UCX wheel it brings (built without verbs, so
#      it would never touch rxe): a directory of symlinks (peers/ucx-lib) named as ucxx's
#      loader opens them, with a ucx/ subdirectory for UCX's transport modules, and the
#      environment in peers/ucxx.env.
#   4. ucxx 0.52 refuses UCX older than 1.19 when imported; Debian 12's is 1.13.1. That check
#      is lowered in this venv only (one constant in ucxx/__init__.py): ucxx then runs on an
#      older UCX than it supports. The bench says so beside every ucxx figure.
#   5. A check: ucxx imports against Debian's UCX, mpi4py imports, and peers/ready.json
#      records the versions (`aiordma bench --peers` reads it).
#
# Environment: AIORDMA_CACHE (default ~/.cache/aiordma), PYTHON (the venv's interpreter,
# default python3).
set -euo pipefail

UCXX_VERSION=0.52.0
UCX_MIN_SUPPORTED=1.19.0  # ucxx 0.52's __ucx_min_version__
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${AIORDMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/aiordma}
peers=$cache/peers
venv=$peers/venv
ucxlib=$peers/ucx-lib
py=${PYTHON:-python3}
t0=$(date +%s)
tphase=$t0

log() { printf '[setup-peers] %s\n' "$*" >&2; }
phase_done() {
    local now; now=$(date +%s); log "$1 in $(( now - tphase )) s"; tphase=$now
}

# -- 1. Debian packages ------------------------------------------------------------------------
pkgs=(openmpi-bin libopenmpi-dev python3-mpi4py python3-numpy libfabric-bin libucx0 ucx-utils)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    command -v apt-get >/dev/null || { log "missing ${missing[*]} and no apt-get"; exit 1; }
    sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    log "installing Debian packages: ${missing[*]}"
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
phase_done "Debian packages (${#missing[@]} installed)"

# -- 2. ucxx in its own venv -------------------------------------------------------------------
mkdir -p "$peers"
if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv"
    "$py" -m venv "$venv"
fi
have=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("ucxx-cu12"))' \
       2>/dev/null || echo none)
if [ "$have" != "$UCXX_VERSION" ]; then
    log "installing ucxx-cu12==$UCXX_VERSION and numpy into $venv (found: $have)"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "ucxx-cu12==$UCXX_VERSION" numpy
fi
phase_done "ucxx venv ready"

# -- 3. Debian's UCX, as ucxx's loader looks for it --------------------------------------------
libucs=$(dpkg -L libucx0 | grep '/libucs\.so\.0$')
arch_lib=$(dirname "$libucs")  # /usr/lib/<multiarch triplet>
mkdir -p "$ucxlib/ucx"
for l in ucs uct ucp ucm; do
    [ -e "$arch_lib/lib$l.so.0" ] || { log "Debian's UCX lacks $arch_lib/lib$l.so.0"; exit 1; }
    ln -sfn "$arch_lib/lib$l.so.0" "$ucxlib/lib$l.so"
    ln -sfn "$arch_lib/lib$l.so.0" "$ucxlib/lib$l.so.0"
done
# Without these UCX finds no verbs transport and silently uses TCP.
for m in ib rdmacm cma; do
    [ -e "$arch_lib/ucx/libuct_$m.so.0" ] || { log "Debian's UCX lacks ucx/libuct_$m.so.0"; exit 1; }
    ln -sfn "$arch_lib/ucx/libuct_$m.so.0" "$ucxlib/ucx/libuct_$m.so"
    ln -sfn "$arch_lib/ucx/libuct_$m.so.0" "$ucxlib/ucx/libuct_$m.so.0"
done
cat > "$peers/ucxx.env" <<EOF
# The environment ucxx runs in for aiordma bench --peers (written by scripts/setup-peers.sh).
RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true
LD_LIBRARY_PATH=$ucxlib
UCX_RNDV_FRAG_MEM_TYPE=host
UCX_TLS=rc_verbs,self
EOF
phase_done "Debian's UCX linked for ucxx ($ucxlib)"

# -- 4. let ucxx import on Debian's older UCX (this venv only) --------------------------------
init=$("$venv/bin/python" - <<'PY'
import importlib.util
print(importlib.util.find_spec("ucxx").submodule_search_locations[0] + "/__init__.py")
PY
)
grep -q '^__ucx_min_version__' "$init" || { log "no __ucx_min_version__ in $init"; exit 1; }
if ! grep -q '^__ucx_min_version__ = "1.13.0"' "$init"; then
    sed -i 's/^__ucx_min_version__ = .*/__ucx_min_version__ = "1.13.0"  # lowered by aiordma scripts\/setup-peers.sh/' "$init"
fi
ucx_version=$(ucx_info -v | sed -n 's/^# Version //p')
log "NOTE: ucxx $UCXX_VERSION supports UCX >= $UCX_MIN_SUPPORTED; it runs here on Debian's UCX" \
    "$ucx_version (built with verbs), an older UCX than it supports (check lowered in $init)"
phase_done "ucxx's UCX version check lowered"

# -- 5. check and record -------------------------------------------------------------------------
ucxx_check=$(env $(grep -v '^#' "$peers/ucxx.env" | xargs) "$venv/bin/python" - <<'PY'
import ucxx
print(ucxx.__version__, ".".join(map(str, ucxx.get_ucx_version())))
PY
)
read -r ucxx_got ucx_loaded <<<"$ucxx_check"
[ "$ucx_loaded" = "$ucx_version" ] || {
    log "ucxx loaded UCX $ucx_loaded, not Debian's $ucx_version: the symlinks are not used"; exit 1; }
mpi_check=$(/usr/bin/python3 -c 'import mpi4py, numpy; print(mpi4py.__version__)')
ompi_version=$(mpirun --version | sed -n 's/.*(Open MPI) //p' | head -n1)
fabric_version=$(fi_info --version | sed -n 's/^libfabric: //p' | head -n1)
cat > "$peers/ready.json" <<EOF
{"ucxx": "$ucxx_got", "ucx": "$ucx_loaded", "ucx_min_supported": "$UCX_MIN_SUPPORTED",
 "venv_python": "$venv/bin/python", "ucx_lib": "$ucxlib", "env_file": "$peers/ucxx.env",
 "open_mpi": "$ompi_version", "mpi4py": "$mpi_check", "libfabric": "$fabric_version",
 "mpi_python": "/usr/bin/python3", "setup": "$here/scripts/setup-peers.sh"}
EOF
phase_done "checked: ucxx $ucxx_got on UCX $ucx_loaded, Open MPI $ompi_version, mpi4py $mpi_check"
log "peers ready in $(( $(date +%s) - t0 )) s: $peers/ready.json"
