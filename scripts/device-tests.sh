#!/bin/sh
# The device suite, run where an RDMA device is (`make test` runs it through `python -m harness run`):
# first every test not marked `serial` on two pytest-xdist workers (each its own process, device
# context and event loops; `--dist worksteal`: an idle worker takes queued tests from the
# other, so the stage does not end on one worker's tail), then the `serial` ones alone (they
# delete the device, or measure speed). Both runs pass --require-rdma; extra arguments go to
# both. Each writes a junit XML file into build/ (build/junit-device.xml,
# build/junit-device-serial.xml: the repository is shared with the VM, so the host reads them;
# `make test` prints the failed ids from them last, scripts/test_summary.py). Exit status: the
# first failing run's.
py=${PYTHON:-.venv/bin/python}
# Helper modules that scripts/precompile.sh did not reach are compiled once, not per process.
unset PYTHONDONTWRITEBYTECODE
# The serial files are named, so that their run does not collect (import) the whole suite again.
serial=$(grep -l '^pytestmark = pytest.mark.serial' tests/rxe/test_*.py)
workers=${AIORDMA_TEST_WORKERS:-2}
mkdir -p build
# `make test` (scripts/test-stages.sh) boots the two-host pair once this file exists: the VM is
# up (three guests booting at once on two CPUs took 12 s for this one, against 4 s).
[ -n "$AIORDMA_DEVICE_STARTED" ] && touch "$AIORDMA_DEVICE_STARTED"
"$py" -m pytest tests/rxe -q --require-rdma -n "$workers" --dist worksteal \
    -m "not serial and not two_hosts" --durations=25 --junitxml=build/junit-device.xml "$@"
first=$?
# `make test` (scripts/test-stages.sh) starts the two-host stage once this file exists.
[ -n "$AIORDMA_PARALLEL_DONE" ] && touch "$AIORDMA_PARALLEL_DONE"
"$py" -m pytest $serial -q --require-rdma -m serial --junitxml=build/junit-device-serial.xml "$@"
second=$?
[ "$first" -ne 0 ] && exit "$first"
exit "$second"
