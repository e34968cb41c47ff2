// CUDA kernels of the paged KV-cache ops, free of torch headers (csrc/kv_ops_cuda.cu
// is the torch layer that launches them).
//
// Semantics: spec_rl/ops/torch_kv.py (docs/design.md "Paged KV cache"). Cache layout per layer:
// [num_blocks, 2, block_size, H, D] (NHD); block tables [B, cols]; slot =
// block * block_size + offset; negative slots are padding and are skipped.
//
// The ops only move bytes, so each kernel copies "units" U of 2, 4, 8 or 16
// bytes; the launchers pick the widest unit that divides the row and keeps
// every base pointer aligned (16-byte uint4 loads/stores for the usual
// head_dim 64/128 rows). Every index is bounds-checked in the kernel too: the
// torch layer raises on bad arguments before launching, but under CUDA-graph
// capture it cannot read indices on the host, and then the guards make an
// out-of-range slot / block id a skipped row (gather_kv: a zero row), never an
// out-of-bounds access.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace spec_rl {
namespace kv_cuda {

constexpr int kThreads = 128;
constexpr int64_t kMaxGrid = 65536;  // grid-stride loops above this many CTAs

// write_kv: CTA w copies token w's key and value rows [H * D] into its slot.
template <typename U, typename I>
__global__ void write_kv_kernel(U* __restrict__ cache, const U* __restrict__ key, const U* __restrict__ value,
                                const I* __restrict__ slots, int64_t num_tokens, int64_t row_units,
                                int64_t block_size, int64_t num_slots) {
  for (int64_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
    const int64_t slot = static_cast<int64_t>(slots[t]);
    if (slot < 0 || slot >= num_slots) continue;  // padding (or, under capture, a bad slot)
    U* dst_k = cache + ((slot / block_size) * 2 * block_size + slot % block_size) * row_units;
    U* dst_v = dst_k + block_size * row_units;
    const U* src_k = key + t * row_units;
    const U* src_v = value + t * row_units;
    for (int64_t u = threadIdx.x; u < row_units; u += blockDim.x) {
      dst_k[u] = src_k[u];
      dst_v[u] = src_v[u];
    }
  }
}

// gather_kv: CTA w writes sequence b = w / tiles, positions [tile * (w % tiles), ...)
// of the dense outputs [B, H, max_len, D]; positions >= lengths[b] get zeros.
template <typename U, typename TBL>
__global__ void gather_kernel(U* __restrict__ out_k, U* __restrict__ out_v, const U* __restrict__ cache,
                              const TBL* __restrict__ tables, const int64_t* __restrict__ lengths, int64_t bsz,
                              int64_t heads, int64_t max_len, int64_t d_units, int64_t block_size,
                              int64_t num_blocks, int64_t cols, int64_t tile) {
  const int64_t tiles = (max_len + tile - 1) / tile;
  const int64_t per_token = heads * d_units;
  for (int64_t w = blockIdx.x; w < bsz * tiles; w += gridDim.x) {
    const int64_t b = w / tiles;
    const int64_t n = lengths[b];
    const int64_t lo = (w % tiles) * tile;
    const int64_t hi = lo + tile < max_len ? lo + tile : max_len;
    for (int64_t i = threadIdx.x; i < (hi - lo) * per_token; i += blockDim.x) {
      const int64_t p = lo + i / per_token;
      const int64_t h = (i % per_token) / d_units;
      const int64_t u = i % d_units;
      const int64_t out = ((b * heads + h) * max_len + p) * d_units + u;
      U k = U(), v = U();  // zero bits: +0.0 in every float format
      const int64_t c = p / block_size;
      if (p < n && c < cols) {
        const int64_t block = static_cast<int64_t>(tables[b * cols + c]);
        if (block >= 0 && block < num_blocks) {
          const int64_t in = ((block * 2 * block_size + p % block_size) * heads + h) * d_units + u;
          k = cache[in];
          v = cache[in + block_size * per_token];
        }
      }
      out_k[out] = k;
      out_v[out] = v;
    }
  }
}

// copy_blocks, one pass per mode: 0 cache[dst] = cache[src]; 1 staged[i] = cache[src];
// 2 cache[dst] = staged[i]. mapping: [rows, 2] int64 (src, dst). Modes 1 + 2 read
// every source before any destination is written (a block may be both).
template <typename U>
__global__ void copy_blocks_kernel(U* __restrict__ cache, U* __restrict__ staged, const int64_t* __restrict__ mapping,
                                   int64_t rows, int64_t block_units, int64_t num_blocks, int64_t chunk, int mode) {
  const int64_t chunks = (block_units + chunk - 1) / chunk;
  for (int64_t w = blockIdx.x; w < rows * chunks; w += gridDim.x) {
    const int64_t r = w / chunks;
    const int64_t src = mapping[2 * r], dst = mapping[2 * r + 1];
    if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) continue;
    const U* from = mode == 2 ? staged + r * block_units : cache + src * block_units;
    U* to = mode == 1 ? staged + r * block_units : cache + dst * block_units;
    const int64_t lo = (w % chunks) * chunk;
    const int64_t hi = lo + chunk < block_units ? lo + chunk : block_units;
    for (int64_t u = lo + threadIdx.x; u < hi; u += blockDim.x) to[u] = from[u];
  }
}

// ---- launchers: raw pointers, sizes in elements of elem_bytes; return the launch error ----

// Widest unit (16, 8, 4 or elem_bytes bytes) dividing row_bytes with every pointer aligned to it.
inline int unit_bytes(int64_t row_bytes, int elem_bytes, const void* const* ptrs, int num_ptrs) {
  for (int u = 16; u > elem_bytes; u /= 2) {
    bool ok = row_bytes % u == 0;
    for (int i = 0; ok && i < num_ptrs; ++i) ok = reinterpret_cast<uintptr_t>(ptrs[i]) % u == 0;
    if (ok) return u;
  }
  return elem_bytes;
}

inline unsigned grid_for(int64_t work) {
  return static_cast<unsigned>(work < 1 ? 1 : (work < kMaxGrid ? work : kMaxGrid));
}

// Calls f(U{}) with U the unsigned type of `bytes` bytes.
template <typename F>
inline cudaError_t with_unit(int bytes, F&& f) {
  switch (bytes) {
    case 16: return f(uint4{});
    case 8: return f(uint2{});
    case 4: return f(uint32_t{});
    case 2: return f(uint16_t{});
    default: return cudaErrorInvalidValue;
  }
}

// Tokens per CTA so that one CTA moves about 1024 units.
inline int64_t tile_for(int64_t units_per_token) {
  const int64_t t = 1024 / (units_per_token < 1 ? 1 : units_per_token);
  return t < 1 ? 1 : t;
}

template <typename I>
cudaError_t launch_write_kv(void* cache, const void* key, const void* value, const I* slots, int64_t num_tokens,
                            int64_t heads, int64_t dim, int64_t block_size, int64_t num_blocks, int elem_bytes,
                            cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const int64_t row_bytes = heads * dim * elem_bytes;
  const void* ptrs[3] = {cache, key, value};
  return with_unit(unit_bytes(row_bytes, elem_bytes, ptrs, 3), [&](auto unit) {
    using U = decltype(unit);
    write_kv_kernel<U, I><<<grid_for(num_tokens), kThreads, 0, stream>>>(
        static_cast<U*>(cache), static_cast<const U*>(key), static_cast<const U*>(value), slots, num_tokens,
        row_bytes / static_cast<int64_t>(sizeof(U)), block_size, num_blocks * block_size);
    return cudaGetLastError();
  });
}

// Launch shape of gather: rows of a head's D elements moved in units U, `tile`
// tokens per CTA, bsz sequences of `len` positions.
struct TokenTiles {
  int64_t d_units;
  int64_t tile;
  unsigned grid;
};

// Picks the unit for rows of row_bytes at the three base pointers, then calls
// launch(U{}, tiles) with the matching tiling; returns its launch error.
template <typename F>
inline cudaError_t with_token_tiles(int64_t row_bytes, int elem_bytes, const void* const* ptrs, int64_t heads,
                                    int64_t bsz, int64_t len, F&& launch) {
  return with_unit(unit_bytes(row_bytes, elem_bytes, ptrs, 3), [&](auto unit) {
    const int64_t d_units = row_bytes / static_cast<int64_t>(sizeof(unit));
    const int64_t tile = tile_for(heads * d_units);
    return launch(unit, TokenTiles{d_units, tile, grid_for(bsz * ((len + tile - 1) / tile))});
  });
}

template <typename TBL>
cudaError_t launch_gather(void* out_k, void* out_v, const void* cache, const TBL* tables, const int64_t* lengths,
                          int64_t bsz, int64_t heads, int64_t max_len, int64_t dim, int64_t block_size,
                          int64_t num_blocks, int64_t cols, int elem_bytes, cudaStream_t stream) {
  if (bsz == 0 || max_len == 0) return cudaSuccess;
  const void* ptrs[3] = {out_k, out_v, cache};
  return with_token_tiles(dim * elem_bytes, elem_bytes, ptrs, heads, bsz, max_len, [&](auto unit, TokenTiles t) {
    using U = decltype(unit);
    gather_kernel<U, TBL><<<t.grid, kThreads, 0, stream>>>(
        static_cast<U*>(out_k), static_cast<U*>(out_v), static_cast<const U*>(cache), tables, lengths, bsz, heads,
        max_len, t.d_units, block_size, num_blocks, cols, t.tile);
    return cudaGetLastError();
  });
}

// staged: nullptr for a direct copy (no destination is also a source), else a
// buffer of rows * block_bytes bytes: every source is read before any write.
inline cudaError_t launch_copy_blocks(void* cache, void* staged, const int64_t* mapping, int64_t rows,
                                      int64_t block_bytes, int64_t num_blocks, int elem_bytes, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const void* ptrs[2] = {cache, staged != nullptr ? staged : cache};
  return with_unit(unit_bytes(block_bytes, elem_bytes, ptrs, 2), [&](auto unit) {
    using U = decltype(unit);
    const int64_t block_units = block_bytes / static_cast<int64_t>(sizeof(U));
    const int64_t chunk = 8 * kThreads;
    const unsigned grid = grid_for(rows * ((block_units + chunk - 1) / chunk));
    U* c = static_cast<U*>(cache);
    U* s = static_cast<U*>(staged);
    if (staged == nullptr) {
      copy_blocks_kernel<U><<<grid, kThreads, 0, stream>>>(c, s, mapping, rows, block_units, num_blocks, chunk, 0);
      return cudaGetLastError();
    }
    copy_blocks_kernel<U><<<grid, kThreads, 0, stream>>>(c, s, mapping, rows, block_units, num_blocks, chunk, 1);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    copy_blocks_kernel<U><<<grid, kThreads, 0, stream>>>(c, s, mapping, rows, block_units, num_blocks, chunk, 2);
    return cudaGetLastError();
  });
}

}  // namespace kv_cuda
}  // namespace spec_rl
