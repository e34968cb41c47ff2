// CPU implementations of the paged KV-cache ops (semantics: spec_rl/ops/torch_kv.py).
//
// All three ops only move bytes, so they work on raw rows of element_size()
// bytes and need no per-dtype code: one build serves float32, float16 and
// bfloat16. Loops run over the slot mapping / the sequence lengths, never over
// padded tensors, and are split across threads with at::parallel_for.
#include "kv_common.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace spec_rl {
namespace {

// Grain for at::parallel_for: at least 256 KiB of copying per task, so that small
// calls (a decode step's few rows) stay on one thread: waking OpenMP threads costs
// microseconds, far more than such a copy, and much more on an oversubscribed machine.
int64_t grain_for(int64_t bytes_per_item) {
  return std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, bytes_per_item));
}

}  // namespace

void write_kv_cpu(at::Tensor& kv_cache, const at::Tensor& key_in, const at::Tensor& value_in,
                  const at::Tensor& slot_mapping, bool /*check_range: always checked, it costs no sync on CPU*/) {
  validate_write_kv(kv_cache, key_in, value_in, slot_mapping);
  const int64_t block_size = kv_cache.size(2);
  const at::Tensor slots = host_long(slot_mapping);
  check_slot_range("spec_rl::write_kv", slots, kv_cache.size(0) * block_size);
  const int64_t num_tokens = slots.numel();
  if (num_tokens == 0) return;
  const at::Tensor key = key_in.contiguous();
  const at::Tensor value = value_in.contiguous();

  // One token row [H, D] is contiguous both in key/value and in the cache.
  const int64_t row = kv_cache.size(3) * kv_cache.size(4) * kv_cache.element_size();
  const int64_t block_bytes = 2 * block_size * row;
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  const int64_t* s = slots.data_ptr<int64_t>();
  at::parallel_for(0, num_tokens, grain_for(2 * row), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = s[t];
      if (slot < 0) continue;  // padding
      char* dst = cache + (slot / block_size) * block_bytes + (slot % block_size) * row;
      std::memcpy(dst, k + t * row, row);
      std::memcpy(dst + block_size * row, v + t * row, row);
    }
  });
}

void copy_blocks_cpu(at::Tensor& kv_cache, const at::Tensor& block_mapping) {
  validate_copy_blocks(kv_cache, block_mapping);
  const at::Tensor mapping = host_long(block_mapping);
  const bool overlap = check_block_mapping("spec_rl::copy_blocks", mapping, kv_cache.size(0));
  const int64_t rows = mapping.size(0);
  if (rows == 0) return;
  const int64_t block_bytes = kv_cache.numel() / kv_cache.size(0) * kv_cache.element_size();
  const int64_t* m = mapping.data_ptr<int64_t>();
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  if (!overlap) {
    at::parallel_for(0, rows, grain_for(block_bytes), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        if (m[2 * i] != m[2 * i + 1]) std::memcpy(cache + m[2 * i + 1] * block_bytes, cache + m[2 * i] * block_bytes, block_bytes);
      }
    });
    return;
  }
  // Some destination is also a source: read every source first (reference semantics).
  std::vector<char> staged(static_cast<size_t>(rows * block_bytes));
  at::parallel_for(0, rows, grain_for(block_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(staged.data() + i * block_bytes, cache + m[2 * i] * block_bytes, block_bytes);
  });
  at::parallel_for(0, rows, grain_for(block_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::memcpy(cache + m[2 * i + 1] * block_bytes, staged.data() + i * block_bytes, block_bytes);
  });
}

std::tuple<at::Tensor, at::Tensor> gather_kv_cpu(const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                                 const at::Tensor& lengths, int64_t max_len) {
  validate_gather(kv_cache, block_tables, lengths, max_len);
  const GatherIndices idx = checked_gather_indices(kv_cache, block_tables, lengths, max_len);
  const at::Tensor& len = idx.len;
  const at::Tensor& tables = idx.tables;

  const int64_t bsz = tables.size(0), heads = kv_cache.size(3), dim = kv_cache.size(4);
  at::Tensor key = at::empty({bsz, heads, max_len, dim}, kv_cache.options());
  at::Tensor value = at::empty({bsz, heads, max_len, dim}, kv_cache.options());
  if (key.numel() == 0) return {key, value};

  const int64_t block_size = kv_cache.size(2);
  const int64_t head_row = dim * kv_cache.element_size();
  const int64_t token_row = heads * head_row;
  const int64_t block_bytes = 2 * block_size * token_row;
  const int64_t cols = tables.size(1);
  const int64_t* bt = tables.data_ptr<int64_t>();
  const int64_t* n = len.data_ptr<int64_t>();
  const char* cache = static_cast<const char*>(kv_cache.data_ptr());
  char* k = static_cast<char*>(key.data_ptr());
  char* v = static_cast<char*>(value.data_ptr());

  // One task per (sequence, head): its dense rows [0, max_len) are contiguous in the output.
  at::parallel_for(0, bsz * heads, grain_for(2 * max_len * head_row), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / heads, h = i % heads;
      char* out_k = k + i * max_len * head_row;
      char* out_v = v + i * max_len * head_row;
      for (int64_t p = 0; p < n[b]; ++p) {
        const char* src = cache + bt[b * cols + p / block_size] * block_bytes + (p % block_size) * token_row +
                          h * head_row;
        std::memcpy(out_k + p * head_row, src, head_row);
        std::memcpy(out_v + p * head_row, src + block_size * token_row, head_row);
      }
      // Right padding: all-zero bits are +0.0 in float32, float16 and bfloat16.
      const int64_t pad = (max_len - n[b]) * head_row;
      std::memset(out_k + n[b] * head_row, 0, pad);
      std::memset(out_v + n[b] * head_row, 0, pad);
    }
  });
  return {key, value};
}

TORCH_LIBRARY_IMPL(spec_rl, CPU, m) {
  register_kv_ops(m, {&write_kv_cpu, &copy_blocks_cpu, &gather_kv_cpu});
}

}  // namespace spec_rl
