# One place for setup: every target installs first, so a fresh machine needs only `make demo` or `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-scale test-multinode test-fast test-trl lint typecheck clean

$(STAMP): setup.cfg pyproject.toml scripts/install_system.sh
	bash scripts/install_system.sh
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned to the CPU build that ships on this kind of machine; a bare `torch` pulls CUDA wheels.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/python -m restage.demo

# The whole suite, the multinode tests included (they start scripts/slurm_multinode.sh's three-node cluster; root).
# typecheck is a prerequisite, so it finishes (and a type error stops the build) before pytest starts, with -j too.
test: install typecheck
	$(BIN)/ruff check src tests bench
	bash scripts/run_tests.sh

# The whole 8/16-rank layout matrix and the layout fuzzer (tests/scale; about an hour on 2 cores), matrix cases over two
# nodes of scripts/slurm_multinode.sh's cluster (root), then every other test marked scale: the long cases kept out of
# make test's time bound (per-variant and multi-turn learning, the two-node time limit, some async parametrizations).
# RESTAGE_FUZZ_COUNT sets the fuzzer's seed count (default 8), RESTAGE_SCALE_REPORT=FILE collects each case's figures.
test-scale: install
	bash scripts/run_tests.sh --scale tests/scale tests/multinode/test_layout_scale_multinode.py
	bash scripts/run_tests.sh --scale -m scale --ignore=tests/scale --ignore=tests/multinode/test_layout_scale_multinode.py tests

test-multinode: install
	bash scripts/run_tests.sh -s -m multinode tests/multinode

# restage's GRPO-family losses against TRL's GRPOTrainer alone (tests/algorithms/test_trl_parity_on_cpu.py; make test
# runs it too: trl is in the test extra).
test-trl: install
	$(BIN)/python -m pytest -q tests/algorithms/test_trl_parity_on_cpu.py

test-fast: install
	$(BIN)/python -m pytest -q -m "not multirank and not slurm and not e2e and not multinode"

lint: install
	$(BIN)/ruff check src tests bench

# mypy's configuration (what is strict, which third-party packages are untyped) is setup.cfg's [mypy] sections.
typecheck: install
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info
