#!/bin/sh
# `make test`'s three stages (run scripts/precompile.sh first; `make test` does):
# - the device-free tests (tests/unit) on this host, on two pytest-xdist workers, from the device
#   VM's start ($started);
# - the device stage (scripts/device-tests.sh) through `python -m harness run`: in the VM where
#   this host has no RDMA device, from the start (at the lowest CPU priority, SCHED_IDLE, once
#   the pair starts);
# - the two-host stage (scripts/two-host-tests.sh) in the two-VM pair (`--hosts 2`): booted as
#   soon as the device VM is up ($started); on host 1 its tests marked timer_bound (netem, a
#   partition, a vanished host: little CPU, much waiting) run at once, beside the device stage's
#   parallel part, and the others wait (AIORDMA_START_WHEN, tests/start_gate.py) until $go, made
#   as soon as that part is over (it touches $marker): they run beside the serial part. The pair's
#   boot, its collection (about 20 s of host 1's one vCPU) and about 85 s of its tests are thus
#   off the run's tail.
# Why so: the parallel part keeps two CPUs busy, while the unit tests mostly wait on timers; the
# serial part and the two-host stage each leave much of a 2-core host idle (40-60 % in the two-host
# stage alone, which took as long with two vCPUs per guest as with one). Started with the parallel
# part, or at 85 % of its tests, all of the pair's tests slowed it down more than they gained
# (three guests' emulated CPUs on two cores: 17 % more CPU time for the same tests). The device
# stage's tests scale their bounds by the load (tests/bounds.py); the two-host fault promises have
# fixed spares, and the pair is the run's tail, so it is the device VM that yields the CPU (beside
# the serial part the pair's tests took 20 % longer than alone with the device VM at nice 10,
# 16 % with it at SCHED_IDLE). The device stage's output comes as it runs; the unit stage's
# (build/unit-tests.log) and the two-host stage's (build/two-host-tests.log) are printed when all
# three are done, so that nothing interleaves. Each stage writes its junit XML files into build/
# (scripts/device-tests.sh, scripts/two-host-tests.sh; the unit stage's is build/junit-unit.xml).
# Extra arguments go to the device and two-host stages. Exit status: the first failing stage's,
# in the order unit, device, two hosts. Measured: docs/reports/2026-11-26-ci-time.md.
py=${PYTHON:-.venv/bin/python}
mkdir -p build
unit_log=build/unit-tests.log
pair_log=build/two-host-tests.log
started=build/device-started
marker=build/device-parallel-done
go=build/two-host-go
rm -f "$started" "$marker" "$go"
# Until the file $1 exists, or the device stage is over if it never comes.
wait_device() { while [ ! -e "$1" ] && kill -0 "$device" 2>/dev/null; do sleep 1; done; }
AIORDMA_DEVICE_STARTED="$started" AIORDMA_PARALLEL_DONE="$marker" \
    "$py" -m harness run -- sh scripts/device-tests.sh "$@" &
device=$!
# The unit stage and the pair start once the device VM is up (or the device stage is over, if
# that never comes).
wait_device "$started"
"$py" -m pytest tests/unit -q -n 2 --dist worksteal -p no:cacheprovider \
    --junitxml=build/junit-unit.xml >"$unit_log" 2>&1 &
unit=$!
"$py" -m harness run --hosts 2 -- env AIORDMA_START_WHEN="$go" sh scripts/two-host-tests.sh "$@" \
    >"$pair_log" 2>&1 &
pair=$!
# The pair's tests wait for the marker, or for the device stage's end if it never comes. Then
# the device VM (the harness, QEMU, every thread) yields the CPU: SCHED_IDLE, so a waking thread
# of the pair takes the CPU from it at once (nice 19 where the policy cannot be set).
wait_device "$marker"
"$py" scripts/yield_cpu.py "$device"
touch "$go"
wait "$device"
device_rc=$?
wait "$unit"
unit_rc=$?
wait "$pair"
pair_rc=$?
rm -f "$started" "$marker" "$go"
echo "[unit] tests/unit on this host (ran beside the device stage; output kept in $unit_log):"
cat "$unit_log"
echo "[two-host] the two-host stage (ran beside the device stage's serial part; output kept" \
     "in $pair_log):"
cat "$pair_log"
for rc in "$unit_rc" "$device_rc" "$pair_rc"; do
    [ "$rc" -ne 0 ] && exit "$rc"
done
exit 0
