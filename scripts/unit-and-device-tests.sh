#!/bin/sh
# `make test`'s first two stages, run at the same time: the device-free tests (tests/unit) on
# this host, on two pytest-xdist workers, beside the device stage (scripts/device-tests.sh,
# through `python -m harness run`: in the VM where this host has no RDMA device). The device
# stage keeps the emulated CPUs busy for minutes while many unit tests wait on timers, so the
# unit stage costs the whole run little beside it. Run scripts/precompile.sh first (`make test`
# does). The unit stage's output goes to build/unit-tests.log and is printed when both are
# done, so the two do not interleave; its junit XML file is build/junit-unit.xml (the device
# stage's: scripts/device-tests.sh). Extra arguments go to the device stage. Exit status: the
# unit stage's if it failed, else the device stage's.
py=${PYTHON:-.venv/bin/python}
mkdir -p build
log=build/unit-tests.log
"$py" -m pytest tests/unit -q -n 2 --dist worksteal -p no:cacheprovider \
    --junitxml=build/junit-unit.xml >"$log" 2>&1 &
unit=$!
"$py" -m harness run -- sh scripts/device-tests.sh "$@"
device=$?
wait "$unit"
unit_rc=$?
echo "[unit] tests/unit on this host (ran beside the device stage; output kept in $log):"
cat "$log"
[ "$unit_rc" -ne 0 ] && { echo "[unit] FAILED (exit status $unit_rc)"; exit "$unit_rc"; }
exit "$device"
