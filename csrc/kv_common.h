// Paged KV-cache ops (spec_rl._C): shared declarations and argument checks.
//
// Cache layout, one tensor per layer (vLLM / FlashInfer "NHD"):
//   kv_cache[num_blocks, 2, block_size, kv_heads, head_dim], kv_cache[:, 0] keys,
//   kv_cache[:, 1] values. Logical position p of a sequence with block table bt
//   lives in slot bt[p / block_size] * block_size + p % block_size; negative
//   slots are padding and are skipped (vLLM's slot_mapping convention).
// The semantics are those of spec_rl/ops/reference.py; these ops re-check every
// argument so that a direct torch.ops.spec_rl.* call cannot write out of bounds.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>

namespace spec_rl {

// ---- argument checks (host; raise c10::Error -> RuntimeError in Python) ----

// kv_cache: 5-D [num_blocks, 2, block_size, H, D], float32/float16/bfloat16, contiguous.
void check_cache(const char* op, const at::Tensor& kv_cache);
// A K/V tensor: `dims`-D, same dtype and device as kv_cache.
void check_kv(const char* op, const char* name, const at::Tensor& t, const at::Tensor& kv_cache, int64_t dims);
// An index tensor: `dims`-D, int32 or int64, on kv_cache's device.
void check_index(const char* op, const char* name, const at::Tensor& t, const at::Tensor& kv_cache, int64_t dims);

// Range checks on CPU index tensors (the CUDA ops copy their indices to the host first).
// slots: [T] int32/int64; every slot < capacity (negative = padding).
void check_slot_range(const char* op, const at::Tensor& slots_cpu, int64_t capacity);
// Per sequence b with ends[b] > begins[b]: the block-table columns holding logical
// positions [begins[b], ends[b]) exist and hold block ids in [0, num_blocks).
// block_tables: [B, max_blocks], begins/ends: [B], all int64 on the CPU.
void check_table_range(const char* op, const at::Tensor& block_tables_cpu, const at::Tensor& begins_cpu,
                       const at::Tensor& ends_cpu, int64_t block_size, int64_t num_blocks);
// An index tensor as contiguous int64 on the CPU (copies a CUDA tensor to the host: synchronises).
at::Tensor host_long(const at::Tensor& t);
// starts/lengths of splice_from_dense: all >= 0 and src_starts + lengths <= seq_len.
void check_splice_ranges(const char* op, const at::Tensor& src_cpu, const at::Tensor& dst_cpu,
                         const at::Tensor& len_cpu, int64_t seq_len);
// block_mapping [M, 2] int64: ids in [0, num_blocks), no destination twice.
// Returns true when some destination block is also a source (the copy must be staged).
bool check_block_mapping(const char* op, const at::Tensor& mapping_cpu, int64_t num_blocks);

// Shape / dtype / device checks of each op (everything except index ranges), shared by
// the CPU and CUDA implementations so both reject exactly the same calls.
void validate_write_kv(const at::Tensor& kv_cache, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& slot_mapping);
void validate_splice(const at::Tensor& kv_cache, const at::Tensor& key, const at::Tensor& value,
                     const at::Tensor& block_tables, const at::Tensor& src_starts, const at::Tensor& dst_starts,
                     const at::Tensor& lengths);
void validate_copy_blocks(const at::Tensor& kv_cache, const at::Tensor& block_mapping);
void validate_gather(const at::Tensor& kv_cache, const at::Tensor& block_tables, const at::Tensor& lengths,
                     int64_t max_len);
// gather_kv: lengths >= 0 and max(lengths) <= max_len.
void check_gather_lengths(const char* op, const at::Tensor& len_cpu, int64_t max_len);

// ---- CPU ops (kv_ops_cpu.cpp) ----
void write_kv_cpu(at::Tensor& kv_cache, const at::Tensor& key, const at::Tensor& value, const at::Tensor& slot_mapping,
                  bool check_range);
void splice_from_dense_cpu(at::Tensor& kv_cache, const at::Tensor& key, const at::Tensor& value,
                           const at::Tensor& block_tables, const at::Tensor& src_starts,
                           const at::Tensor& dst_starts, const at::Tensor& lengths);
void copy_blocks_cpu(at::Tensor& kv_cache, const at::Tensor& block_mapping);
std::tuple<at::Tensor, at::Tensor> gather_kv_cpu(const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                                 const at::Tensor& lengths, int64_t max_len);

}  // namespace spec_rl
