#!/bin/sh
# The two-host device tests (tests/rxe/test_two_hosts.py, marked two_hosts), run on host 1 of
# `aiordma rxe run --hosts 2` (`make test` runs it so, after the one-host suite):
#   .venv/bin/aiordma rxe run --hosts 2 -- sh scripts/two-host-tests.sh
# One pytest process (host 1 has one vCPU); --require-rdma fails the run if any of them was
# skipped (e.g. run outside the pair) or none ran. Extra arguments go to pytest. At the end it
# prints the lowest MemAvailable each VM had while the tests ran (sampled each second).
py=${PYTHON:-.venv/bin/python}
bindir=$(dirname "$py")
unset PYTHONDONTWRITEBYTECODE
low=/tmp/aiordma-lowest-memavailable
sample="m=999999999; while :; do a=\$(awk '/MemAvailable/ {print \$2}' /proc/meminfo);"
sample="$sample [ \"\$a\" -lt \"\$m\" ] && m=\$a && echo \$m > $low; sleep 1; done"
sh -c "$sample" & s1=$!
"$bindir/aiordma" rxe exec 2 -- sh -c "$sample" & s2=$!
# The files are named, so that the run does not collect (import) the whole device suite.
files=$(grep -l '^pytestmark = pytest.mark.two_hosts' tests/rxe/test_*.py)
"$py" -m pytest $files -q --require-rdma -m two_hosts -p no:cacheprovider --durations=10 "$@"
rc=$?
kill $s1 $s2 2>/dev/null  # (host 2's sampler goes with the connection of its exec)
echo "[two-host] lowest MemAvailable while the tests ran: host 1 $(cat $low) kB," \
     "host 2 $("$bindir/aiordma" rxe exec --timeout 60 2 -- cat $low) kB"
exit $rc
