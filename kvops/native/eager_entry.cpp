// The Python module of the native build (kvops/native/__init__.py loads the build as one): paged_attention, the
// native paged attention kernel (paged_attention.cpp) called without the dispatcher, for the eager CPU path of
// kvops.paged_attention (_eager_native in kvops/ops/paged_attention.py, on calls _direct admits: plain CPU tensors,
// nothing tracing, no mode, profiler, functorch transform or autograd watching) without features. Same kernel,
// arguments, checks and errors (RuntimeError, the same messages) as torch.ops.kvops._paged_attention_native.

#include <torch/extension.h>

#include <optional>
#include <tuple>

namespace kvops_native {
std::tuple<at::Tensor, at::Tensor> paged_attention_eager(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cu_seqlens_q,
    const at::Tensor& seq_lens, const at::Tensor& block_table, int64_t max_seqlen_q, double scale, bool causal,
    int64_t window_left, double softcap, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale);
}  // namespace kvops_native

// (a Python function of the module, not an op: no schema; kvops/_library.py defines every schema)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("paged_attention", &kvops_native::paged_attention_eager,
             pybind11::call_guard<pybind11::gil_scoped_release>());  // as the dispatcher's Python binding: other threads run
}
