// CUDA implementations of the paged KV-cache ops: argument checks (shared with the
// CPU ops, kv_common.cpp), then the kernels of kv_kernels.cuh on the current stream.
//
// Index ranges (slots, block ids, lengths) are checked on the host, which
// copies the index tensors there and synchronises, so a bad call raises
// RuntimeError before anything is written. While a CUDA graph is being captured
// no host copy is allowed; then only the in-kernel guards apply (a bad slot or
// block id is skipped, never written out of bounds) and copy_blocks always stages.
#include "kv_common.h"
#include "kv_kernels.cuh"

#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

namespace spec_rl {
namespace {

bool capturing() {
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

void check_launch(const char* op, cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

int elem_bytes(const at::Tensor& kv_cache) {
  return static_cast<int>(kv_cache.element_size());
}

}  // namespace

void write_kv_cuda(at::Tensor& kv_cache, const at::Tensor& key_in, const at::Tensor& value_in,
                   const at::Tensor& slot_mapping, bool check_range) {
  const char* op = "spec_rl::write_kv";
  validate_write_kv(kv_cache, key_in, value_in, slot_mapping);
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  if (check_range && !capturing()) check_slot_range(op, host_long(slot_mapping), kv_cache.size(0) * kv_cache.size(2));
  const int64_t num_tokens = slot_mapping.size(0);
  if (num_tokens == 0) return;
  const at::Tensor key = key_in.contiguous(), value = value_in.contiguous();
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t heads = kv_cache.size(3), dim = kv_cache.size(4), block_size = kv_cache.size(2);
  check_launch(op, with_index_ptr(slots, [&](const auto* slot_ids) {
                 return kv_cuda::launch_write_kv(kv_cache.data_ptr(), key.data_ptr(), value.data_ptr(), slot_ids,
                                                 num_tokens, heads, dim, block_size, kv_cache.size(0),
                                                 elem_bytes(kv_cache), c10::cuda::getCurrentCUDAStream());
               }));
}

void copy_blocks_cuda(at::Tensor& kv_cache, const at::Tensor& block_mapping) {
  const char* op = "spec_rl::copy_blocks";
  validate_copy_blocks(kv_cache, block_mapping);
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  const int64_t num_blocks = kv_cache.size(0);
  // Under capture the overlap cannot be inspected: staging is always correct.
  const bool staged = capturing() ? true : check_block_mapping(op, host_long(block_mapping), num_blocks);
  const int64_t rows = block_mapping.size(0);
  if (rows == 0 || num_blocks == 0) return;
  const at::Tensor mapping = block_mapping.to(at::kLong).contiguous();
  const int64_t block_numel = kv_cache.numel() / num_blocks;
  at::Tensor buffer;
  if (staged) buffer = at::empty({rows, block_numel}, kv_cache.options());
  check_launch(op, kv_cuda::launch_copy_blocks(kv_cache.data_ptr(), staged ? buffer.data_ptr() : nullptr,
                                               mapping.data_ptr<int64_t>(), rows, block_numel * elem_bytes(kv_cache),
                                               num_blocks, elem_bytes(kv_cache), c10::cuda::getCurrentCUDAStream()));
}

std::tuple<at::Tensor, at::Tensor> gather_kv_cuda(const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                                  const at::Tensor& lengths, int64_t max_len) {
  const char* op = "spec_rl::gather_kv";
  validate_gather(kv_cache, block_tables, lengths, max_len);
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  const int64_t num_blocks = kv_cache.size(0), block_size = kv_cache.size(2);
  // Range checks on host copies of the indices (one sync); the kernels read the device tensors.
  if (!capturing()) checked_gather_indices(kv_cache, block_tables, lengths, max_len);
  const int64_t bsz = block_tables.size(0), heads = kv_cache.size(3), dim = kv_cache.size(4);
  at::Tensor key = at::empty({bsz, heads, max_len, dim}, kv_cache.options());
  at::Tensor value = at::empty({bsz, heads, max_len, dim}, kv_cache.options());
  if (key.numel() == 0) return {key, value};
  const at::Tensor len = lengths.to(at::kLong).contiguous();
  const at::Tensor tables = block_tables.contiguous();
  check_launch(op, with_index_ptr(tables, [&](const auto* table_ids) {
                 return kv_cuda::launch_gather(key.data_ptr(), value.data_ptr(), kv_cache.data_ptr(), table_ids,
                                               len.data_ptr<int64_t>(), bsz, heads, max_len, dim, block_size,
                                               num_blocks, tables.size(1), elem_bytes(kv_cache),
                                               c10::cuda::getCurrentCUDAStream());
               }));
  return {key, value};
}

TORCH_LIBRARY_IMPL(spec_rl, CUDA, m) {
  register_kv_ops(m, {&write_kv_cuda, &copy_blocks_cuda, &gather_kv_cuda});
}

}  // namespace spec_rl
