#!/usr/bin/env bash
# Compile the CUDA paged KV-cache ops (csrc/*.cu) with nvcc for a GPU target on a
# machine that may have no GPU and only a CPU build of torch. Two steps:
#   1. csrc/kv_kernels.cuh alone (no torch headers): every launcher instantiated
#      for every unit / index type, ptxas -v: registers and spills per kernel;
#   2. csrc/kv_ops_cuda.cu, the torch layer, compiled (not linked) against the
#      installed torch's headers. CPU wheels lack one generated header,
#      c10/cuda/impl/cuda_cmake_macros.h; a one-line stand-in is supplied then.
# It runs nothing: tests/paged/test_ops_kv.py runs the ops on a GPU (benchmarks/gpu_check.sh).
#
# Usage: make cuda-build-check (or bash csrc/compile_check.sh)     Env: PYTHON (default python3), ARCH (default 90), NVCC.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ARCH=${ARCH:-90}
NVCC=${NVCC:-$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")}
[ -x "$NVCC" ] || { echo "cuda-build-check: nvcc not found (set NVCC or CUDA_HOME)"; exit 1; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
"$NVCC" --version | tail -n 1

echo "== 1. csrc/kv_kernels.cuh standalone (sm_$ARCH)"
cat > "$TMP/instantiate.cu" <<'CU'
#include "kv_kernels.cuh"
// Every launcher with each index type; each launcher instantiates all four unit widths.
namespace spec_rl {
namespace kv_cuda {
#define WRITE(I) template cudaError_t launch_write_kv<I>(void*, const void*, const void*, const I*, int64_t, \
                                                         int64_t, int64_t, int64_t, int64_t, int, cudaStream_t);
#define GATHER(I) template cudaError_t launch_gather<I>(void*, void*, const void*, const I*, const int64_t*, int64_t, \
                                                        int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, \
                                                        cudaStream_t);
WRITE(int32_t) WRITE(int64_t) GATHER(int32_t) GATHER(int64_t)
}  // namespace kv_cuda
}  // namespace spec_rl
cudaError_t copy_all(void* c, void* s, const int64_t* m) {
  return spec_rl::kv_cuda::launch_copy_blocks(c, s, m, 1, 16, 1, 2, 0);
}
CU
"$NVCC" -c -std=c++17 -O3 -arch="sm_$ARCH" -Xptxas -v -I csrc "$TMP/instantiate.cu" -o "$TMP/instantiate.o" \
    > "$TMP/ptxas.log" 2>&1 || { cat "$TMP/ptxas.log"; exit 1; }
kernels=$(grep -c "Compiling entry function" "$TMP/ptxas.log")
spills=$(grep -Eo "[0-9]+ bytes spill stores" "$TMP/ptxas.log" | awk '{s += $1} END {print s + 0}')
regs=$(grep -Eo "Used [0-9]+ registers" "$TMP/ptxas.log" | awk '{if ($2 > m) m = $2} END {print m + 0}')
echo "kernels: $kernels, max registers: $regs, spill stores (total bytes): $spills"

echo "== 2. csrc/kv_ops_cuda.cu against torch's headers (sm_$ARCH)"
TORCH_INC=$($PY -c 'from torch.utils.cpp_extension import include_paths; print(" ".join("-I" + p for p in include_paths()))')
PY_INC=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
ABI=$($PY -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')
mkdir -p "$TMP/stub/c10/cuda/impl"
TORCH_ROOT=$($PY -c 'import os, torch; print(os.path.dirname(torch.__file__))')
if [ ! -f "$TORCH_ROOT/include/c10/cuda/impl/cuda_cmake_macros.h" ]; then
    echo "(CPU torch wheel: supplying c10/cuda/impl/cuda_cmake_macros.h)"
    printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$TMP/stub/c10/cuda/impl/cuda_cmake_macros.h"
fi
# shellcheck disable=SC2086
"$NVCC" -c -std=c++20 -O3 -arch="sm_$ARCH" --expt-relaxed-constexpr -Xcompiler -fPIC \
    -D_GLIBCXX_USE_CXX11_ABI="$ABI" -DTORCH_EXTENSION_NAME=_C -I csrc -I "$TMP/stub" $TORCH_INC -I "$PY_INC" \
    csrc/kv_ops_cuda.cu -o "$TMP/kv_ops_cuda.o" > "$TMP/torch_layer.log" 2>&1 || { cat "$TMP/torch_layer.log"; exit 1; }
echo "kv_ops_cuda.cu: compiled ($(wc -c < "$TMP/kv_ops_cuda.o") bytes of object code)"
[ "$spills" -eq 0 ] || { echo "cuda-build-check: kernels spill registers"; exit 1; }
echo "cuda-build-check: OK"
