// The Python module of the native build (kvops/native/__init__.py loads the build as one): paged_attention, the
// native paged attention kernel (paged_attention.cpp) called without the dispatcher, for the eager CPU path of
// kvops.paged_attention (_eager_native in kvops/ops/paged_attention.py, on calls _direct admits: plain CPU tensors,
// nothing tracing, no mode, profiler, functorch transform or autograd watching) without features. Same kernel,
// arguments, checks and errors (RuntimeError, the same messages) as torch.ops.kvops._paged_attention_native, and one
// more argument, return_lse: (out, lse) as the op returns them, or out alone (no LSE tensor allocated).

#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

namespace kvops_native {
std::tuple<at::Tensor, at::Tensor> paged_attention_eager(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cu_seqlens_q,
    const at::Tensor& seq_lens, const at::Tensor& block_table, int64_t max_seqlen_q, double scale, bool causal,
    int64_t window_left, double softcap, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale, bool with_lse);

namespace {
pybind11::object paged_attention(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cu_seqlens_q,
    const at::Tensor& seq_lens, const at::Tensor& block_table, int64_t max_seqlen_q, double scale, bool causal,
    int64_t window_left, double softcap, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale, bool return_lse) {
  std::tuple<at::Tensor, at::Tensor> result;
  {
    pybind11::gil_scoped_release no_gil;  // as the dispatcher's Python binding: other threads run meanwhile
    result = paged_attention_eager(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale,
                                   causal, window_left, softcap, sinks, k_scale, v_scale, return_lse);
  }
  if (return_lse) return pybind11::make_tuple(std::get<0>(result), std::get<1>(result));
  return pybind11::cast(std::get<0>(result));
}

// eager_key(*tensors): what _direct (kvops/ops/paged_attention.py) asks of the tensor arguments of an eager call, in
// one pass: None unless each is None or a plain CPU torch.Tensor (its exact type, no subclass) that, with grad mode on,
// does not require grad; then the validator's memo key of them (check_paged_attention): bytes naming each argument's
// dtype and shape in order (None: a marker), all the validator reads of a CPU tensor.
pybind11::object eager_key(const pybind11::args& tensors) {
  std::string key;
  const bool grad = c10::GradMode::is_enabled();
  for (const pybind11::handle& h : tensors) {
    PyObject* o = h.ptr();
    if (o == Py_None) {
      key.push_back('\xff');
      continue;
    }
    if (Py_TYPE(o) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return pybind11::none();
    const at::Tensor& t = THPVariable_Unpack(o);
    if (!t.is_cpu() || (grad && t.requires_grad()) || t.is_nested() ||
        t.unsafeGetTensorImpl()->has_symbolic_sizes_strides())
      return pybind11::none();  // (nested or symbolic: no plain sizes; the dispatcher decides)
    const int64_t head[2] = {static_cast<int64_t>(t.scalar_type()), t.dim()};
    key.append(reinterpret_cast<const char*>(head), sizeof(head));
    const at::IntArrayRef sizes = t.sizes();
    key.append(reinterpret_cast<const char*>(sizes.data()), sizes.size() * sizeof(int64_t));
  }
  return pybind11::bytes(key);
}
}  // namespace
}  // namespace kvops_native

// (a Python function of the module, not an op: no schema; kvops/_library.py defines every schema)
PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("paged_attention", &kvops_native::paged_attention);
  module.def("eager_key", &kvops_native::eager_key);
}
