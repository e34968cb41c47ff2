#!/usr/bin/env bash
# One command for the GPU checks (verification kernels, paged KV ops, paged attention, engine):
#   1. install this checkout (no dependency resolution: the machine's torch and
#      triton are used as they are; wheels in .whl/ are installed first, e.g.
#      liger-kernel and cut-cross-entropy for the competitor rows),
#   2. the sm_90 compile check (registers / spills from ptxas),
#   2b. the paged KV ops: nvcc compile check of csrc/ and tests/engine/test_ops_kv.py on CUDA
#      (the install step builds spec_rl._C with its CUDA kernels),
#   3. the test suite on CUDA: pytest tests -m "not slow",
#   4. the benchmark suite (benchmarks/gpu_suite.py; SWEEP=1 adds the config sweep),
#   5. paged decode attention (benchmarks/bench_paged_attention.py) and the paged engine
#      (benchmarks/bench_engine.py: decode vs transformers generate, splice vs re-prefill),
#   6. the rollout benchmark (benchmarks/bench_rollout.py --preset qwen3-0.6b: generated tokens,
#      decode steps and rollout time of vanilla / histspec / spec / exact at fixed drafts).
# Full logs go to $OUT (default ./gpu-check-out); the short table is printed last.
#
# Usage: bash benchmarks/gpu_check.sh          (or: make gpu-check)
# Env:   PYTHON (default python3), OUT, SWEEP=1, SUITE_ARGS="--d 2048" (extra gpu_suite.py args),
#        ENGINE_ARGS="--new-tokens 256" (extra bench_engine.py args), ROLLOUT_ARGS (extra bench_rollout.py args),
#        SPEC_RL_COMMIT (recorded in the JSON when .git is absent).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

if ! $PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device visible to $PY; nothing to do."
    exit 0
fi
if [ -z "${SPEC_RL_COMMIT:-}" ] && git rev-parse HEAD >/dev/null 2>&1; then
    SPEC_RL_COMMIT=$(git rev-parse HEAD)$(git status --porcelain | grep -q . && echo -dirty)
    export SPEC_RL_COMMIT
fi

status=0
{
    echo "== install"
    if ls .whl/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/spec-rl-site .whl/*.whl && \
            export PYTHONPATH=/tmp/spec-rl-site${PYTHONPATH:+:$PYTHONPATH}
    fi
    $PY -m pip install -q --no-build-isolation --no-deps --force-reinstall . || exit 1
    $PY -c 'import torch, triton, spec_rl.kernels as K; print("torch", torch.__version__, "triton", triton.__version__, "device", torch.cuda.get_device_name(), "kernels available:", K.is_available("cuda"))'
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>/dev/null || true
} 2>&1 | tee "$OUT/install.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "gpu_check: install failed (see $OUT/install.log)"; exit 1; }
if [ -d /tmp/spec-rl-site ]; then export PYTHONPATH=/tmp/spec-rl-site${PYTHONPATH:+:$PYTHONPATH}; fi

echo "== compile check (sm_90)"
$PY benchmarks/compile_check.py --json "$OUT/compile_check.json" > "$OUT/compile_check.log" 2>&1 || status=1
tail -n 3 "$OUT/compile_check.log"

echo "== paged KV ops (csrc -> spec_rl._C, built by the install step)"
PYTHON=$PY bash benchmarks/compile_check_csrc.sh > "$OUT/compile_check_csrc.log" 2>&1 || status=1
tail -n 4 "$OUT/compile_check_csrc.log"
$PY -P -c 'import spec_rl.ops as o; print("spec_rl._C native cpu:", o.native_available("cpu"), "cuda:", o.native_available("cuda"))' 2>&1 | tee -a "$OUT/ops_kv.log"
$PY -P -m pytest -q -p no:cacheprovider tests/engine/test_ops_kv.py >> "$OUT/ops_kv.log" 2>&1 || status=1
tail -n 3 "$OUT/ops_kv.log"

echo "== tests (CUDA)"
# -P: do not put the repository root on sys.path, so the installed spec_rl
# (with spec_rl.kernels) is imported, not the source tree's spec_rl/.
$PY -P -m pytest -q -p no:cacheprovider tests -m "not slow" > "$OUT/tests.log" 2>&1
test_rc=$?
[ $test_rc -eq 0 ] || status=1
tail -n 5 "$OUT/tests.log"

echo "== benchmark suite"
sweep=""
[ "${SWEEP:-0}" = "1" ] && sweep="--sweep"
# shellcheck disable=SC2086
$PY benchmarks/gpu_suite.py --json "$OUT/gpu_suite.json" $sweep ${SUITE_ARGS:-} > "$OUT/gpu_suite.log" 2>&1 || status=1

echo "== paged decode attention benchmark"
# shellcheck disable=SC2086
$PY benchmarks/bench_paged_attention.py --json "$OUT/paged_attention.json" $sweep > "$OUT/paged_attention.log" 2>&1 || status=1

echo "== paged engine benchmark (decode vs transformers generate; splice vs re-prefill)"
# shellcheck disable=SC2086
$PY benchmarks/bench_engine.py --json "$OUT/engine.json" ${ENGINE_ARGS:-} > "$OUT/engine.log" 2>&1 || status=1

echo "== rollout benchmark (tokens, decode steps and time per mode at fixed drafts)"
# shellcheck disable=SC2086
$PY benchmarks/bench_rollout.py --preset qwen3-0.6b --json "$OUT/rollout.json" ${ROLLOUT_ARGS:-} > "$OUT/rollout.log" 2>&1 || status=1

echo
echo "== summary (full logs in $OUT)"
echo "tests exit code: $test_rc"
sed -n '/^=== spec-rl verification kernels/,$p' "$OUT/gpu_suite.log"
[ -s "$OUT/gpu_suite.json" ] || tail -n 30 "$OUT/gpu_suite.log"
sed -n '/^=== spec-rl paged decode attention/,$p' "$OUT/paged_attention.log"
[ -s "$OUT/paged_attention.json" ] || tail -n 30 "$OUT/paged_attention.log"
sed -n '/^=== spec-rl paged engine/,$p' "$OUT/engine.log"
[ -s "$OUT/engine.json" ] || tail -n 30 "$OUT/engine.log"
sed -n '/^bench_rollout:/,$p' "$OUT/rollout.log"
[ -s "$OUT/rollout.json" ] || tail -n 30 "$OUT/rollout.log"
exit $status
