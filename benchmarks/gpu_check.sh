#!/usr/bin/env bash
# The GPU check in one command: docs/gpu-check.md has its stages, budgets, options and what comes back in $OUT.
# Stages run as `gpu_check.sh __stage N` under their own `timeout` (run_stage below), the whole run under DEADLINE_S
# (a stage gets min(its timeout, time left - 15 s) and is skipped under 20 s); $OUT is rewritten after every stage
# and every 30 s (snapshot). SMOKE=1: the same code on the CPU (Triton interpreter, tiny shapes, no install).
set -u
CALLER_DIR=$PWD
cd "$(dirname "$0")/.."
SELF="$PWD/benchmarks/gpu_check.sh"

GPU_TESTS="tests/kernels/test_kernels_from_logits.py tests/kernels/test_kernels_lm_head.py tests/kernels/test_kernels_paged_attention.py
    tests/kernels/test_kernels_philox.py tests/kernels/test_kernels_gumbel.py tests/kernels/test_kernels_api.py tests/paged/test_ops_kv.py
    tests/paged/test_engine_paged.py tests/paged/test_static_decode.py
    tests/acceptance/test_verify_dispatch.py tests/acceptance/test_verify_invalid_scores.py"

# ---------------------------------------------------------------- stages (run as: gpu_check.sh __stage N)

note() { echo "NOTE: $*"; }

stage_1() {  # install
    if [ "$SMOKE" = 1 ]; then
        note "smoke: install skipped (make installed the package into the venv)"
    else
        export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
        nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total --format=csv || true
        rm -rf "$SITE" && mkdir -p "$SITE" || return 1
        if ls .whl/*.whl >/dev/null 2>&1; then
            echo "wheels from .whl/: $(cd .whl && ls ./*.whl | tr '\n' ' ')"
            $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl || return 1
        else
            note "no .whl/ wheels (make gpu-wheels): math-verify tests skip, Liger/CCE rows are skipped"
        fi
        $PY -m pip install -q --no-build-isolation --no-deps --no-compile --target "$SITE" . || return 1
    fi
    local need=--require-cuda
    [ "$SMOKE" = 1 ] && need=
    # Exit 3: installed and importable, but something is missing (CUDA ops, compiled kernels): later stages run.
    $PY -P benchmarks/gpu_env.py $need --json "$WORK/json/env.json"
}

stage_2() {  # GPU-relevant tests
    # -P: the installed spec_rl (with spec_rl.kernels and spec_rl._C), not the source tree's spec_rl/.
    if [ "$SMOKE" = 1 ]; then
        local out rc
        # shellcheck disable=SC2086
        out=$($PY -P -m pytest -q -p no:cacheprovider --collect-only $GPU_TESTS 2>&1); rc=$?
        echo "$out" | tail -n 3
        [ $rc = 0 ] || return 1
        note "skipped: no CUDA (the selection was collected; make test runs these files on the CPU)"
    else
        local per_test="--timeout=120"
        $PY -c 'import pytest_timeout' 2>/dev/null || { per_test=""; note "pytest-timeout absent: no per-test timeout"; }
        local workers=""  # Triton compiles on the CPU: one GPU, 8 test processes
        $PY -c 'import xdist' 2>/dev/null && workers="-n 8"
        # shellcheck disable=SC2086
        $PY -P -m pytest -q -p no:cacheprovider -rs -x $per_test $workers $GPU_TESTS
    fi
}

# bench SCRIPT RECORD GPU_ARGS SMOKE_ARGS: the benchmark SCRIPT.py at the GPU run's sizes (the smoke run's with
# SMOKE=1), its record in json/RECORD.json.
bench() {
    local args=$3
    [ "$SMOKE" = 1 ] && args=$4
    # shellcheck disable=SC2086
    $PY "benchmarks/$1.py" $args --json "$WORK/json/$2.json"
}

stage_3() {  # verification-kernel suite
    bench gpu_suite gpu_suite "" "--device cpu --n 64 --vocab 512 --d 64 --tokens-per-sample 16 --rep-ms 1"
}

stage_4() {  # paged decode attention
    bench bench_paged_attention paged_attention "" "--device cpu --batch 2 --context 40 --long-batch 1 \
--long-context 100 --q-heads 4 --kv-heads 2 --head-dim 32 --rep-ms 1"
}

stage_5() {  # paged engine
    local args="--preset qwen3-0.6b --new-tokens 64 --batch 16,64,128"
    [ "$HEADLINE" = 1 ] && args="--preset qwen3-0.6b --new-tokens 64 --batch 64 --skip-splice"
    bench bench_engine engine "$args" "--preset tiny --device cpu --batch 2,3 --new-tokens 6 --prompt-len 5"
}

stage_6() {  # rollout modes at the Qwen3-0.6B shape, then one decode step: concatenating vs in-place KV cache
    local rc=0
    bench bench_rollout rollout "--preset qwen3-0.6b --prompts 32 --group 4 --max-tokens 128" \
        "--preset tiny --device cpu --perturb 0.5" || rc=$?
    bench bench_decode_cache decode_cache "--preset qwen3-0.6b --rows 64 --context 512 --repeats 10" \
        "--preset tiny --device cpu --rows 3 --context 5 --repeats 2" || { [ "$rc" = 0 ] && rc=1; }
    return $rc
}

stage_7() {  # compile check: this Triton's ptxas, default configs
    unset TRITON_INTERPRET
    bench compile_check compile_check "--jobs 8" "--jobs 2"
}

stage_8() {  # the real-model rollout benchmark on the user's checkpoint, on the paged engine as RL runs it
    local model=$MODEL group=8 rows=256 tokens=128 engines=paged epochs=3 lr=${REAL_LR:-1e-6} modes="" rc=0 run
    # 256 prompts x G = 8 through 256 rows (continuous batching), then one full batch (32 x 8 rows at once)
    local runs="continuous:256 full-batch:32"
    if [ "$HEADLINE" = 1 ]; then
        runs="headline:256" epochs=2 lr=${REAL_LR:-1e-5} modes="--modes vanilla,spec,exact --no-tail --no-peers"
    fi
    if [ "$SMOKE" = 1 ] && [ -z "$model" ]; then  # a tiny random Llama with SmolLM2's tokenizer, tiny sizes
        model=$($PY benchmarks/real_model.py --tiny "$WORK/tiny-model") || return 1
        group=2 rows=3 tokens=6 epochs=2
        if [ "$HEADLINE" = 1 ]; then runs="headline:2"; else runs="continuous:2 full-batch:1" engines=paged,transformers; fi
    elif [ -z "$model" ] && [ "$HEADLINE" = 1 ]; then  # SmolLM2 from the installed wheel, or a GGUF carried in .whl/
        if ! ls .whl/*.gguf >/dev/null 2>&1 && ls .whl/*.gguf.part-* >/dev/null 2>&1; then  # carried in parts
            cat .whl/*.gguf.part-* > .whl/SmolLM2-135M-Instruct.Q4_1.gguf || return 1
        fi
        local gguf; gguf=$(ls .whl/*.gguf 2>/dev/null | head -n 1)
        if [ -n "$gguf" ]; then model=$($PY benchmarks/real_model.py --gguf "$gguf" "$WORK/smollm2")
        else model=$($PY benchmarks/real_model.py); fi || return 1
    elif [ -z "$model" ]; then
        note "skipped: no --model PATH given"
        return 0
    fi
    for run in $runs; do
        # shellcheck disable=SC2086
        $PY benchmarks/bench_real_model.py --model "$model" --prompts "${run#*:}" --group $group --engines $engines \
            --max-batch $rows --max-tokens $tokens --epochs $epochs --lr "$lr" $modes \
            --json "$WORK/json/real_model_rollout-${run%%:*}.json" || rc=1
    done
    return $rc
}

if [ "${1:-}" = "__stage" ]; then
    "stage_$2"
    exit $?
fi

MODEL=""
while [ $# -gt 0 ]; do
    case "$1" in
        --model) MODEL=${2:?--model needs a checkpoint folder}; shift 2 ;;
        *) echo "gpu_check.sh: unknown argument $1 (takes --model PATH)" >&2; exit 2 ;;
    esac
done
case "$MODEL" in "" | /*) ;; *) MODEL="$CALLER_DIR/$MODEL" ;; esac
[ -z "$MODEL" ] || [ -d "$MODEL" ] || { echo "gpu_check.sh: --model $MODEL is not a folder" >&2; exit 2; }

# ---------------------------------------------------------------- the runner

SMOKE=${SMOKE:-0}
HEADLINE=${HEADLINE:-0}
if [ "$HEADLINE" = 1 ]; then STAGES=${STAGES:-1 5 8}; DEADLINE_S=${DEADLINE_S:-300}; fi
PY=${PYTHON:-python3}
DEST=${OUT:-$PWD/gpu-check-out}
SITE=${SITE:-/tmp/spec-rl-site}
DEADLINE_S=${DEADLINE_S:-540}
STAGES=" ${STAGES:-1 2 3 4 5 6 7 8} "
CLEAN=":"  # a work folder of our own goes at exit (gpu-check.tar.gz in $DEST holds all of it)
[ -n "${WORK:-}" ] || { WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX") && CLEAN="rm -rf $WORK"; }
trap '$CLEAN' EXIT
mkdir -p "$DEST" "$WORK/logs" "$WORK/json" || exit 1
: > "$WORK/stages.tsv"
rm -f "$WORK/current.tsv"
export SMOKE HEADLINE PY SITE WORK MODEL PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export OUT="$WORK/json"  # scripts that default their JSON to $OUT write into the archive, never into $DEST
START=$(date +%s.%N)

since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'; }  # seconds since $1

if [ "$SMOKE" = 1 ]; then
    export TRITON_INTERPRET=1  # stage 7 unsets it (ptxas needs the compiler, not the interpreter)
    MODE="smoke (CPU, Triton interpreter, tiny shapes)"
else
    unset TRITON_INTERPRET
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    MODE="GPU$([ "$HEADLINE" = 1 ] && echo ", HEADLINE")"
fi
if [ -z "${SPEC_RL_COMMIT:-}" ] && git rev-parse HEAD >/dev/null 2>&1; then
    SPEC_RL_COMMIT=$(git rev-parse HEAD)$(git status --porcelain --untracked-files=no | grep -q . && echo -dirty)
fi
export SPEC_RL_COMMIT=${SPEC_RL_COMMIT:-unknown}
{
    printf 'mode\t%s\n' "$MODE"
    printf 'commit\t%s\n' "$SPEC_RL_COMMIT"
    printf 'started (UTC)\t%s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    printf 'host\t%s, %s CPUs\n' "$(uname -n)" "$(nproc 2>/dev/null || echo '?')"
    printf 'python\t%s\n' "$($PY -c 'import sys; print(sys.version.split()[0])' 2>&1)"
    printf 'deadline\t%s s (0 = none)\n' "$DEADLINE_S"
} > "$WORK/meta.tsv"

# summary.md and gpu-check.tar.gz, each written to a temporary name and renamed (atomic).
snapshot() {
    local tag=$$.${BASHPID:-0}
    if ! $PY benchmarks/gpu_report.py --work "$WORK" 2>"$WORK/logs/report.err"; then
        { echo "# spec-rl GPU check ($MODE)"; echo; echo "(gpu_report.py failed, see logs/report.err)"; echo;
          cat "$WORK/stages.tsv" "$WORK/current.tsv" 2>/dev/null; } > "$WORK/summary.md"
    fi
    cp "$WORK/summary.md" "$DEST/.summary.md.$tag" && mv -f "$DEST/.summary.md.$tag" "$DEST/summary.md"
    tar -czf "$DEST/.gpu-check.tar.gz.$tag" -C "$WORK" . 2>/dev/null
    [ -s "$DEST/.gpu-check.tar.gz.$tag" ] && mv -f "$DEST/.gpu-check.tar.gz.$tag" "$DEST/gpu-check.tar.gz"
    rm -f "$DEST/.gpu-check.tar.gz.$tag"
}

FAILED=0
ABORT=""
STAGE_PID=""
# run_stage NUM NAME BUDGET_S TIMEOUT_S: run stage_NUM under `timeout`, log it, record it, snapshot.
run_stage() {
    local num=$1 name=$2 budget=$3 limit=$4 status note rc t0 wall left skip=""
    LAST_RC=""
    case "$STAGES" in *" $num "*) ;; *) return 0 ;; esac
    local log="$WORK/logs/$num-$name.log"
    [ -n "$ABORT" ] && skip="skipped: $ABORT"
    if [ -z "$skip" ] && [ "$DEADLINE_S" != 0 ]; then
        left=$(awk -v d="$DEADLINE_S" -v e="$(since "$START")" 'BEGIN { printf "%d", d - e - 15 }')
        if [ "$left" -lt 20 ]; then skip="skipped: out of time"; elif [ "$left" -lt "$limit" ]; then limit=$left; fi
    fi
    if [ -n "$skip" ]; then
        printf '%s\t%s\t%s\t\t%s\t\t\n' "$num" "$name" "$skip" "$budget" >> "$WORK/stages.tsv"
        echo "== stage $num $name: $skip"
        snapshot; return 0
    fi
    echo; echo "== stage $num $name (H200 budget ${budget} s, timeout ${limit} s) at $(since "$START") s"
    printf '%s\t%s\trunning\t\t%s\t%s\t\n' "$num" "$name" "$budget" "$limit" > "$WORK/current.tsv"
    snapshot
    t0=$(date +%s.%N)
    # In the background and waited for, so that a TERM to this script is handled at once (on_signal).
    ( timeout -k 10 "$limit" bash "$SELF" __stage "$num" 2>&1 | tee "$log"; exit "${PIPESTATUS[0]}" ) &
    STAGE_PID=$!
    wait "$STAGE_PID"; rc=$?
    STAGE_PID=""
    LAST_RC=$rc
    wall=$(since "$t0")
    # NOTE lines: "skipped: why" marks a stage that could not run here; the others are notes.
    note=$(grep '^NOTE: ' "$log" | cut -c7- | grep -v '^skipped:' | paste -sd ';' - | sed 's/;/; /g' | tr '\t' ' ')
    skip=$(grep '^NOTE: skipped:' "$log" | tail -n 1 | cut -c7- | tr '\t' ' ')
    case $rc in
        0) status=${skip:-ok} ;;
        124 | 137) status="TIMEOUT after ${limit} s"; FAILED=1 ;;
        *) status="FAIL (exit $rc)"; FAILED=1 ;;
    esac
    rm -f "$WORK/current.tsv"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$num" "$name" "$status" "$wall" "$budget" "$limit" "$note" \
        >> "$WORK/stages.tsv"
    echo "== stage $num $name: $status, ${wall} s (H200 budget ${budget} s)"
    snapshot
}

refresher() {
    local s
    trap 'kill $s 2>/dev/null; exit 0' TERM
    while :; do sleep 30 & s=$!; wait $s; snapshot; done
}
on_signal() {
    [ -n "$STAGE_PID" ] && pkill -TERM -P "$STAGE_PID" 2>/dev/null
    [ -f "$WORK/current.tsv" ] && sed 's/\trunning\t/\tkilled (signal)\t/' "$WORK/current.tsv" >> "$WORK/stages.tsv"
    rm -f "$WORK/current.tsv"; snapshot; exit 143
}

if [ "$SMOKE" != 1 ] && ! $PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    printf '0\tpreflight\tFAIL: no CUDA device visible to %s (SMOKE=1 runs the CPU smoke check)\t\t\t\t\n' "$PY" \
        >> "$WORK/stages.tsv"
    snapshot; cat "$DEST/summary.md"; exit 1
fi
echo "gpu_check: $MODE; work folder $WORK; results in $DEST"
refresher > /dev/null 2>&1 & REFRESHER=$!
trap 'kill $REFRESHER 2>/dev/null; $CLEAN' EXIT
trap on_signal TERM INT

run_stage 1 install 60 300
# Install or import failed (not exit 3, "installed, something missing"): nothing later can run.
case "$LAST_RC" in "" | 0 | 3) ;; *) ABORT="install failed" ;; esac
run_stage 2 tests 120 240
run_stage 5 engine 90 180
run_stage 8 model 150 240
run_stage 3 suite 40 180
run_stage 4 paged 15 90
run_stage 6 rollout 100 165
run_stage 7 compile 10 120

kill $REFRESHER 2>/dev/null
wait $REFRESHER 2>/dev/null
snapshot
echo
cat "$DEST/summary.md"
echo "== stages (all results: $DEST/summary.md and $DEST/gpu-check.tar.gz)"
$PY benchmarks/gpu_report.py --work "$WORK" --stages-only
echo "gpu_check: total $(since "$START") s, $([ "$FAILED" = 0 ] && echo "every stage passed or was skipped" || echo "FAILED")"
exit $FAILED
