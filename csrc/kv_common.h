// Paged KV-cache ops (spec_rl._C): shared declarations and argument checks.
//
// Cache layout, one tensor per layer (vLLM / FlashInfer "NHD"):
//   kv_cache[num_blocks, 2, block_size, kv_heads, head_dim], kv_cache[:, 0] keys,
//   kv_cache[:, 1] values. Logical position p of a sequence with block table bt
//   lives in slot bt[p / block_size] * block_size + p % block_size; negative
//   slots are padding and are skipped (vLLM's slot_mapping convention).
// The semantics are those of spec_rl/ops/torch_kv.py (docs/design.md "Paged KV cache");
// these ops re-check every argument so that a direct torch.ops.spec_rl.* call cannot
// write out of bounds.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>

namespace torch {
class Library;
}  // namespace torch

namespace spec_rl {

// ---- argument checks (host; raise c10::Error -> RuntimeError in Python) ----

// kv_cache: 5-D [num_blocks, 2, block_size, H, D], float32/float16/bfloat16, contiguous.
void check_cache(const char* op, const at::Tensor& kv_cache);
// A K/V tensor: `dims`-D, same dtype and device as kv_cache.
void check_kv(const char* op, const char* name, const at::Tensor& t, const at::Tensor& kv_cache, int64_t dims);
// An index tensor: `dims`-D, int32 or int64, on kv_cache's device.
void check_index(const char* op, const char* name, const at::Tensor& t, const at::Tensor& kv_cache, int64_t dims);

// An index tensor as contiguous int64 on the CPU (copies a CUDA tensor to the host: synchronises).
at::Tensor host_long(const at::Tensor& t);

// Range checks on CPU index tensors (the CUDA ops copy their indices to the host first).
// slots: [T] int64; every slot < capacity (negative = padding).
void check_slot_range(const char* op, const at::Tensor& slots_cpu, int64_t capacity);
// block_mapping [M, 2] int64: ids in [0, num_blocks), no destination twice.
// Returns true when some destination block is also a source (the copy must be staged).
bool check_block_mapping(const char* op, const at::Tensor& mapping_cpu, int64_t num_blocks);

// gather_kv's indices as int64 host tensors, range-checked: 0 <= lengths <= max_len and
// the block-table entries of positions [0, lengths) exist and lie in [0, num_blocks).
struct GatherIndices {
  at::Tensor tables, len;
};
GatherIndices checked_gather_indices(const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                     const at::Tensor& lengths, int64_t max_len);

// Calls f(t.data_ptr<int32_t>()) or f(t.data_ptr<int64_t>()) by the dtype of an index
// tensor that check_index accepted (so that a kernel template is instantiated per index type).
template <typename F>
auto with_index_ptr(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kInt) return f(t.data_ptr<int32_t>());
  return f(t.data_ptr<int64_t>());
}

// Shape / dtype / device checks of each op (everything except index ranges), shared by
// the CPU and CUDA implementations so both reject exactly the same calls.
void validate_write_kv(const at::Tensor& kv_cache, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& slot_mapping);
void validate_copy_blocks(const at::Tensor& kv_cache, const at::Tensor& block_mapping);
void validate_gather(const at::Tensor& kv_cache, const at::Tensor& block_tables, const at::Tensor& lengths,
                     int64_t max_len);

// The three ops of one dispatch key (CPU or CUDA), registered by register_kv_ops.
struct KvOpImpls {
  void (*write_kv)(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);
  void (*copy_blocks)(at::Tensor&, const at::Tensor&);
  std::tuple<at::Tensor, at::Tensor> (*gather_kv)(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t);
};
// m.impl of each op (call inside TORCH_LIBRARY_IMPL(spec_rl, <key>, m)).
void register_kv_ops(torch::Library& m, const KvOpImpls& impls);

// ---- CPU ops (kv_ops_cpu.cpp) ----
void write_kv_cpu(at::Tensor& kv_cache, const at::Tensor& key, const at::Tensor& value, const at::Tensor& slot_mapping,
                  bool check_range);
void copy_blocks_cpu(at::Tensor& kv_cache, const at::Tensor& block_mapping);
std::tuple<at::Tensor, at::Tensor> gather_kv_cpu(const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                                 const at::Tensor& lengths, int64_t max_len);

}  // namespace spec_rl
