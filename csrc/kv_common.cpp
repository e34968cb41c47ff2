// Argument checks shared by the CPU and CUDA paged KV-cache ops (see kv_common.h).
#include "kv_common.h"

#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <vector>

namespace spec_rl {
namespace {

// Per sequence b with ends[b] > begins[b]: the block-table columns holding logical
// positions [begins[b], ends[b]) exist and hold block ids in [0, num_blocks).
// block_tables: [B, max_blocks], begins/ends: [B], all int64 on the CPU.
void check_table_range(const char* op, const at::Tensor& block_tables_cpu, const at::Tensor& begins_cpu,
                       const at::Tensor& ends_cpu, int64_t block_size, int64_t num_blocks) {
  const int64_t bsz = block_tables_cpu.size(0);
  const int64_t cols = block_tables_cpu.size(1);
  const int64_t* bt = block_tables_cpu.data_ptr<int64_t>();
  const int64_t* begins = begins_cpu.data_ptr<int64_t>();
  const int64_t* ends = ends_cpu.data_ptr<int64_t>();
  for (int64_t b = 0; b < bsz; ++b) {
    if (ends[b] <= begins[b]) continue;  // zero-length sequence: touches no block
    const int64_t first = begins[b] / block_size;
    const int64_t last = (ends[b] - 1) / block_size;  // inclusive
    TORCH_CHECK(last < cols, op, ": sequence ", b, " needs ", last + 1, " blocks but block_tables has ", cols,
                " columns");
    for (int64_t c = first; c <= last; ++c) {
      const int64_t id = bt[b * cols + c];
      TORCH_CHECK(id >= 0 && id < num_blocks, op, ": block_tables[", b, ", ", c, "] = ", id,
                  " is out of range [0, ", num_blocks, ")");
    }
  }
}

// gather_kv: lengths >= 0 and max(lengths) <= max_len.
void check_gather_lengths(const char* op, const at::Tensor& len_cpu, int64_t max_len) {
  const int64_t* len = len_cpu.data_ptr<int64_t>();
  for (int64_t b = 0; b < len_cpu.numel(); ++b) {
    TORCH_CHECK(len[b] >= 0, op, ": lengths[", b, "] = ", len[b], " must be >= 0");
    TORCH_CHECK(len[b] <= max_len, op, ": lengths[", b, "] = ", len[b], " exceeds max_len = ", max_len);
  }
}

}  // namespace

void check_cache(const char* op, const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.defined(), op, ": kv_cache is undefined");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(1) == 2, op,
              ": kv_cache must have shape [num_blocks, 2, block_size, kv_heads, head_dim], got ",
              kv_cache.sizes());
  const auto dt = kv_cache.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, op,
              ": kv_cache dtype must be float32, float16 or bfloat16, got ", dt);
  TORCH_CHECK(kv_cache.is_contiguous(), op,
              ": kv_cache must be contiguous (allocate it with torch.empty/zeros; it is written in place)");
  TORCH_CHECK(kv_cache.size(2) > 0, op, ": kv_cache block_size (dim 2) must be > 0");
}

void check_kv(const char* op, const char* name, const at::Tensor& t, const at::Tensor& kv_cache, int64_t dims) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.dim() == dims, op, ": ", name, " must be ", dims, "-D, got shape ", t.sizes());
  TORCH_CHECK(t.device() == kv_cache.device(), op, ": ", name, " is on ", t.device(), " but kv_cache is on ",
              kv_cache.device(), "; move it with .to(kv_cache.device)");
  TORCH_CHECK(t.scalar_type() == kv_cache.scalar_type(), op, ": ", name, " dtype ", t.scalar_type(),
              " differs from kv_cache dtype ", kv_cache.scalar_type(), "; cast it first");
}

void check_index(const char* op, const char* name, const at::Tensor& t, const at::Tensor& kv_cache, int64_t dims) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, ": ", name,
              " must be int32 or int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dims, op, ": ", name, " must be ", dims, "-D, got shape ", t.sizes());
  TORCH_CHECK(t.device() == kv_cache.device(), op, ": ", name, " is on ", t.device(), " but kv_cache is on ",
              kv_cache.device(), "; move it with .to(kv_cache.device)");
}

at::Tensor host_long(const at::Tensor& t) {
  return t.to(at::kCPU).to(at::kLong).contiguous();
}

void check_slot_range(const char* op, const at::Tensor& slots_cpu, int64_t capacity) {
  const int64_t* s = slots_cpu.data_ptr<int64_t>();
  const int64_t n = slots_cpu.numel();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(s[i] < capacity, op, ": slot_mapping[", i, "] = ", s[i], " is >= the cache capacity ", capacity,
                " (num_blocks * block_size); allocate more blocks or fix the slot mapping");
  }
}

bool check_block_mapping(const char* op, const at::Tensor& mapping_cpu, int64_t num_blocks) {
  const int64_t* m = mapping_cpu.data_ptr<int64_t>();
  const int64_t rows = mapping_cpu.size(0);
  // 0: unused, bit 1: a source, bit 2: a destination.
  std::vector<uint8_t> role(static_cast<size_t>(num_blocks), 0);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < 2; ++j) {
      const int64_t id = m[2 * i + j];
      TORCH_CHECK(id >= 0 && id < num_blocks, op, ": block_mapping[", i, ", ", j, "] = ", id,
                  " is out of range [0, ", num_blocks, ")");
    }
    const int64_t dst = m[2 * i + 1];
    TORCH_CHECK(!(role[dst] & 2), op, ": block_mapping lists destination block ", dst,
                " twice; each destination may be written once");
    role[dst] |= 2;
  }
  bool overlap = false;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t src = m[2 * i];
    const int64_t dst = m[2 * i + 1];
    // A source that another row overwrites must be read before that write.
    if (src != dst && (role[src] & 2)) overlap = true;
  }
  return overlap;
}

void validate_write_kv(const at::Tensor& kv_cache, const at::Tensor& key, const at::Tensor& value,
                       const at::Tensor& slot_mapping) {
  const char* op = "spec_rl::write_kv";
  check_cache(op, kv_cache);
  check_kv(op, "key", key, kv_cache, 3);
  check_kv(op, "value", value, kv_cache, 3);
  check_index(op, "slot_mapping", slot_mapping, kv_cache, 1);
  const int64_t heads = kv_cache.size(3), dim = kv_cache.size(4);
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(0) == slot_mapping.size(0) && key.size(1) == heads &&
                  key.size(2) == dim,
              op, ": key ", key.sizes(), " and value ", value.sizes(), " must both be [T, ", heads, ", ", dim,
              "] with T = len(slot_mapping) = ", slot_mapping.size(0));
}

void validate_copy_blocks(const at::Tensor& kv_cache, const at::Tensor& block_mapping) {
  const char* op = "spec_rl::copy_blocks";
  check_cache(op, kv_cache);
  check_index(op, "block_mapping", block_mapping, kv_cache, 2);
  TORCH_CHECK(block_mapping.size(1) == 2, op, ": block_mapping must be [M, 2] (src, dst), got ",
              block_mapping.sizes());
}

void validate_gather(const at::Tensor& kv_cache, const at::Tensor& block_tables, const at::Tensor& lengths,
                     int64_t max_len) {
  const char* op = "spec_rl::gather_kv";
  check_cache(op, kv_cache);
  check_index(op, "block_tables", block_tables, kv_cache, 2);
  check_index(op, "lengths", lengths, kv_cache, 1);
  TORCH_CHECK(lengths.size(0) == block_tables.size(0), op, ": lengths has ", lengths.size(0),
              " entries, block_tables ", block_tables.size(0), " rows");
  TORCH_CHECK(max_len >= 0, op, ": max_len must be >= 0, got ", max_len);
}

GatherIndices checked_gather_indices(const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                     const at::Tensor& lengths, int64_t max_len) {
  const char* op = "spec_rl::gather_kv";
  GatherIndices idx{host_long(block_tables), host_long(lengths)};
  check_gather_lengths(op, idx.len, max_len);
  check_table_range(op, idx.tables, at::zeros_like(idx.len), idx.len, kv_cache.size(2), kv_cache.size(0));
  return idx;
}

void register_kv_ops(torch::Library& m, const KvOpImpls& impls) {
  m.impl("write_kv", impls.write_kv);
  m.impl("copy_blocks", impls.copy_blocks);
  m.impl("gather_kv", impls.gather_kv);
}

}  // namespace spec_rl
