# The two Quick start commands. Both run scripts/setup.sh first (idempotent; seconds once done).
# Where this host has no RDMA device, the developer harness (`python -m harness run`, harness/ in
# this repository, not installed) boots a small VM with Soft-RoCE.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test unit docs

setup:
	@bash scripts/setup.sh

# Main job: device table, then a key-value server (another process) and clients over RDMA:
# a mixed workload of one-sided GETs, RPC GETs and PUTs, with ops/s and latency percentiles.
demo: setup
	@$(PY) -m harness run -- $(VENV)/bin/aiordma demo

# Every test. What the device tests import is byte-compiled first, on the host
# (scripts/precompile.sh). Then three stages, overlapped (scripts/test-stages.sh): the device-free
# tests on the host on two pytest-xdist workers, beside the device tests on a real device (in the VM
# where needed) on two workers, then the few marked serial alone
# (scripts/device-tests.sh); beside those, the two-host tests, always in two VMs joined by a private
# link (scripts/two-host-tests.sh). --require-rdma fails a run if any device test was skipped or
# none ran. Last, whatever happened, a summary of each stage and the id of every failed test, from
# the junit XML file each stage wrote into build/ (scripts/test_summary.py; a stage without one is
# named). Stage times: docs/testing.md. Each device test runs on one of the two event loops, chosen
# per test by the commit's hash (tests/loops.py: about half on each, another half with the next
# commit), the loop integration's own tests on both; `make test LOOPS=both` runs every one on both.
LOOPS := one
LOOP_SEED := $(shell git rev-parse --short=12 HEAD 2>/dev/null || echo 0)
LOOP_ARGS = --loops $(LOOPS) --loop-seed $(LOOP_SEED)
JUNIT := build/junit-unit.xml build/junit-device.xml build/junit-device-serial.xml \
	build/junit-two-hosts.xml
test: setup
	@sh scripts/precompile.sh
	@rm -f build/junit-*
	@sh scripts/test-stages.sh $(LOOP_ARGS); \
	rc=$$?; $(PY) scripts/test_summary.py --status $$rc $(JUNIT); exit $$rc

# Device-free layer only (any machine).
unit: setup
	@$(PY) -m pytest tests/unit -q

# The documentation site (docs/, mkdocs.yml) with its API reference, built strictly into
# build/site; installs the docs extra of pyproject.toml on first use (scripts/docs.sh).
docs: setup
	@bash scripts/docs.sh
