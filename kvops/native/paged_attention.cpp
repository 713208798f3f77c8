// Native CPU kernel for kvops::paged_attention (semantics.md §4), registered as kvops::_paged_attention_native.
//
// Built on first use by kvops/native/__init__.py (torch.utils.cpp_extension.load); the Python op
// kvops::paged_attention calls it for CPU tensors after its validator ran, so this file trusts its arguments'
// metadata (dtypes, ranks, shapes). It does not trust the index tensors' values: before any parallel region it checks
// every value it addresses memory with (the value contracts of docs/semantics.md §7: cu_seqlens_q, seq_lens, the
// block ids in use) and raises the contract's RuntimeError, whatever the value-check mode (values_bad/raise_values).
//
// Work: one item per (sequence, tile of ~64 query rows per KV head; up to GEMM_ITEM_ROWS where a sequence has many
// queries) covering every KV head, optionally split along
// the KV range (split-KV, merged afterwards) when there are fewer than two items per thread; items run under
// at::parallel_for. A KV head's rows are all its GQA query heads times the tile's queries (row r = query i * G +
// group head g), so every K/V token is read once per KV head (once per query tile in prefill), in its stored dtype
// (fp32, bf16, fp16, fp8 e4m3 with per-tensor / per-KV-head scales: k_scale folded into q, v_scale into the output),
// and the KV heads of a chunk (16 tokens; 32 on AVX-512 where they fit, WIDE_NV) are processed back to back so a
// token's rows are read together. K of a chunk is converted to fp32 and transposed in registers (16 tokens = one
// vector), V is converted as it is accumulated: no gathered copy of the context exists. Scores of 16 tokens are one
// vector per row: online softmax (running max m,
// sum l, accumulator acc, all fp32) per chunk, softcap before masking, bottom-right causal mask and sliding window as
// lane compares. Only positions < seq_len of blocks the table references for them are ever addressed (rows past a
// chunk's end point at a zero buffer), so NaN/inf in unused slots or unreferenced blocks is never read. Caches are
// addressed through their four strides (joint K|V allocations, interleaved blocks, HND caches viewed as NHD, sliced
// heads); a last-dim stride != 1 or a head_dim that is not a multiple of 16 goes through a small fp32 staging tile.
// A KV head's rows go through the math in one block of 1-8 rows (decode with GQA ratio <= 8: no padding) or blocks of 8.
// bf16 caches read in place take chunk_pairs.h instead of chunk(): K / V read as 32-bit words (two dims each).
// Items with GEMM_MIN_ROWS rows per KV head or more (chunked prefill) take the GEMM path instead: attend_gemm.h.
// The K/V rows ~8 KiB ahead are software-prefetched (blocks are scattered), one cache line per inner-loop step
// (a burst per chunk overflows the miss buffers and is mostly dropped). Vector code uses GCC/Clang vector
// extensions (AVX-512 / AVX2 / NEON under -march=native). Also here: the one-pass value-contract check of eager CPU
// calls (paged_attention_values_bad, used by kvops/_checks/values_attention.py).
//
// Where things are: paged_problem.h (vector helpers, row loads, the prefetcher, Problem / Item / Scratch),
// attend_regs.h (the register kernel: load_queries, online_softmax, chunk, attend; chunk_pairs.h for bf16 caches),
// attend_gemm.h (the GEMM path), paged_checks.h (argument and index-value checks); this file: finalize, run (the work
// split, split-KV merge), paged_attention_call (items, dispatch on dtypes) and the registrations.

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/record_function.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace kvops_native {
namespace {

#include "vec.h"  // L = 16 lanes (= tokens per chunk), vf/vi, loadu/storeu/splat/vsel/hsum, vexp, fp8_lut
// Zen 5 (48 KiB L1d), one thread, an earlier kernel with prefetcht0: 8 KiB as good as or better than 4, 16, 32 KiB,
// t0 better than t1, t2. Zen 3 (32 KiB L1d): 4, 8 and 16 KiB the same within noise; no prefetch 1.4-1.6x slower
// (Qwen2.5-0.5B and Llama-3.1-8B decode, B 8). Zen 4 (32 KiB L1d, 1 MiB L2): prefetcht1 up to 1.6x faster than t0 from
// memory (vec.h: prefetch_line), 8 KiB; no prefetch 1.06-1.42x slower than t0
#ifndef KVOPS_PREFETCH
#define KVOPS_PREFETCH 8192
#endif
constexpr int PREFETCH_BYTES = KVOPS_PREFETCH;  // K/V bytes prefetched ahead of the math
// KV positions ahead of the chunk being computed at which attend() touches each block's run of K/V (one line of head
// 0's rows where the run starts and one where it ends): a block of 16 bf16 tokens of 2 KV heads x 64 dims is 4 KiB
// (one or two pages), so with the blocks scattered nearly every block costs a page walk; started 256 positions (8 or
// 16 chunks) early, the walk is done when the block's lines are prefetched (Qwen2.5-0.5B bf16 decode from memory, B
// 32 ctx 4096: 6.8 -> 6.3 ms, AMD EPYC Zen 4, AVX-512 build; docs/native-kernel.md, "Page walks and overlap"). Not
// for blocks shorter than TLB_MIN_BLOCK: at block_size 1 a touch per position made Qwen fp32 B 8 ctx 4096 2.98 -> 3.21
// ms (the same host and build).
constexpr int TLB_AHEAD = 256;
constexpr int TLB_MIN_BLOCK = 16;
constexpr int WIDE_UNIT_BYTES = 16384;  // the largest chunk of one KV head (K and V) taken 32 tokens at a time
// (KV position, KV head) rows below which a call stays on one thread: waking the pool costs more than the work. 2048
// kept Qwen2.5-0.5B decode at B 1 ctx 256 (512 rows, ~25 us) on one thread while SDPA split it: 1.3-1.5x SDPA's time
// at 2 threads, 1.2-1.35x split (AVX2 host, AMD EPYC Zen 3); at 256 rows splitting measured the same as not
constexpr int64_t TINY_KV_ROWS = 512;
#include "paged_problem.h"  // vector helpers, row loads, Prefetcher, Problem, Item, Scratch
#include "attend_regs.h"  // the register kernel: load_queries, online_softmax, chunk, attend (+ chunk_pairs.h)

#include "attend_gemm.h"  // attend_gemm: the GEMM form of attend for items with many rows

// out / lse of KV head h's rows from (m, l, acc); sinks join the denominator here.
template <typename TQ>
void finalize(const Problem& pb, const Item& it, int h, int rows, int rows_pad, const float* state) {
  const float* m = state;
  const float* l = state + rows_pad;
  const float* acc = state + 2 * rows_pad;
  TQ* out = static_cast<TQ*>(pb.out);
  const float vs = pb.v_scale ? pb.v_scale[pb.n_v_scale == 1 ? 0 : h] : 1.f;
  const int64_t t0 = pb.cu[it.b] + it.q0;
  for (int r = 0; r < rows; ++r) {
    const int i = r / pb.group, hh = h * pb.group + r % pb.group;
    float mr = m[r], lr = l[r], f = 1.f;
    const bool has_keys = lr > 0.f || lr != lr;  // NaN: a visible key's NaN score (chunk), the row is NaN
    if (pb.sinks) {  // exp(sink) joins the denominator, carries no value
      const float sink = pb.sinks[hh], m_new = std::max(mr, sink);
      f = std::exp(mr - m_new);
      lr = lr * f + std::exp(sink - m_new);
      mr = m_new;
    }
    const float w = has_keys ? f * vs / lr : 0.f;
    TQ* o = out + ((t0 + i) * pb.num_heads + hh) * pb.d_v;
    const float* a = acc + static_cast<size_t>(r) * pb.dv_pad;
    for (int e = 0; e < pb.d_v; ++e) o[e] = static_cast<TQ>(has_keys ? a[e] * w : 0.f);
    pb.lse[hh * pb.num_tokens + t0 + i] = lr > 0.f || lr != lr ? mr + std::log(lr) : NEG_INF;
  }
}

template <typename TQ, typename TK>
void run(const Problem& pb, const std::vector<Item>& items, const std::vector<std::pair<int, int>>& work,
         int max_rows_pad, avec<float>& partials) {
  const int dvp = pb.dv_pad, nh = pb.num_kv_heads;
  const int64_t head_size = static_cast<int64_t>(max_rows_pad) * (dvp + 2), part_size = nh * head_size;
  // tiny calls (decode of a few short sequences) run on the calling thread: waking the pool costs more than the work
  int64_t kv_rows = 0;
  for (const Item& it : items) kv_rows += static_cast<int64_t>(it.hi - it.lo + it.sink_hi - pb.seq_start(it.b)) * nh;
  const int64_t grain = kv_rows < TINY_KV_ROWS ? static_cast<int64_t>(work.size()) : 1;
  at::parallel_for(0, static_cast<int64_t>(work.size()), grain, [&](int64_t begin, int64_t end) {
    static thread_local Scratch sc;  // reused across calls: no allocation once warm
    static thread_local GemmScratch gs;
    static thread_local avec<float> own;
    sc.size(max_rows_pad, pb);
    own.resize(part_size);
    for (int64_t w = begin; w < end; ++w) {
      const Item& it = items[work[w].first];
      const int part = work[w].second;
      const int rows = it.nq * pb.group, rows_pad = pad_rows(rows);
      float* state = it.parts > 1 ? partials.data() + it.partial + part * part_size : own.data();
      for (int h = 0; h < nh; ++h) {
        std::fill(state + h * head_size, state + h * head_size + rows_pad, NEG_INF);
        std::fill(state + h * head_size + rows_pad, state + (h + 1) * head_size, 0.f);
      }
      std::fill(sc.p.begin(), sc.p.end(), 0.f);
      std::fill(sc.alpha.begin(), sc.alpha.end(), 1.f);
      const int64_t start = pb.seq_start(it.b);
      // KV positions [a, b) into the state: the GEMM path for many rows, the register kernel for a few
      auto pass = [&](int64_t a, int64_t b) {
        if (rows >= GEMM_MIN_ROWS) {
          if (low_precision_gemm<TQ, TK>(pb))
            return attend_gemm<TQ, TK, std::conditional_t<std::is_same_v<TQ, TK>, TK, float>>(
                pb, it, a, b, rows, rows_pad, sc, gs, state, head_size);
          return attend_gemm<TQ, TK, float>(pb, it, a, b, rows, rows_pad, sc, gs, state, head_size);
        }
        switch (rows_pad) {
          case 1: return attend<TK, 1>(pb, it, a, b, rows, rows_pad, sc, state, head_size);
          case 2: return attend<TK, 2>(pb, it, a, b, rows, rows_pad, sc, state, head_size);
          case 3: return attend<TK, 3>(pb, it, a, b, rows, rows_pad, sc, state, head_size);
          case 4: return attend<TK, 4>(pb, it, a, b, rows, rows_pad, sc, state, head_size);
          case 5: return attend<TK, 5>(pb, it, a, b, rows, rows_pad, sc, state, head_size);
          case 6: return attend<TK, 6>(pb, it, a, b, rows, rows_pad, sc, state, head_size);
          case 7: return attend<TK, 7>(pb, it, a, b, rows, rows_pad, sc, state, head_size);
          default: return attend<TK, 8>(pb, it, a, b, rows, rows_pad, sc, state, head_size);
        }
      };
      // the bf16 / fp16 GEMM form reads the queries as given: load_queries then sets the rows' ranges only
      const bool q_rows = !(rows >= GEMM_MIN_ROWS && low_precision_gemm<TQ, TK>(pb));
      if (part == 0 && it.sink_hi > start) {  // streaming: the sink rows first, with their own q and masks
        load_queries<TQ>(pb, it, rows_pad, sc, true, q_rows);
        pass(start, it.sink_hi);
      }
      load_queries<TQ>(pb, it, rows_pad, sc, false, q_rows);
      const int64_t span = it.hi - it.lo, per = (span + it.parts - 1) / it.parts;
      const int64_t lo = it.lo + part * per, hi = std::min(it.hi, lo + per);
      if (lo < hi) {
        pass(lo, hi);
      }
      if (it.parts == 1)
        for (int h = 0; h < nh; ++h) finalize<TQ>(pb, it, h, rows, rows_pad, state + h * head_size);
    }
  });
  // merge split-KV parts
  std::vector<int> split;
  for (int i = 0; i < static_cast<int>(items.size()); ++i)
    if (items[i].parts > 1) split.push_back(i);
  at::parallel_for(0, static_cast<int64_t>(split.size()) * nh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(head_size);
    for (int64_t sh = begin; sh < end; ++sh) {
      const Item& it = items[split[sh / nh]];
      const int h = static_cast<int>(sh % nh);
      const int rows = it.nq * pb.group, rows_pad = pad_rows(rows);
      float* m = merged.data();
      float* l = m + rows_pad;
      float* acc = l + rows_pad;
      for (int r = 0; r < rows; ++r) {
        float mx = NEG_INF;
        bool nan = false;  // a part's NaN row (chunk) makes the merged row NaN
        for (int p = 0; p < it.parts; ++p) {
          const float* base = partials.data() + it.partial + p * part_size + h * head_size;
          mx = std::max(mx, base[r]);
          nan |= base[rows_pad + r] != base[rows_pad + r];
        }
        m[r] = mx;
        l[r] = nan ? std::numeric_limits<float>::quiet_NaN() : 0.f;
        std::fill(acc + static_cast<size_t>(r) * dvp, acc + static_cast<size_t>(r + 1) * dvp, 0.f);
        if (mx == NEG_INF || nan) continue;
        for (int p = 0; p < it.parts; ++p) {
          const float* base = partials.data() + it.partial + p * part_size + h * head_size;
          const float mp = base[r];
          if (mp == NEG_INF) continue;
          const float f = std::exp(mp - mx);
          l[r] += base[rows_pad + r] * f;
          const float* ap = base + 2 * rows_pad + static_cast<size_t>(r) * dvp;
          float* ar = acc + static_cast<size_t>(r) * dvp;
          for (int e = 0; e < dvp; ++e) ar[e] += ap[e] * f;
        }
      }
      finalize<TQ>(pb, it, h, rows, rows_pad, merged.data());
    }
  });
}

template <typename TQ>
void run_cache(const Problem& pb, c10::ScalarType cache_dtype, const std::vector<Item>& items,
               const std::vector<std::pair<int, int>>& work, int max_rows_pad, avec<float>& partials) {
  if (cache_dtype == c10::ScalarType::Float8_e4m3fn)
    run<TQ, c10::Float8_e4m3fn>(pb, items, work, max_rows_pad, partials);
  else
    run<TQ, TQ>(pb, items, work, max_rows_pad, partials);
}

#include "paged_checks.h"  // Index, values_bad, raise_values, check_index_tensors, check_attention_args,
                           // resolve_bounds

// Eager CPU calls' value check (kvops/_checks/values_attention.py): true when a contract is violated (it then raises).
bool paged_attention_values_bad(const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                                const at::Tensor& block_table, int64_t num_tokens, int64_t max_seqlen_q,
                                int64_t num_blocks, int64_t block_size, int64_t window_left, int64_t sink_tokens,
                                const std::optional<at::Tensor>& cache_leftpad) {
  check_index_tensors("kvops::_paged_attention_values_bad", cu_seqlens_q, seq_lens, block_table, num_tokens,
                      num_blocks, block_size);
  int64_t window_right = -1;
  resolve_bounds(window_left, window_right, sink_tokens);
  return values_bad(index_of(cu_seqlens_q, seq_lens, block_table, num_tokens, max_seqlen_q, num_blocks, block_size,
                             window_left, sink_tokens, cache_leftpad));
}

// Whether bf16 decode takes chunk_dot.h's dot products where the build has them (AVX512-BF16): by default on AMD CPUs
// (Zen 4: vdpbf16ps at the FMA rate; bf16 decode took ~0.75x the time of chunk_pairs.h's fp32 FMAs), not elsewhere (on
// an AVX512-BF16 Xeon with AMX it issued at half the FMA rate per product and decode was slower: docs/native-kernel.md).
// KVOPS_NATIVE_BF16_DOT=1 / 0 chooses either form (the tests run both on any such host); read per call.
bool bf16_dot_wanted() {
  const char* env = std::getenv("KVOPS_NATIVE_BF16_DOT");
  if (env == nullptr || *env == '\0') {
#if defined(__x86_64__) || defined(__i386__)
    static const bool amd = [] {
      __builtin_cpu_init();
      return __builtin_cpu_is("amd") != 0;
    }();
    return amd;
#else
    return false;
#endif
  }
  const std::string v(env);
  TORCH_CHECK_VALUE(v == "0" || v == "1", "KVOPS_NATIVE_BF16_DOT='", v,
                    "' is not a form of the native bf16 decode; set it to 1 (bf16 dot products, vdpbf16ps, where the "
                    "build has AVX512-BF16), 0 (the word form: fp32 FMAs) or unset it (the default: dot products on "
                    "AMD CPUs)");
  return v == "1";
}

// kvops::_paged_attention_native's kernel; with_lse false (an eager call that does not return the LSE: eager_entry.cpp)
// leaves the returned LSE undefined, the kernel writing it into a per-thread buffer instead (no tensor to allocate)
std::tuple<at::Tensor, at::Tensor> paged_attention_call(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cu_seqlens_q,
    const at::Tensor& seq_lens, const at::Tensor& block_table, int64_t max_seqlen_q, double scale, bool causal,
    int64_t window_left, double softcap, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& alibi_slopes, int64_t window_right, const std::optional<at::Tensor>& cache_leftpad,
    int64_t sink_tokens, std::optional<double> rope_theta, double rope_scale,
    const std::optional<at::Tensor>& custom_mask, const std::optional<at::Tensor>& packed_custom_mask, bool with_lse) {
  resolve_bounds(window_left, window_right, sink_tokens);
  const int64_t num_tokens = q.size(0), num_heads = q.size(1), d = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2), d_v = v_cache.size(3), batch = block_table.size(0);
  // memory safety for any index values (value checks "off", or compiled code, which the "eager" mode leaves
  // unchecked): the contracts the kernel addresses memory with, checked before any parallel region (an exception
  // thrown inside one terminates the process); a few ns per sequence and block id in use
  // (q_len <= max_seqlen_q is not among them: it sizes CUDA grids, this kernel reads the lengths, and "off" means no
  // check beyond memory safety)
  (void)max_seqlen_q;
  check_attention_args(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, window_left, sinks, k_scale,
                       v_scale);
  {  // the attention features' arguments (docs/attention_features.md), as the validator has them
    const char* op = "kvops::_paged_attention_native";
    const int64_t b = block_table.size(0), h = q.size(1);
    TORCH_CHECK(!alibi_slopes || (alibi_slopes->scalar_type() == at::kFloat && alibi_slopes->device().is_cpu() &&
                                  (alibi_slopes->sizes() == at::IntArrayRef{h} ||
                                   alibi_slopes->sizes() == at::IntArrayRef{b, h})),
                op, ": alibi_slopes must be a float32 CPU tensor [H_q] or [B, H_q]");
    TORCH_CHECK(!cache_leftpad || (cache_leftpad->scalar_type() == at::kInt && cache_leftpad->device().is_cpu() &&
                                   cache_leftpad->dim() == 1 && cache_leftpad->size(0) == b),
                op, ": cache_leftpad must be an int32 CPU tensor [B]");
    TORCH_CHECK(window_right >= -1 && sink_tokens >= 0, op, ": window_right must be >= -1 and sink_tokens >= 0");
    TORCH_CHECK(!rope_theta || (*rope_theta > 0 && rope_scale > 0 && q.size(2) % 2 == 0), op,
                ": RoPE at read time needs rope_theta > 0, rope_scale > 0 and an even head_dim");
  }
  const bool bf16_dot = bf16_dot_wanted();  // a bad KVOPS_NATIVE_BF16_DOT raises here, on any dtype and build
  const Index index = index_of(cu_seqlens_q, seq_lens, block_table, num_tokens, std::numeric_limits<int64_t>::max(),
                               k_cache.size(0), k_cache.size(1), window_left, sink_tokens, cache_leftpad);
  if (values_bad(index)) raise_values(index);
  // custom mask (docs/tree-mask.md): its form, and its length against the query lengths (it is addressed with them)
  const bool packed = packed_custom_mask.has_value();
  const std::optional<at::Tensor>& mask_arg = packed ? packed_custom_mask : custom_mask;
  std::vector<int64_t> mask_off;
  at::Tensor mask_t;
  if (mask_arg) {
    const char* name = packed ? "packed_custom_mask" : "custom_mask";
    TORCH_CHECK(!(custom_mask && packed_custom_mask), "kvops::_paged_attention_native: pass custom_mask or ",
                "packed_custom_mask, not both");
    TORCH_CHECK(mask_arg->dim() == 1 && mask_arg->device().is_cpu() &&
                    mask_arg->scalar_type() == (packed ? at::kByte : at::kBool),
                "kvops::_paged_attention_native: ", name, packed ? " must be a 1-D uint8 CPU tensor" :
                " must be a 1-D bool CPU tensor");
    int64_t at_ = 0;
    for (int64_t b = 0; b < batch; ++b) {
      mask_off.push_back(packed ? at_ * 8 : at_);  // packed: bits (each segment starts on a byte)
      const int64_t n = index.cu_at(b + 1) - index.cu_at(b);
      at_ += packed ? (n * n + 7) / 8 : n * n;
    }
    TORCH_CHECK(mask_arg->numel() == at_, "kvops.paged_attention: ", name, " has ", mask_arg->numel(),
                " elements, expected ", at_, packed ? " (sum_b ceil(q_len_b ** 2 / 8)" : " (sum_b q_len_b ** 2",
                " for the query lengths of cu_seqlens_q: each sequence's q_len x q_len block of its new keys",
                packed ? ", bits padded to whole bytes per sequence)." : ", row-major, concatenated).");
    mask_t = mask_arg->contiguous();
  }
  // rows owned by no sequence are 0 / -inf (one memset / fill here: cheaper than two more aten ops per call)
  at::Tensor out = at::empty({num_tokens, num_heads, d_v}, q.options());
  at::Tensor lse;
  static thread_local std::vector<float> lse_buffer;  // the LSE nobody asked for (with_lse false)
  if (with_lse) {
    lse = at::empty({num_heads, num_tokens}, q.options().dtype(at::kFloat));
  } else {
    lse_buffer.resize(static_cast<size_t>(num_heads * num_tokens));
  }
  float* const lse_out = with_lse ? lse.data_ptr<float>() : lse_buffer.data();
  std::memset(out.data_ptr(), 0, out.nbytes());
  std::fill_n(lse_out, num_heads * num_tokens, NEG_INF);
  if (num_tokens == 0 || batch == 0) return {out, lse};
  const at::Tensor cu = cu_seqlens_q.contiguous(), sl = seq_lens.contiguous(), table = block_table.contiguous();
  const at::Tensor sk = sinks ? sinks->contiguous() : at::Tensor();
  const at::Tensor ksc = k_scale ? k_scale->contiguous() : at::Tensor();
  const at::Tensor vsc = v_scale ? v_scale->contiguous() : at::Tensor();
  const at::Tensor slopes = alibi_slopes ? alibi_slopes->contiguous() : at::Tensor();
  const at::Tensor leftpad = cache_leftpad ? cache_leftpad->contiguous() : at::Tensor();
  std::vector<double> rope_freq;
  if (rope_theta) {  // angle of position p: p / rope_scale * theta^(-2i / d) (FlashInfer's ROPE_LLAMA)
    for (int64_t i = 0; i < d / 2; ++i)
      rope_freq.push_back(std::pow(*rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(d)) / rope_scale);
  }

  Problem pb{};
  pb.q = q.data_ptr();
  for (int i = 0; i < 3; ++i) pb.sq[i] = q.stride(i);
  pb.k = k_cache.data_ptr();
  pb.v = v_cache.data_ptr();
  for (int i = 0; i < 4; ++i) {
    pb.sk[i] = k_cache.stride(i);
    pb.sv[i] = v_cache.stride(i);
  }
  pb.cu = cu.data_ptr<int32_t>();
  pb.seq_lens = sl.data_ptr<int32_t>();
  pb.table = table.data_ptr<int32_t>();
  pb.table_stride = table.size(1);
  pb.num_heads = static_cast<int>(num_heads);
  pb.num_kv_heads = static_cast<int>(num_kv_heads);
  pb.group = static_cast<int>(num_heads / num_kv_heads);
  pb.d = static_cast<int>(d);
  pb.d_v = static_cast<int>(d_v);
  pb.d_pad = round_up(pb.d, L);
  pb.dv_pad = round_up(pb.d_v, L);
  pb.block_size = static_cast<int>(k_cache.size(1));
  pb.scale = static_cast<float>(scale);
  pb.bf16_dot = DOT_BF16 && bf16_dot && q.scalar_type() == at::kBFloat16;
  pb.softcap = static_cast<float>(softcap);
  pb.causal = causal;
  pb.window_left = window_left;
  pb.sinks = sinks ? sk.data_ptr<float>() : nullptr;
  pb.k_scale = k_scale ? ksc.data_ptr<float>() : nullptr;
  pb.v_scale = v_scale ? vsc.data_ptr<float>() : nullptr;
  pb.n_k_scale = k_scale ? ksc.numel() : 0;
  pb.n_v_scale = v_scale ? vsc.numel() : 0;
  pb.out = out.data_ptr();
  pb.lse = lse_out;
  pb.num_tokens = num_tokens;
  pb.alibi = alibi_slopes ? slopes.data_ptr<float>() : nullptr;
  pb.alibi_stride = alibi_slopes && slopes.dim() == 2 ? num_heads : 0;
  pb.window_right = causal ? -1 : window_right;
  pb.leftpad = cache_leftpad ? leftpad.data_ptr<int32_t>() : nullptr;
  pb.sink_tokens = sink_tokens;
  pb.rope_freq = rope_theta ? rope_freq.data() : nullptr;
  pb.mask = mask_arg ? static_cast<const uint8_t*>(mask_t.data_ptr()) : nullptr;
  pb.mask_packed = packed;
  pb.mask_off = mask_off.data();
  if (pb.mask) pb.window_right = -1;  // the mask decides among the new keys (the validator refuses window_right)

  // items: (sequence, query tile of ~64 rows per KV head, or GEMM_ITEM_ROWS where the sequence has enough queries for the
  // GEMM path), all KV heads in one item
  const int q_tile_small = std::max(1, 64 / pb.group);
  std::vector<Item> items;
  int max_rows_pad = 1;
  for (int b = 0; b < batch; ++b) {
    const int q_len = pb.cu[b + 1] - pb.cu[b], kv_len = pb.seq_lens[b];
    const int64_t start = pb.seq_start(b), sink_end = start + sink_tokens;
    // GEMM items: the fewest of <= GEMM_ITEM_ROWS rows, of even size
    const int64_t q_rows = static_cast<int64_t>(q_len) * pb.group;
    const int64_t gemm_items = (q_rows + GEMM_ITEM_ROWS - 1) / GEMM_ITEM_ROWS;
    const int q_tile = q_rows >= 2 * GEMM_MIN_ROWS
                           ? std::max(1, std::min(static_cast<int>((q_len + gemm_items - 1) / gemm_items),
                                                  GEMM_ITEM_ROWS / pb.group))
                           : q_tile_small;
    for (int q0 = 0; q0 < q_len; q0 += q_tile) {
      const int nq = std::min(q_tile, q_len - q0);
      const int64_t first = static_cast<int64_t>(kv_len) - q_len + q0, last = first + nq - 1;
      int64_t lo = window_left >= 0 ? std::max<int64_t>(start, first - window_left) : start;
      int64_t hi = causal && !pb.mask ? std::min<int64_t>(kv_len, last + 1) : kv_len;  // a mask replaces causal
      if (pb.window_right >= 0) hi = std::min<int64_t>(hi, last + pb.window_right + 1);
      int64_t sink_hi = start;
      if (pb.streaming()) {  // the sinks get a pass of their own; the window pass starts after them
        sink_hi = std::max(start, std::min(sink_end, hi));
        lo = std::max(lo, sink_end);
      }
      max_rows_pad = std::max(max_rows_pad, pad_rows(nq * pb.group));
      items.push_back({b, q0, nq, lo, std::max(lo, hi), sink_hi, 1, 0});
    }
  }
  // split-KV when there are fewer items than 2 per thread: parts of >= 64 positions (256: Llama-3.1-8B fp32 decode at
  // B 1 ctx 256 stayed on one thread, 3.1x SDPA's time at 2 threads; 2.2x with 4 parts; calls under TINY_KV_ROWS
  // stay on one thread)
  const int threads = at::get_num_threads();
  int64_t kv_rows = 0;  // (KV position, KV head) rows of the call; tiny calls stay on one thread (run)
  for (const Item& it : items) kv_rows += static_cast<int64_t>(it.hi - it.lo + it.sink_hi - pb.seq_start(it.b)) * pb.num_kv_heads;
  if (threads > 1 && static_cast<int>(items.size()) < 2 * threads && kv_rows >= TINY_KV_ROWS) {
    const int want = (2 * threads + static_cast<int>(items.size()) - 1) / static_cast<int>(items.size());
    for (Item& it : items) it.parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, (it.hi - it.lo) / 64)));
  }
  std::vector<std::pair<int, int>> work;
  int64_t partial_floats = 0;
  const int64_t part_size = static_cast<int64_t>(pb.num_kv_heads) * max_rows_pad * (pb.dv_pad + 2);
  for (int i = 0; i < static_cast<int>(items.size()); ++i) {
    Item& it = items[i];
    if (it.parts > 1) {
      it.partial = partial_floats;
      partial_floats += it.parts * part_size;
    }
    for (int p = 0; p < it.parts; ++p) work.emplace_back(i, p);
  }
  avec<float> partials(partial_floats);

  const auto cache_dtype = k_cache.scalar_type();
  switch (q.scalar_type()) {
    case at::kFloat: run_cache<float>(pb, cache_dtype, items, work, max_rows_pad, partials); break;
    case at::kBFloat16: run_cache<c10::BFloat16>(pb, cache_dtype, items, work, max_rows_pad, partials); break;
    case at::kHalf: run_cache<c10::Half>(pb, cache_dtype, items, work, max_rows_pad, partials); break;
    default: TORCH_CHECK(false, "kvops::_paged_attention_native: unsupported q dtype ", q.scalar_type());
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> paged_attention_native(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cu_seqlens_q,
    const at::Tensor& seq_lens, const at::Tensor& block_table, int64_t max_seqlen_q, double scale, bool causal,
    int64_t window_left, double softcap, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
    const std::optional<at::Tensor>& alibi_slopes, int64_t window_right, const std::optional<at::Tensor>& cache_leftpad,
    int64_t sink_tokens, std::optional<double> rope_theta, double rope_scale,
    const std::optional<at::Tensor>& custom_mask, const std::optional<at::Tensor>& packed_custom_mask) {
  return paged_attention_call(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale, causal,
                              window_left, softcap, sinks, k_scale, v_scale, alibi_slopes, window_right, cache_leftpad,
                              sink_tokens, rope_theta, rope_scale, custom_mask, packed_custom_mask, true);
}

}  // namespace
}  // namespace kvops_native

// The schemas of kvops::_paged_attention_native and kvops::_paged_attention_values_bad are defined by kvops/_library.py
// at import (with the composite kernel as _paged_attention_native's CompositeExplicitAutograd fallback, in
// kvops/native/__init__.py), so graphs calling it load in processes without this build; this file gives the CPU
// kernels.
TORCH_LIBRARY_IMPL(kvops, CPU, m) {
  m.impl("_paged_attention_native", &kvops_native::paged_attention_native);
  m.impl("_paged_attention_values_bad", &kvops_native::paged_attention_values_bad);
}

// The same kernel without the dispatcher, for eager_entry.cpp (kvops/native/eager_entry.cpp): the eager CPU path of
// kvops.paged_attention (_direct in kvops/ops/paged_attention.py) calls it on plain CPU tensors with nothing tracing or
// watching, where the dispatcher's layers (boxing, the autograd fallback) do nothing but cost a few us per call.
// with_lse false: the LSE is not returned (undefined), and not allocated.
namespace kvops_native {
std::tuple<at::Tensor, at::Tensor> paged_attention_eager(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& cu_seqlens_q,
    const at::Tensor& seq_lens, const at::Tensor& block_table, int64_t max_seqlen_q, double scale, bool causal,
    int64_t window_left, double softcap, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale, bool with_lse) {
  return paged_attention_call(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale, causal,
                              window_left, softcap, sinks, k_scale, v_scale, std::nullopt, -1, std::nullopt, 0,
                              std::nullopt, 1.0, std::nullopt, std::nullopt, with_lse);
}
}  // namespace kvops_native
