#!/bin/sh
# `make test`'s three stages, run at the same time (run scripts/precompile.sh first; `make test`
# does):
# - the device-free tests (tests/unit) on this host, on two pytest-xdist workers;
# - the device stage (scripts/device-tests.sh) through `python -m harness run`: in the VM where
#   this host has no RDMA device, at a lower CPU priority (nice 10);
# - the two-host stage (scripts/two-host-tests.sh) in the two-VM pair (`--hosts 2`).
# Why at once: the device stage keeps two CPUs busy for minutes, while the unit tests mostly
# wait on timers and the two-host tests on the link's delays, losses and kills (alone, the
# pair's stage left 40-60 % of this 2-core host idle, and took as long with two vCPUs per guest
# as with one). The device stage's tests scale their bounds by the load (tests/bounds.py); the
# two-host stage's fault promises have fixed spares, so it is the device VM that yields the CPU.
# The device stage's output comes as it runs; the unit stage's (build/unit-tests.log) and the
# two-host stage's (build/two-host-tests.log) are printed when all three are done, so that
# nothing interleaves. Each stage writes its junit XML files into build/ (scripts/device-tests.sh,
# scripts/two-host-tests.sh; the unit stage's is build/junit-unit.xml). Extra arguments go to
# the device and two-host stages. Exit status: the first failing stage's, in the order unit,
# device, two hosts.
py=${PYTHON:-.venv/bin/python}
mkdir -p build
unit_log=build/unit-tests.log
pair_log=build/two-host-tests.log
"$py" -m pytest tests/unit -q -n 2 --dist worksteal -p no:cacheprovider \
    --junitxml=build/junit-unit.xml >"$unit_log" 2>&1 &
unit=$!
"$py" -m harness run --hosts 2 -- sh scripts/two-host-tests.sh "$@" >"$pair_log" 2>&1 &
pair=$!
nice -n 10 "$py" -m harness run -- sh scripts/device-tests.sh "$@"
device=$?
wait "$unit"
unit_rc=$?
wait "$pair"
pair_rc=$?
echo "[unit] tests/unit on this host (ran beside the device stage; output kept in $unit_log):"
cat "$unit_log"
echo "[two-host] the two-host stage (ran beside the device stage; output kept in $pair_log):"
cat "$pair_log"
for rc in "$unit_rc" "$device" "$pair_rc"; do
    [ "$rc" -ne 0 ] && exit "$rc"
done
exit 0
