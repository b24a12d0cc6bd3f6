# The README's two commands: `make demo` and `make test`. Both create .venv and install on their own;
# the install is skipped when pyproject.toml and constraints.txt have not changed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR ?= demo-out
PYTEST_ARGS ?=

.PHONY: demo test bench install clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/vsekit demo-data $(DEMO_DIR)/data --images 400 --seed 0
	$(BIN)/vsekit ingest karpathy $(DEMO_DIR)/data/dataset_demo.json --store $(DEMO_DIR)/demo.zarr --overwrite
	$(BIN)/vsekit info $(DEMO_DIR)/demo.zarr

test: $(STAMP)
	OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	@for f in bench/*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache
