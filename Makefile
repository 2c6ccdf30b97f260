# Two entry points on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO_ARGS ?=

.PHONY: demo test lint typecheck unit bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dcp-plus demo $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check dcp_plus tests benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

test: lint typecheck
	$(PY) -m pytest tests $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.save_load $(BENCH_ARGS)

clean:
	rm -rf $(VENV) checkpoints .pytest_cache .mypy_cache .ruff_cache
