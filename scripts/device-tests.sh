#!/bin/sh
# The device suite, run where an RDMA device is (`make test` runs it through `aiordma rxe run`):
# first every test not marked `serial` on two pytest-xdist workers (each its own process, device
# context and event loops), then the `serial` ones alone (they delete the device, or measure
# speed). Both runs pass --require-rdma; extra arguments go to both. Exit status: the first
# failing run's.
py=${PYTHON:-.venv/bin/python}
workers=${AIORDMA_TEST_WORKERS:-2}
"$py" -m pytest tests/rxe -q --require-rdma -n "$workers" -m "not serial" --durations=25 "$@"
first=$?
"$py" -m pytest tests/rxe -q --require-rdma -m serial "$@"
second=$?
[ "$first" -ne 0 ] && exit "$first"
exit "$second"
