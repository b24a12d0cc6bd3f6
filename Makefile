# The README's two commands: `make demo` and `make test`. Both create .venv and install on their own;
# the install is skipped when pyproject.toml and constraints.txt have not changed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR ?= demo-out
PYTEST_ARGS ?=

.PHONY: demo test test-fast test-slow test-paper bench install clean gpu-check

install: $(STAMP)

# The install prints pip's own progress (each package collected, downloaded, installed) and a line per
# step with its time, so a slow first run on a loaded machine is never silent.
$(STAMP): pyproject.toml constraints.txt
	@echo "== install 1/3: the virtual environment $(VENV)"
	@t=$$(date +%s); test -x $(BIN)/python || $(PYTHON) -m venv $(VENV); echo "   done in $$(( $$(date +%s) - t )) s"
	@echo "== install 2/3: pip itself"
	@t=$$(date +%s); $(BIN)/python -m pip install --upgrade pip && echo "   done in $$(( $$(date +%s) - t )) s"
	@echo "== install 3/3: vsekit and its dependencies (torch is the bulk: minutes on a fresh machine)"
	@t=$$(date +%s); $(BIN)/python -m pip install -c constraints.txt -e ".[test,fast,slurm,bench]" \
		&& echo "   done in $$(( $$(date +%s) - t )) s"
	touch $(STAMP)

# each stage prints its elapsed time ("[k/20] STAGE: done in ..."); the report says its own
demo: $(STAMP)
	@echo "== demo: the demo pipeline (vsekit run demo)"
	$(BIN)/vsekit run demo --set DEMO_DIR=$(DEMO_DIR)
	@echo "== demo: the HTML report"
	@t=$$(date +%s); $(BIN)/vsekit report $(DEMO_DIR)/runs/fne-sh $(DEMO_DIR)/runs/seam-e $(DEMO_DIR)/runs/sman \
		$(DEMO_DIR)/runs/saf $(DEMO_DIR)/runs/sgr-temde --out $(DEMO_DIR)/report \
		&& echo "   report done in $$(( $$(date +%s) - t )) s"

# The tests, by what they cost (the rule for what is slow: tests/conftest.py, tests/README.md):
#   make test        every test not marked slow: the README's command (under 6 min on 2 cores)
#   make test-fast   the edit loop: `make test` less the end-to-end files (CLI pipelines, training
#                    runs, subprocesses): half of make test's CPU time; stops at the first failure
#   make test-slow   the slow tests that .ci/run runs after `make test`: process clusters (dask kill
#                    cases), SLURM and job arrays, kill-at-every-write-point sweeps, 20-seed learning
#                    sweeps, gpu-check's CPU mode, long end-to-end runs
#   make test-paper  the papers' full-dimension training cases (~30 min; not in CI)
# PYTEST_ARGS adds pytest arguments (files, -k, -x) to any of them.
PYTEST := OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q
# TEST_WORKERS=N runs make test in N pytest-xdist processes of one thread each (a module's tests in one
# process, tests/conftest.py); 0: one process of two threads. Default 2: idle on 2 cores the set took
# 4 min 12 s against 5 min 57 s in one process (tests/README.md).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(if $(filter-out 0,$(TEST_WORKERS)),OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile,$(PYTEST)) -m "not slow" $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PYTEST) -m "not slow and not e2e" -x $(PYTEST_ARGS)

# SLOW_WORKERS=N runs the slow set in N pytest processes (a module's tests together, the Grid Engine
# tests in one process: tests/conftest.py, tests/README.md). Default 0, one process: at -n 3 the
# whole set took as long (40 min 56 s) and a dask kill test hung (tests/README.md).
SLOW_WORKERS ?= 0
test-slow: $(STAMP)
	$(PYTEST) -m "slow and not paper" $(if $(filter-out 0,$(SLOW_WORKERS)),-n $(SLOW_WORKERS) --dist loadfile) $(PYTEST_ARGS)

test-paper: $(STAMP)
	$(PYTEST) -m paper $(PYTEST_ARGS)

bench: $(STAMP)
	@for f in bench/*.py; do echo "== $$f"; $(BIN)/python -P $$f || exit 1; done

# `make gpu-check` on a GPU machine (< 10 min): every CUDA path, figures appended to
# bench/results/gpu_check-<UTC>.jsonl as they are measured. Without network: `make gpu-check
# WHEELS=.whl` with a folder made by scripts/build_wheels.sh. CPU mode (CI):
# `make gpu-check GPU_CHECK_ARGS="--cpu --small"`. Uses .venv's python if there is one, else $(PYTHON).
GPU_CHECK_ARGS ?=
WHEELS ?=
gpu-check:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) scripts/gpu_check.py $(if $(WHEELS),--wheels $(WHEELS)) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache
