# Two commands for a fresh machine (README): `make run` and `make test`.
# Both create .venv if needed, install torch first (a CPU build where one is
# on the local disk; set TORCH_SPEC to choose another), then this package with
# --no-build-isolation so pip never pulls a second (CUDA) torch.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.deps-stamp
ARGS ?=

.PHONY: run test install gpu-check clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml setup.py
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"
	$(PIP) install "setuptools>=70" wheel ninja
	$(PIP) install --no-build-isolation ".[test,triton]"
	touch $(STAMP)

install: $(STAMP)
	$(PIP) install --no-build-isolation --no-deps --force-reinstall --quiet .

run: install
	$(VENV)/bin/spec-rl train $(ARGS)

test: install
	$(VENV)/bin/pytest -q $(ARGS)

# One script for a lent GPU (uses the machine's torch + triton, no venv): build, GPU tests, suite; logs under $$OUT.
gpu-check:
	bash benchmarks/gpu_check.sh

clean:
	rm -rf build *.egg-info
