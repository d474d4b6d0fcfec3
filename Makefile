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

# Every test. Device tests run on a real device (in the VM where needed), on two pytest-xdist
# workers, then the few marked serial alone (scripts/device-tests.sh); --require-rdma fails a
# run if any device test was skipped or none ran. What they import is byte-compiled first, on
# the host (scripts/precompile.sh). Then the two-host tests, always in two VMs joined by a
# private link (scripts/two-host-tests.sh; 11-15 minutes on a loaded machine, see the README).
test: setup
	@$(PY) -m pytest tests/unit -q
	@sh scripts/precompile.sh
	@$(PY) -m harness run -- sh scripts/device-tests.sh
	@$(PY) -m harness run --hosts 2 -- sh scripts/two-host-tests.sh

# Device-free layer only (any machine).
unit: setup
	@$(PY) -m pytest tests/unit -q

# The documentation site (docs/, mkdocs.yml) with its API reference, built strictly into
# build/site; installs the docs extra of pyproject.toml on first use (scripts/docs.sh).
docs: setup
	@bash scripts/docs.sh
