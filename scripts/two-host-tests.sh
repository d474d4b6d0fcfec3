#!/bin/sh
# The two-host device tests (tests/rxe/test_two_hosts*.py, marked two_hosts), run on host 1 of
# `python -m harness run --hosts 2` (`make test` runs it so: its tests marked timer_bound beside
# the device stage's parallel part, the others beside its serial part):
#   .venv/bin/python -m harness run --hosts 2 -- sh scripts/two-host-tests.sh
# One pytest process (host 1 has one vCPU); --require-rdma fails the run if any of them was
# skipped (e.g. run outside the pair) or none ran; its junit XML file is build/junit-two-hosts.xml
# (read by scripts/test_summary.py). Extra arguments go to pytest. At the end it
# prints the lowest MemAvailable each VM had while the tests ran (sampled every 2 s; host 2's
# sampler is started again when a test has killed and rebooted host 2).
py=${PYTHON:-.venv/bin/python}
unset PYTHONDONTWRITEBYTECODE
low=/tmp/aiordma-lowest-memavailable
low2=/tmp/aiordma-lowest-memavailable-host2
done=/tmp/aiordma-two-host-tests-done
rm -f "$low2" "$done"
# The samplers read /proc/meminfo with the shell's own read and look every 2 s: under emulation
# each program started costs tens of milliseconds (awk and sleep each second took about 13 % of
# a guest's one vCPU).
sample="m=999999999; while :; do while read -r k v _; do"
sample="$sample [ \"\$k\" = MemAvailable: ] && a=\$v && break; done < /proc/meminfo;"
sample="$sample [ \"\$a\" -lt \"\$m\" ] && m=\$a && echo \$m; sleep 2; done"
sh -c "$sample > $low.all" & s1=$!
# host 2's lowest values come back on the exec's stdout (its /tmp does not outlive a reboot)
( while [ ! -e "$done" ]; do
      "$py" -m harness exec 2 -- sh -c "$sample" 2>/dev/null; sleep 1
  done ) >> "$low2" & s2=$!
# AIORDMA_START_WHEN=FILE (make test: scripts/test-stages.sh): the tests marked timer_bound run at
# once, the others wait until FILE exists (--start-when, tests/start_gate.py).
go=${AIORDMA_START_WHEN:-}
gate=${go:+--start-when=$go}
# The files are named, so that the run does not collect (import) the whole device suite.
files=$(grep -l '^pytestmark = .*pytest.mark.two_hosts' tests/rxe/test_*.py)
mkdir -p build
"$py" -m pytest $files -q --require-rdma -m two_hosts -p no:cacheprovider --durations=10 \
    --junitxml=build/junit-two-hosts.xml $gate "$@"
rc=$?
touch "$done"
kill $s1 $s2 2>/dev/null  # (host 2's sampler ends when its agent stops)
echo "[two-host] lowest MemAvailable while the tests ran: host 1 $(sort -n $low.all | head -1) kB," \
     "host 2 $(sort -n "$low2" | head -1) kB"
exit $rc
