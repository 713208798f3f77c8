// Native CPU kernel for kvops::paged_cache_write (docs/semantics.md §3), registered as kvops::_paged_write_native.
//
// Built with paged_attention.cpp into one extension by kvops/native/__init__.py. Called by kvops.paged_cache_write
// on CPU after the op's validator ran (kvops/_checks/paged_write.py), so this file trusts its arguments' metadata
// (ranks, shapes, dtypes, devices, head slice) and only reads slot values: caches are NHD views
// [P, block_size, H_kv, D] with any strides (an HND cache arrives as its transpose(1, 2) view), key/value
// [N', H_in, D] with any strides, slot_mapping [N] int32/int64.
//
// One call writes both caches, as vLLM's CPU reshape_and_cache does: slots are read once to check them all (a slot
// >= P * block_size returns its index and nothing is written, so a batch is never left partly written), then each
// token with a slot >= 0 is routed once and its K and V rows are copied: one memcpy per token and cache when the
// heads of a row are contiguous in both source and cache, one per head when only the head_dim is, elementwise
// otherwise. For float8_e4m3fn caches the first N key/value rows are first quantized with the composite kernel's
// vectorized torch ops (clamp(x / scale, +-448) in fp32, round to nearest even; scale [1] or [H_kv], input head h
// uses scale[h0 + h]), then their bytes are copied the same way. Tokens run under at::parallel_for. Duplicate
// slots: which token lands is unspecified. A key/value overlapping a cache (a view of it) is copied first, so the
// sources are read as they were before the call, as in compiled code (fp8 sources are fresh quantized copies anyway).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

namespace kvops_native {
namespace {

constexpr float FP8_MAX = 448.f;

struct Rows {  // one cache and its source rows
  const char* src;
  int64_t s0, s1, s2;  // source strides (elements) of token, head, dim
  char* dst;
  int64_t d0, d1, d2, d3;  // cache strides (elements) of block, row, head, dim
  int64_t heads, dim, src_size, dst_size;
};

// x[:n] / scale in fp32, saturated to +-448, to float8_e4m3fn (round to nearest even): the composite kernel's ops
at::Tensor quantize(const at::Tensor& x, const at::Tensor& scale, int64_t h0, int64_t n) {
  const at::Tensor s = scale.size(0) == 1 ? scale : scale.narrow(0, h0, x.size(1));
  return x.narrow(0, 0, n).to(at::kFloat).div(s.view({1, -1, 1})).clamp_(-FP8_MAX, FP8_MAX).to(at::kFloat8_e4m3fn);
}

// Whether a source may share bytes with a cache (same storage and intersecting byte ranges: conservative, cheap).
bool overlaps(const at::Tensor& x, const at::Tensor& cache) {
  if (x.numel() == 0 || cache.numel() == 0 || !x.is_alias_of(cache)) return false;
  auto span = [](const at::Tensor& t) {
    intptr_t lo = reinterpret_cast<intptr_t>(t.data_ptr()), hi = lo;
    for (int64_t i = 0; i < t.dim(); ++i) {
      const intptr_t step = (t.size(i) - 1) * t.stride(i) * static_cast<intptr_t>(t.element_size());
      (step < 0 ? lo : hi) += step;
    }
    return std::make_pair(lo, hi + static_cast<intptr_t>(t.element_size()) - 1);
  };
  const auto [lo, hi] = span(x);
  const auto [c_lo, c_hi] = span(cache);
  return lo <= c_hi && c_lo <= hi;
}

Rows rows_of(const at::Tensor& src, const at::Tensor& cache, int64_t h0) {
  Rows r;
  r.src = static_cast<const char*>(src.data_ptr());
  r.s0 = src.stride(0); r.s1 = src.stride(1); r.s2 = src.stride(2);
  r.dst = static_cast<char*>(cache.data_ptr()) + h0 * cache.stride(2) * cache.element_size();
  r.d0 = cache.stride(0); r.d1 = cache.stride(1); r.d2 = cache.stride(2); r.d3 = cache.stride(3);
  r.heads = src.size(1); r.dim = src.size(2);
  r.src_size = src.element_size(); r.dst_size = cache.element_size();
  return r;
}

// same dtype: bytes
inline void copy_row(const Rows& r, int64_t token, int64_t block, int64_t row) {
  const char* s = r.src + token * r.s0 * r.src_size;
  char* d = r.dst + (block * r.d0 + row * r.d1) * r.dst_size;
  const int64_t e = r.dst_size;
  if (r.s2 == 1 && r.d3 == 1) {
    if (r.s1 == r.dim && r.d2 == r.dim) {
      std::memcpy(d, s, r.heads * r.dim * e);
      return;
    }
    for (int64_t h = 0; h < r.heads; ++h) std::memcpy(d + h * r.d2 * e, s + h * r.s1 * e, r.dim * e);
    return;
  }
  for (int64_t h = 0; h < r.heads; ++h)
    for (int64_t x = 0; x < r.dim; ++x) std::memcpy(d + (h * r.d2 + x * r.d3) * e, s + (h * r.s1 + x * r.s2) * e, e);
}

template <typename I>
int64_t write_all(const I* slots, int64_t stride, int64_t n, int64_t capacity, int64_t block_size, const Rows& k,
                  const Rows& v) {
  for (int64_t i = 0; i < n; ++i)
    if (static_cast<int64_t>(slots[i * stride]) >= capacity) return i;  // nothing written
  const int64_t bytes = k.heads * (k.dim + v.dim) * k.dst_size;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(bytes, 1));
  at::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t slot = static_cast<int64_t>(slots[i * stride]);
      if (slot < 0) continue;  // padding
      const int64_t block = slot / block_size, row = slot - block * block_size;
      copy_row(k, i, block, row);
      copy_row(v, i, block, row);
    }
  });
  return -1;
}

int64_t paged_write_native(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& slot_mapping, int64_t h0, const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale) {
  // metadata: kvops.paged_cache_write's validator checks all of it first; a direct call of this private op
  // (torch.ops.kvops._paged_write_native) gets these checks instead of a write out of bounds
  const char* op = "kvops::_paged_write_native";
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, op,
              ": expected key/value [N', H_in, D] and NHD caches [P, block_size, H_kv, D], got shapes ", key.sizes(),
              ", ", value.sizes(), ", ", k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(slot_mapping.dim() == 1 &&
                  (slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong), op,
              ": slot_mapping must be a 1-D int32/int64 tensor, got shape ", slot_mapping.sizes(), " and dtype ",
              slot_mapping.scalar_type());
  const at::Tensor* all[] = {&key, &value, &k_cache, &v_cache, &slot_mapping};
  for (const at::Tensor* t : all)
    TORCH_CHECK(t->device().is_cpu(), op, ": every tensor must be on the CPU, got one on ", t->device());
  const auto ct = k_cache.scalar_type();
  const bool fp8_cache = ct == at::kFloat8_e4m3fn;
  TORCH_CHECK(v_cache.scalar_type() == ct, op, ": k_cache and v_cache dtypes differ: ", ct, " and ",
              v_cache.scalar_type());
  for (const at::Tensor* t : {&key, &value}) {
    const auto st = t->scalar_type();
    TORCH_CHECK(fp8_cache ? (st == at::kFloat || st == at::kBFloat16 || st == at::kHalf) : st == ct, op,
                ": key/value dtype ", st, " cannot be written into a ", ct, " cache");
  }
  TORCH_CHECK(k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.size(2) == v_cache.size(2) && k_cache.size(1) >= 1,
              op, ": k_cache ", k_cache.sizes(), " and v_cache ", v_cache.sizes(),
              " must agree in [P, block_size, H_kv] with block_size >= 1");
  TORCH_CHECK(key.size(0) >= slot_mapping.size(0) && value.size(0) >= slot_mapping.size(0) &&
                  key.size(1) == value.size(1), op, ": key ", key.sizes(), " and value ", value.sizes(),
              " need the same heads and at least one row per slot (", slot_mapping.size(0), " slots)");
  TORCH_CHECK(key.size(2) == k_cache.size(3) && value.size(2) == v_cache.size(3), op, ": head_dim mismatch: key ",
              key.sizes(), " / k_cache ", k_cache.sizes(), ", value ", value.sizes(), " / v_cache ", v_cache.sizes());
  TORCH_CHECK(h0 >= 0 && h0 <= k_cache.size(2) - key.size(1), op, ": head slice [", h0, ", ", h0 + key.size(1),
              ") is outside the cache's heads [0, ", k_cache.size(2), ")");
  for (const auto* sc : {&k_scale, &v_scale})
    if (sc->has_value())
      TORCH_CHECK(fp8_cache && (*sc)->scalar_type() == at::kFloat && (*sc)->dim() == 1 && (*sc)->device().is_cpu() &&
                      ((*sc)->size(0) == 1 || (*sc)->size(0) == k_cache.size(2)),
                  op, ": k_scale/v_scale are float32 [1] or [", k_cache.size(2), "] CPU tensors for float8_e4m3fn "
                  "caches only");
  const int64_t n = slot_mapping.size(0);
  if (n == 0) return -1;
  at::Tensor k_src = key, v_src = value;
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "kvops::_paged_write_native: fp8 caches need scales");
    k_src = quantize(key, *k_scale, h0, n);
    v_src = quantize(value, *v_scale, h0, n);
  } else {  // snapshot semantics: a source overlapping a cache is read before anything is written (copied first)
    if (overlaps(key, k_cache) || overlaps(key, v_cache)) k_src = key.narrow(0, 0, n).clone();
    if (overlaps(value, k_cache) || overlaps(value, v_cache)) v_src = value.narrow(0, 0, n).clone();
  }
  const Rows k = rows_of(k_src, k_cache, h0), v = rows_of(v_src, v_cache, h0);
  const int64_t block_size = k_cache.size(1), capacity = k_cache.size(0) * block_size;
  const int64_t stride = slot_mapping.stride(0);
  if (slot_mapping.scalar_type() == at::kInt)
    return write_all(slot_mapping.data_ptr<int32_t>(), stride, n, capacity, block_size, k, v);
  return write_all(slot_mapping.data_ptr<int64_t>(), stride, n, capacity, block_size, k, v);
}

}  // namespace
}  // namespace kvops_native

// The schema of kvops::_paged_write_native is in kvops/_library.py (defined at import); this file registers its CPU kernel.
TORCH_LIBRARY_IMPL(kvops, CPU, m) { m.impl("_paged_write_native", &kvops_native::paged_write_native); }
