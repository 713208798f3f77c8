// The checks of the native paged attention's arguments (included by paged_attention.cpp; hashed with the sources by
// kvops/native/__init__.py): the index tensors' value contracts (Index, values_bad, raise_values) and the metadata
// checks that keep direct calls of the private ops in bounds (check_index_tensors, check_attention_args).
#pragma once

// The value contracts of paged_attention (kvops/_checks/values_attention.py, docs/semantics.md §7) over the int32 index
// tensors (any strides), in one pass: true when any is violated. What the kernel addresses memory with is all here:
// 0 = cu[0] <= cu[1] <= ... <= cu[B] <= T_q (query rows read and output rows written), 0 <= seq_lens[b] <=
// max_blocks * block_size (block_table entries read), and the block ids of the first ceil(seq_len / block_size)
// entries of each row in [0, P) (cache blocks read); plus, for the eager check only, q_len <= max_seqlen_q.
struct Index {
  const int32_t* cu;
  const int32_t* lens;
  const int32_t* table;
  int64_t s_cu, s_len, s_b, s_w, batch, width, num_tokens, max_seqlen_q, num_blocks, block_size;
  int64_t window_left, sink_tokens;
  const int32_t* leftpad;  // or null
  int64_t s_pad;
  int64_t cu_at(int64_t b) const { return cu[b * s_cu]; }
  int64_t len_at(int64_t b) const { return lens[b * s_len]; }
  int64_t block_at(int64_t b, int64_t j) const { return table[b * s_b + j * s_w]; }
  int64_t used(int64_t b) const { return (len_at(b) + block_size - 1) / block_size; }
  int64_t start_at(int64_t b) const { return leftpad ? leftpad[b * s_pad] : 0; }
  bool plain() const { return window_left < 0 && !leftpad; }  // every block up to seq_len is read
  // the rows sequence b's queries can read: [start, a) and [w, len) (docs/attention_features.md)
  void reads(int64_t b, int64_t& start, int64_t& a, int64_t& w) const {
    const int64_t len = len_at(b), first = len - (cu_at(b + 1) - cu_at(b));
    start = std::max<int64_t>(0, start_at(b));
    if (window_left < 0) {
      a = start;
      w = start;
      return;
    }
    w = std::max(start, first - window_left);
    a = std::min(w, start + sink_tokens);
  }
  bool block_read(int64_t b, int64_t j) const {
    if (plain()) return j < used(b);
    int64_t start, a, w;
    reads(b, start, a, w);
    const int64_t lo = j * block_size, hi = lo + block_size, len = len_at(b);
    return (lo < a && hi > start) || (lo < len && hi > w);
  }
};

Index index_of(const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, const at::Tensor& block_table,
               int64_t num_tokens, int64_t max_seqlen_q, int64_t num_blocks, int64_t block_size,
               int64_t window_left = -1, int64_t sink_tokens = 0,
               const std::optional<at::Tensor>& cache_leftpad = std::nullopt) {
  return {cu_seqlens_q.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), block_table.data_ptr<int32_t>(),
          cu_seqlens_q.stride(0), seq_lens.stride(0), block_table.stride(0), block_table.stride(1),
          seq_lens.size(0), block_table.size(1), num_tokens, max_seqlen_q, num_blocks, block_size,
          window_left, sink_tokens, cache_leftpad ? cache_leftpad->data_ptr<int32_t>() : nullptr,
          cache_leftpad ? cache_leftpad->stride(0) : 0};
}

bool values_bad(const Index& x) {
  if (x.cu_at(0) != 0 || x.cu_at(x.batch) > x.num_tokens) return true;
  for (int64_t b = 0; b < x.batch; ++b) {
    const int64_t q_len = x.cu_at(b + 1) - x.cu_at(b), len = x.len_at(b);
    if (q_len < 0 || q_len > x.max_seqlen_q || len < 0 || len > x.width * x.block_size) return true;
    if (x.start_at(b) < 0) return true;
    const int64_t used = x.used(b);
    for (int64_t j = 0; j < used; ++j) {
      const int64_t blk = x.block_at(b, j);
      if ((blk < 0 || blk >= x.num_blocks) && x.block_read(b, j)) return true;
    }
  }
  return false;
}

// The message of the first violated contract, in values_attention.py's order and words (_raise_attention); only on
// failure.
[[noreturn]] void raise_values(const Index& x) {
  const char* op = "kvops.paged_attention";
  const int64_t capacity = x.width * x.block_size;
  bool cu_bad = x.cu_at(0) != 0 || x.cu_at(x.batch) > x.num_tokens;
  for (int64_t b = 0; b < x.batch; ++b) cu_bad |= x.cu_at(b + 1) < x.cu_at(b);
  if (cu_bad) {
    std::string cu = "[";
    for (int64_t b = 0; b <= x.batch; ++b) cu += (b ? ", " : "") + std::to_string(x.cu_at(b));
    TORCH_CHECK(false, op, ": cu_seqlens_q = ", cu, "] must be non-decreasing from 0 to at most q's ", x.num_tokens,
                " rows (T_q); sequence b owns q rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]). Pass the cumulative "
                "query lengths.");
  }
  int64_t longest = 0;
  for (int64_t b = 0; b < x.batch; ++b) longest = std::max(longest, x.cu_at(b + 1) - x.cu_at(b));
  for (int64_t b = 0; b < x.batch; ++b)
    TORCH_CHECK(x.cu_at(b + 1) - x.cu_at(b) <= x.max_seqlen_q, op, ": sequence ", b, " has q_len ",
                x.cu_at(b + 1) - x.cu_at(b), " (cu_seqlens_q[", b + 1, "] - cu_seqlens_q[", b, "]) but max_seqlen_q=",
                x.max_seqlen_q, "; pass max_seqlen_q >= ", longest, ", the longest query length in the batch.");
  for (int64_t b = 0; b < x.batch; ++b)
    TORCH_CHECK(x.len_at(b) >= 0 && x.len_at(b) <= capacity, op, ": seq_lens[", b, "] = ", x.len_at(b),
                " is outside [0, ", capacity, "], the capacity of block_table: ", x.width,
                " blocks per sequence x block_size ", x.block_size, ". Give block_table more columns (max_blocks >= "
                "ceil(seq_len / block_size)) or pass the sequence's real KV length.");
  for (int64_t b = 0; b < x.batch; ++b)
    TORCH_CHECK(x.start_at(b) >= 0, op, ": cache_leftpad[", b, "] = ", x.start_at(b), " is negative; it is the first "
                "KV row of sequence ", b, " (0: no left padding).");
  for (int64_t b = 0; b < x.batch; ++b)
    for (int64_t j = 0; j < x.used(b); ++j) {
      if (x.plain())
        TORCH_CHECK(x.block_at(b, j) >= 0 && x.block_at(b, j) < x.num_blocks, op, ": block_table[", b, ", ", j,
                    "] = ", x.block_at(b, j), " is not a block of the cache: block ids must be in [0, ", x.num_blocks,
                    ") (P = ", x.num_blocks, " blocks). Sequence ", b, " (seq_len ", x.len_at(b), ") uses its first ",
                    x.used(b), " entries; entries past those are never read and may hold any value (e.g. -1).");
      if (x.block_read(b, j) && (x.block_at(b, j) < 0 || x.block_at(b, j) >= x.num_blocks)) {
        int64_t start, a, w;
        x.reads(b, start, a, w);
        TORCH_CHECK(false, op, ": block_table[", b, ", ", j, "] = ", x.block_at(b, j), " is not a block of the cache: "
                    "block ids must be in [0, ", x.num_blocks, ") (P = ", x.num_blocks, " blocks). Sequence ", b,
                    " reads rows [", start, ", ", a, ") and [", w, ", ", x.len_at(b), "); entries of blocks outside "
                    "them are never read and may hold any value (e.g. -1).");
      }
    }
  TORCH_CHECK(false, op, ": invalid index values");  // (unreachable: values_bad and the checks above agree)
}

// What the kernels address memory with besides the index values: ranks, dtypes, devices and sizes of the index
// tensors. kvops::paged_attention's validator checks all of it first; these checks keep a direct call of the private
// ops (torch.ops.kvops._paged_attention_native / _paged_attention_values_bad, e.g. from a graph or a traceback)
// from reading out of bounds or dividing by zero.
void check_index_tensors(const char* op, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                         const at::Tensor& block_table, int64_t num_tokens, int64_t num_blocks, int64_t block_size) {
  for (const at::Tensor* t : {&cu_seqlens_q, &seq_lens, &block_table})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->device().is_cpu(), op,
                ": cu_seqlens_q, seq_lens and block_table must be int32 CPU tensors, got ", t->scalar_type(), " on ",
                t->device());
  TORCH_CHECK(block_table.dim() == 2 && seq_lens.dim() == 1 && cu_seqlens_q.dim() == 1 &&
                  seq_lens.size(0) == block_table.size(0) && cu_seqlens_q.size(0) == block_table.size(0) + 1,
              op, ": expected block_table [B, max_blocks], seq_lens [B] and cu_seqlens_q [B + 1], got shapes ",
              block_table.sizes(), ", ", seq_lens.sizes(), " and ", cu_seqlens_q.sizes());
  TORCH_CHECK(block_size >= 1, op, ": block_size must be >= 1, got ", block_size);
  TORCH_CHECK(num_blocks >= 0 && num_tokens >= 0, op, ": num_blocks (", num_blocks, ") and num_tokens (", num_tokens,
              ") must be >= 0");
}

void check_attention_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, const at::Tensor& block_table,
                          int64_t window_left, const std::optional<at::Tensor>& sinks,
                          const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  const char* op = "kvops::_paged_attention_native";
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, op,
              ": expected q [T_q, H_q, D] and NHD caches [P, block_size, H_kv, D], got shapes ", q.sizes(), ", ",
              k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), op,
              ": q and the caches must be CPU tensors");
  const auto qt = q.scalar_type(), ct = k_cache.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16 || qt == at::kHalf, op, ": unsupported q dtype ", qt);
  TORCH_CHECK((ct == qt || ct == at::kFloat8_e4m3fn) && v_cache.scalar_type() == ct, op,
              ": caches must both have q's dtype or be float8_e4m3fn, got ", ct, " and ", v_cache.scalar_type(),
              " for q ", qt);
  for (int i = 0; i < 3; ++i)
    TORCH_CHECK(k_cache.size(i) == v_cache.size(i), op, ": k_cache ", k_cache.sizes(), " and v_cache ",
                v_cache.sizes(), " must agree in [P, block_size, H_kv]");
  TORCH_CHECK(k_cache.size(1) >= 1 && k_cache.size(2) >= 1 && k_cache.size(3) >= 1 && v_cache.size(3) >= 1, op,
              ": block_size, num_kv_heads and head_dims must be >= 1, got k_cache ", k_cache.sizes(), " and v_cache ",
              v_cache.sizes());
  TORCH_CHECK(q.size(2) == k_cache.size(3), op, ": q head_dim ", q.size(2), " != k_cache head_dim ",
              k_cache.size(3));
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, op, ": num_heads (", q.size(1),
              ") must be a multiple of num_kv_heads (", k_cache.size(2), ")");
  TORCH_CHECK(window_left >= -1, op, ": window_left must be >= -1, got ", window_left);
  check_index_tensors(op, cu_seqlens_q, seq_lens, block_table, q.size(0), k_cache.size(0), k_cache.size(1));
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->device().is_cpu() &&
                         sinks->numel() == q.size(1)),
              op, ": sinks must be a float32 CPU tensor of ", q.size(1), " elements");
  const bool fp8 = ct == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 == (k_scale.has_value() && v_scale.has_value()) && (fp8 || (!k_scale && !v_scale)), op,
              ": k_scale and v_scale are required for (and only for) float8_e4m3fn caches");
  for (const auto* sc : {&k_scale, &v_scale})
    if (sc->has_value())
      TORCH_CHECK((*sc)->scalar_type() == at::kFloat && (*sc)->device().is_cpu() &&
                      ((*sc)->numel() == 1 || (*sc)->numel() == k_cache.size(2)),
                  op, ": k_scale/v_scale must be float32 CPU tensors of 1 or ", k_cache.size(2), " elements");
}

// A window or sink count of 2^31 positions or more covers every int32 position: no window (kvops/_checks/common.py
// resolve_bounds, applied by the Python op too), so no position arithmetic sees sys.maxsize (int64 overflow).
void resolve_bounds(int64_t& window_left, int64_t& window_right, int64_t& sink_tokens) {
  constexpr int64_t unbounded = int64_t(1) << 31;
  if (window_left >= unbounded || sink_tokens >= unbounded) {
    window_left = -1;
    sink_tokens = 0;
  }
  if (window_right >= unbounded) window_right = -1;
}
