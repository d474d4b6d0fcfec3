#!/bin/sh
# The two-host device tests (tests/rxe/test_two_hosts.py, marked two_hosts), run on host 1 of
# `aiordma rxe run --hosts 2` (`make test` runs it so, after the one-host suite):
#   .venv/bin/aiordma rxe run --hosts 2 -- sh scripts/two-host-tests.sh
# One pytest process (host 1 has one vCPU); --require-rdma fails the run if any of them was
# skipped (e.g. run outside the pair) or none ran. Extra arguments go to pytest.
py=${PYTHON:-.venv/bin/python}
unset PYTHONDONTWRITEBYTECODE
# The files are named, so that the run does not collect (import) the whole device suite.
files=$(grep -l '^pytestmark = pytest.mark.two_hosts' tests/rxe/test_*.py)
exec "$py" -m pytest $files -q --require-rdma -m two_hosts -p no:cacheprovider --durations=10 "$@"
