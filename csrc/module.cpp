// spec_rl._C: operator schemas of the paged KV-cache ops and the Python module.
//
// Importing spec_rl._C loads this library; its static initialisers register the
// schemas below with torch.library (namespace `spec_rl`), and kv_ops_cpu.cpp /
// kv_ops_cuda.cu register the CPU / CUDA kernels. The module itself exposes
// nothing: call the ops as torch.ops.spec_rl.<name>, or better through the
// validated wrappers in spec_rl.ops.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(spec_rl, m) {
  // Mutating ops declare their written argument as Tensor(a!) so that
  // functionalisation / torch.compile know kv_cache changes in place.
  // check_range=false skips the host-side slot range check (a device->host copy and a sync
  // on CUDA) for callers that built the slot mapping on the host and checked it there; the
  // kernels still skip any slot outside the cache, so nothing is written out of bounds.
  m.def("write_kv(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slot_mapping, bool check_range=True) -> ()");
  m.def("copy_blocks(Tensor(a!) kv_cache, Tensor block_mapping) -> ()");
  m.def("gather_kv(Tensor kv_cache, Tensor block_tables, Tensor lengths, int max_len) -> (Tensor, Tensor)");
}

// A plain (no pybind11) extension module: keeps the build short.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",
      "spec-rl native ops; importing registers torch.ops.spec_rl.{write_kv, copy_blocks, gather_kv}.",
      -1,
      nullptr,
  };
  return PyModule_Create(&module_def);
}
