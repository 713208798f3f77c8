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
// calls (paged_attention_values_bad, used by kvops/_checks/values.py).

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
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
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace kvops_native {
namespace {

#include "vec.h"  // L = 16 lanes (= tokens per chunk), vf/vi, loadu/storeu/splat/vsel/hsum, vexp, fp8_lut
#ifndef KVOPS_PREFETCH  // Zen 5 (48 KiB L1d), one thread: 8 KiB as good as or better than 4, 16, 32 KiB; t0 > t1, t2
#define KVOPS_PREFETCH 8192
#endif
constexpr int PREFETCH_BYTES = KVOPS_PREFETCH;  // K/V bytes prefetched ahead of the math
constexpr int WIDE_UNIT_BYTES = 16384;  // the largest chunk of one KV head (K and V) taken 32 tokens at a time
constexpr int64_t TINY_KV_ROWS = 2048;  // (KV position, KV head) rows below which a call stays on one thread (~50 us)
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));

inline vi splati(int32_t x) { return vi{} + x; }
inline float hmax(vf v) {
#if defined(__clang__)
  float m = v[0];
  for (int i = 1; i < L; ++i) m = v[i] > m ? v[i] : m;
  return m;
#elif defined(__AVX2__) && !defined(__AVX512F__)
  // the butterfly below on the two 8-lane halves, in the same order (GCC lowered the 16-lane shuffles to scalar
  // extracts and stores: perf, AVX2 build, Qwen2.5-0.5B decode: a sixth of online_softmax)
  __m256 lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  __m256 m = _mm256_max_ps(hi, lo);  // lane distance 8: w > v ? w : v
  m = _mm256_max_ps(_mm256_permute2f128_ps(m, m, 1), m);  // 4
  m = _mm256_max_ps(_mm256_permute_ps(m, 0x4E), m);  // 2
  m = _mm256_max_ps(_mm256_permute_ps(m, 0xB1), m);  // 1
  return _mm256_cvtss_f32(m);
#else
  // butterfly over lane distance 8, 4, 2, 1 (constant lane permutations c ^ h)
  const vi idx[4] = {vi{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
                     vi{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
                     vi{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
                     vi{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const vf w = __builtin_shuffle(v, idx[k]);
#if defined(__AVX512F__)
    v = (vf)_mm512_max_ps((__m512)w, (__m512)v);  // w > v ? w : v, as below: one instruction
#else
    v = vsel(w > v, w, v);
#endif
  }
  return v[0];
#endif
}

inline vf vtanh(vf x) {
  vi neg = vlt(x, splat(0.0f));
  vf ax = vsel(neg, -x, x);
  vf e = vexp(ax * -2.0f);
  vf t = (1.0f - e) / (1.0f + e);
  return vsel(neg, -t, t);
}

// --- loading one row of n elements (element stride st) into n_pad fp32 values (zeros after n) ------------------

template <typename T>
inline float to_f(const T& x) { return static_cast<float>(x); }
template <>
inline float to_f<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn& x) { return fp8_lut().v[x.x]; }

template <typename T>
inline void load_row(const T* src, int64_t st, int n, float* dst, int n_pad) {
  int i = 0;
  if (st == 1) {
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(dst, src, sizeof(float) * n);
      i = n;
    } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
      const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
      for (; i + L <= n; i += L) {
        vh h;
        std::memcpy(&h, s + i, sizeof h);
        storeu(dst + i, (vf)(__builtin_convertvector(h, vu) << 16));
      }
    } else if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) {
      const float* lut = fp8_lut().v;
      const uint8_t* s = reinterpret_cast<const uint8_t*>(src);
      for (; i < n; ++i) dst[i] = lut[s[i]];
    }
  }
  for (; i < n; ++i) dst[i] = to_f(src[i * st]);
  for (; i < n_pad; ++i) dst[i] = 0.f;
}

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }
// rows of a KV head padded to the row block of the math: none up to 8 (decode at GQA ratios 1-8: Qwen2.5's 5, 6 and 7
// padded to 8 spent 12-37% of the FMAs on zero rows), else a multiple of 8
inline int pad_rows(int rows) { return rows <= 8 ? rows : round_up(rows, 8); }

// The K/V rows of one KV head of a later chunk, prefetched one cache line per inner-loop step of the current chunk's
// math: a burst of hundreds of prefetches overflows the core's miss buffers and most of them are dropped, while one
// per step keeps memory busy under the arithmetic (a token's whole rows per step, 16 lines for fp32 Llama, was 10%
// slower there). The lines are walked from attend's token bases (KV head 0) plus the head's byte offsets, row by row:
// no per-line list is built (building one per chunk and head was ~12% of decode at GQA 7).
struct Prefetcher {
  const char* const* k;  // row starts of the unit's tokens, KV head 0
  const char* const* v;
  int64_t hk, hv;  // byte offsets of the unit's KV head
  int n, kl, vl;  // tokens; cache lines per K / V row (0: rows not unit-stride, not prefetched)
  int t = 0, left = 0;  // the token of the row being walked, its lines still to issue
  bool in_v = true;  // whether that row is token t's V row (before the first step: "past token -1's V row")
  const char* p = nullptr;
  Prefetcher(const char* const* k_, const char* const* v_, int64_t hk_, int64_t hv_, int n_, int kl_, int vl_)
      : k(k_), v(v_), hk(hk_), hv(hv_), n(n_), kl(kl_), vl(vl_), t(-1) {
    if (kl + vl == 0) n = 0;
    next_row();
  }
  __attribute__((noinline)) void next_row() {  // the next row with lines to issue (t == n: done)
    while (left == 0 && t < n) {
      if (in_v) {
        if (++t == n) return;
        in_v = false;
        p = k[t] + hk;
        left = kl;
      } else {
        in_v = true;
        p = v[t] + hv;
        left = vl;
      }
    }
  }
  inline void step() {
    if (t < n) {
      prefetch_line(p);
      p += 64;
      if (--left == 0) next_row();
    }
  }
  inline void rest() {
    while (t < n) step();
  }
};

// --- the arguments of one call -----------------------------------------------------------------------------------
struct Problem {
  const void* q;
  int64_t sq[3];
  const void* k;
  int64_t sk[4];
  const void* v;
  int64_t sv[4];
  const int32_t* cu;
  const int32_t* seq_lens;
  const int32_t* table;
  int64_t table_stride;
  int num_heads, num_kv_heads, group, d, d_v, d_pad, dv_pad, block_size;
  float scale, softcap;
  bool causal;
  int64_t window_left;
  const float* sinks;  // [H_q] or null
  const float* k_scale;  // [1] / [H_kv] or null
  const float* v_scale;
  int64_t n_k_scale, n_v_scale;
  void* out;  // [T, H_q, D_v] contiguous, q's dtype
  float* lse;  // [H_q, T] contiguous
  int64_t num_tokens;
  // attention features (docs/attention_features.md); defaults: null / -1 / 0 / false
  const float* alibi;  // slopes[b * alibi_stride + h] or null
  int64_t alibi_stride;
  int64_t window_right;  // keys j <= pos + window_right when not causal (-1: no bound)
  const int32_t* leftpad;  // first KV row of each sequence, or null
  int64_t sink_tokens;  // StreamingLLM: rows [start, start + sink_tokens) stay visible besides the window
  const double* rope_freq;  // RoPE at read time: [d / 2] angle per position (null: none)
  // custom mask among the new keys (docs/tree-mask.md): bytes (bool form) or little-endian bits (packed form) of
  // each sequence's q_len x q_len block, row-major, from element (bool) / bit (packed) mask_off[b]; null: none
  const uint8_t* mask;
  bool mask_packed;
  const int64_t* mask_off;
  bool mask_bit(int64_t k) const { return mask_packed ? (mask[k >> 3] >> (k & 7)) & 1 : mask[k] != 0; }
  int seq_start(int b) const { return leftpad ? std::max(0, leftpad[b]) : 0; }
  bool streaming() const { return sink_tokens > 0 && window_left >= 0; }
};

// KV positions are int64 everywhere (a seq_len near 2^31 plus a chunk, a prefetch distance or a window overflowed
// int32 and read out of bounds); within a 16-token chunk the lanes' offsets from its first position are
// small ints.
struct Item {
  int b, q0, nq;  // sequence, first query of the tile, queries in the tile (all KV heads together)
  int64_t lo, hi;  // KV positions the tile can see (past the sinks when streaming)
  int64_t sink_hi;  // streaming: sink positions [seq_start, sink_hi) (a pass of their own, in part 0)
  int parts;  // split-KV parts (1: no split)
  int64_t partial;  // offset of this item's partial results (parts > 1)
};

// Per-thread scratch; rows_pad rows per KV head.
struct Scratch {
  avec<float> qf, qt, ktmp, kt, vtmp, s, p, alpha, zeros;  // qt: qf dim-major per RB-row block (32-token chunks)
  avec<float> slope, rc, rs;  // ALiBi slope per (KV head, row); RoPE cos/sin [d / 2][16] of a chunk
  std::vector<double> rope_c, rope_s, rope_step_c, rope_step_s;  // RoPE: rotation at the next position, and a step
  std::vector<int64_t> row_pos;
  avec<vf> lv;
  std::vector<int64_t> row_lo, row_hi;
  std::vector<int64_t> row_mask;  // custom mask: the element / bit of (row's query, new key 0)
  int64_t first_new = 0;  // custom mask: the first new key's position (seq_len - q_len)
  void size(int rows_pad, const Problem& pb) {
    qf.resize(static_cast<size_t>(pb.num_kv_heads) * rows_pad * pb.d_pad);  // load_queries zeroes what an item uses
    qt.resize(qf.size());
    lv.assign(static_cast<size_t>(pb.num_kv_heads) * rows_pad, vf{});
    zeros.assign(pb.d_pad + pb.dv_pad, 0.f);  // what rows past a chunk's end point at
    ktmp.resize(static_cast<size_t>(L) * pb.d_pad);
    kt.resize(static_cast<size_t>(pb.d_pad) * 2 * L);  // K of up to 2 L tokens, transposed
    vtmp.resize(static_cast<size_t>(L) * pb.dv_pad);
    s.resize(static_cast<size_t>(rows_pad) * 2 * L);  // rows of up to 2 L lanes (chunk_pairs' chunks of 2 L tokens)
    p.assign(static_cast<size_t>(rows_pad) * 2 * L, 0.f);
    alpha.assign(rows_pad, 1.f);
    row_lo.resize(rows_pad);
    row_hi.resize(rows_pad);
    row_pos.resize(rows_pad);
    row_mask.resize(rows_pad);
    if (pb.alibi) slope.resize(static_cast<size_t>(pb.num_kv_heads) * rows_pad);
    if (pb.rope_freq) {
      const int half = pb.d / 2;
      rc.resize(static_cast<size_t>(half) * L);
      rs.resize(static_cast<size_t>(half) * L);
      rope_c.resize(half);
      rope_s.resize(half);
      rope_step_c.resize(half);
      rope_step_s.resize(half);
      for (int i = 0; i < half; ++i) {
        rope_step_c[i] = std::cos(pb.rope_freq[i]);
        rope_step_s[i] = std::sin(pb.rope_freq[i]);
      }
    }
  }
};

// x[0, d) rotated by `position` (GPT-NeoX pairs (e, e + d/2), angles in double)
inline void rotate_row(float* x, int d, const double* freq, double position) {
  const int half = d / 2;
  for (int e = 0; e < half; ++e) {
    const double a = position * freq[e];
    const float c = static_cast<float>(std::cos(a)), sn = static_cast<float>(std::sin(a));
    const float x1 = x[e], x2 = x[e + half];
    x[e] = x1 * c - x2 * sn;
    x[e + half] = x2 * c + x1 * sn;
  }
}

// qf[h][r] = q[token, h * G + g] * scale (* k_scale[h]) for row r = i * G + g; per-row visible range [lo, hi).
// sink_pass (streaming): the rows' ranges are the sink rows they see, and with RoPE q turns at its StreamingLLM
// position (shifted down by the gap between the sinks and its window).
template <typename TQ>
void load_queries(const Problem& pb, const Item& it, int rows_pad, Scratch& sc, bool sink_pass = false,
                  bool q_rows = true) {
  const TQ* q = static_cast<const TQ*>(pb.q);
  const int64_t t0 = pb.cu[it.b] + it.q0;
  const int q_len = pb.cu[it.b + 1] - pb.cu[it.b], kv_len = pb.seq_lens[it.b];
  const int64_t start = pb.seq_start(it.b), sink_end = start + pb.sink_tokens;
  sc.first_new = static_cast<int64_t>(kv_len) - q_len;
  if (q_rows) std::fill(sc.qf.begin(), sc.qf.begin() + static_cast<size_t>(pb.num_kv_heads) * rows_pad * pb.d_pad, 0.f);
  for (int h = 0; q_rows && h < pb.num_kv_heads; ++h) {
    const float ks = pb.k_scale ? pb.k_scale[pb.n_k_scale == 1 ? 0 : h] : 1.f;
    const float sc_all = pb.scale * ks;  // k_scale folded into q: q . (k * ks) = (q * ks) . k
    for (int i = 0; i < it.nq; ++i) {
      for (int g = 0; g < pb.group; ++g) {
        const int r = i * pb.group + g;
        const TQ* src = q + (t0 + i) * pb.sq[0] + static_cast<int64_t>(h * pb.group + g) * pb.sq[1];
        float* dst = sc.qf.data() + (static_cast<size_t>(h) * rows_pad + r) * pb.d_pad;
        for (int e = 0; e < pb.d; ++e) dst[e] = static_cast<float>(src[e * pb.sq[2]]) * sc_all;
      }
    }
  }
  for (int i = 0; i < it.nq; ++i) {
    const int64_t pos = static_cast<int64_t>(kv_len) - q_len + it.q0 + i;
    int64_t lo = pb.window_left >= 0 ? std::max<int64_t>(start, pos - pb.window_left) : start;
    int64_t hi = pb.causal && !pb.mask ? std::min<int64_t>(kv_len, pos + 1) : kv_len;  // a mask replaces causal
    if (!pb.causal && pb.window_right >= 0) hi = std::min<int64_t>(hi, pos + pb.window_right + 1);
    if (pb.rope_freq && q_rows) {  // q turns at its sequence position (minus the StreamingLLM gap for the sinks)
      const int64_t gap = sink_pass ? std::max<int64_t>(0, pos - pb.window_left - sink_end) : 0;
      for (int h = 0; h < pb.num_kv_heads; ++h)
        for (int g = 0; g < pb.group; ++g)
          rotate_row(sc.qf.data() + (static_cast<size_t>(h) * rows_pad + i * pb.group + g) * pb.d_pad, pb.d,
                     pb.rope_freq, static_cast<double>(pos - start - gap));
    }
    if (sink_pass) {
      hi = std::min(hi, sink_end);
      lo = start;
    }
    for (int g = 0; g < pb.group; ++g) {
      const int r = i * pb.group + g;
      sc.row_lo[r] = lo;
      sc.row_hi[r] = std::max<int64_t>(lo, hi);
      sc.row_pos[r] = pos;
      if (pb.mask) sc.row_mask[r] = pb.mask_off[it.b] + static_cast<int64_t>(it.q0 + i) * q_len;
      if (pb.alibi)
        for (int h = 0; h < pb.num_kv_heads; ++h)
          sc.slope[static_cast<size_t>(h) * rows_pad + r] = pb.alibi[it.b * pb.alibi_stride + h * pb.group + g];
    }
  }
}

// NW (vec.h) values of a row as fp32
template <typename T>
inline nv load_nw(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return loadn(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    typedef uint16_t vhn __attribute__((vector_size(NW * 2)));
    typedef uint32_t vun __attribute__((vector_size(NW * 4)));
    vhn h;
    std::memcpy(&h, p, sizeof h);
    return (nv)(__builtin_convertvector(h, vun) << 16);
  } else {
    nv v;
    for (int i = 0; i < NW; ++i) v[i] = to_f(p[i]);
    return v;
  }
}

template <typename T>
inline vf load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return loadu(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    vh h;
    std::memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
  } else {
    vf v;
    for (int i = 0; i < L; ++i) v[i] = to_f(p[i]);
    return v;
  }
}

// Row r's scores s of the 16 positions j0 + c (lane c; positions past c >= n are masked): softcap, ALiBi (slope: the
// KV head's per-row slopes, or null), the row's visible range [row_lo, row_hi), the custom mask (masked lanes: -inf).
// Shared by the register kernel (chunk) and the GEMM one (attend_gemm).
inline void mask_scores(const Problem& pb, const Scratch& sc, int r, int64_t j0, int n, vf& s, const float* slope) {
  vi lane;
  for (int c = 0; c < L; ++c) lane[c] = c;
  // a bound as a lane offset from j0, clamped into [-1, L] (int64 positions, int32 lanes)
  auto rel = [j0](int64_t x) { return static_cast<int32_t>(std::clamp<int64_t>(x - j0, -1, L)); };
  if (pb.softcap > 0.f) s = vtanh(s * (1.0f / pb.softcap)) * pb.softcap;
  if (slope) {  // ALiBi: - slope * |pos - j|, after softcap, before masking
    const int64_t d0 = j0 - sc.row_pos[r];  // lane c is at distance d0 + c
    vf dist;
    if (d0 > -(int64_t(1) << 24) && d0 < (int64_t(1) << 24)) {  // exact in int32 and fp32
      dist = __builtin_convertvector(lane + splati(static_cast<int32_t>(d0)), vf);
    } else {
      for (int c = 0; c < L; ++c) dist[c] = static_cast<float>(d0 + c);
    }
    s -= slope[r] * vsel(vlt(dist, splat(0.f)), -dist, dist);
  }
  const int64_t rlo = sc.row_lo[r], rhi = sc.row_hi[r];
  if (!(n == L && rlo <= j0 && j0 + L <= rhi)) {
    const vi vis = ige(lane, splati(rel(rlo))) & ilt(lane, splati(rel(std::min<int64_t>(rhi, j0 + n))));
    s = vsel(vis, s, splat(NEG_INF));
  }
  if (pb.mask && j0 + n > sc.first_new) {  // custom mask: new key c = j - first_new is visible iff its bit is set
    vi bits;
    for (int c = 0; c < L; ++c) {
      const int64_t key = j0 + c - sc.first_new;
      bits[c] = key < 0 || c >= n || pb.mask_bit(sc.row_mask[r] + key) ? -1 : 0;
    }
    s = vsel(ine(bits, splati(0)), s, splat(NEG_INF));
  }
}

// Online softmax of rows [0, rows) over the chunk's scores S (sc.s, rows of NV * 16 lanes): softcap before masking
// (mask_scores), running max m, per-lane sums lv, the rescale alpha of each row's accumulator (sc.alpha) and
// P = exp(S - m) (sc.p, the same layout); lane c is position j0 + c. Shared by chunk (NV = 1) and chunk_pairs.
template <int NV = 1>
inline void online_softmax(const Problem& pb, Scratch& sc, int rows, int64_t j0, int n, float* m, vf* lv,
                           const float* slope) {
  constexpr int W = NV * L;
  const float* S = sc.s.data();
  float* P = sc.p.data();
  float* alpha = sc.alpha.data();
  // 1. per row: masks, the running max and alpha; P holds S - m (-inf where nothing is visible: exp gives 0)
  for (int r = 0; r < rows; ++r) {
    vf s[NV];
    for (int v = 0; v < NV; ++v) {
      s[v] = loadu(S + r * W + v * L);
      mask_scores(pb, sc, r, j0 + v * L, std::clamp(n - v * L, 0, L), s[v], slope);
    }
    vf mx = s[0];
    for (int v = 1; v < NV; ++v) mx = vsel(vgt(s[v], mx), s[v], mx);
    // a visible key's NaN score (NaN in q or K, a NaN slope) makes the row NaN, as SDPA's: the max over lanes drops
    // NaN, so with a finite max the NaN lanes reach exp, P and l (finalize then writes NaN); only a chunk whose
    // other lanes are all masked needs the explicit check
    const float mc = hmax(mx);
    if (mc <= m[r]) {  // running max unchanged (also: nothing visible in this chunk)
      alpha[r] = 1.f;
      if (mc == NEG_INF) {
        bool nan = false;
        for (int v = 0; v < NV; ++v) {
          nan |= any_nan(s[v]);
          storeu(P + r * W + v * L, splat(NEG_INF));
        }
        if (nan) lv[r] = splat(std::numeric_limits<float>::quiet_NaN());
        continue;
      }
    } else {
      alpha[r] = std::exp(m[r] - mc);  // 0 when m was -inf
      m[r] = mc;
    }
    for (int v = 0; v < NV; ++v) storeu(P + r * W + v * L, s[v] - m[r]);
  }
  // 2. P = exp(P) in place, two rows per step (vexpn_k interleaves their vectors' polynomial steps), and the rows'
  // per-lane sums lv = lv * alpha + P
  constexpr int VR = W / NW;  // hardware-width vectors per row
  auto exp_rows = [&](int r0, auto two) {
    constexpr int K = decltype(two)::value ? 2 * VR : VR;
    nv x[K];
    for (int k = 0; k < K; ++k) x[k] = loadn(P + r0 * W + k * NW);
    vexpn_k<K>(x);
    for (int k = 0; k < K; ++k) storen(P + r0 * W + k * NW, x[k]);
    for (int r = r0; r < r0 + (decltype(two)::value ? 2 : 1); ++r) {
      vf sum = lv[r] * alpha[r];
      for (int v = 0; v < NV; ++v) sum += loadu(P + r * W + v * L);
      lv[r] = sum;
    }
  };
  int r = 0;
  for (; r + 2 <= rows; r += 2) exp_rows(r, std::true_type{});
  if (r < rows) exp_rows(r, std::false_type{});
}

// acc[r, dims [e0, e0 + VP * NW)] = acc * alpha + P V, RB rows at a time (RB x VP accumulators; one prefetch step per
// V vector load)
template <typename T, int RB, int VP, int W>
inline void pv_rows(const float* P, const float* alpha, const T* const* vp, int n, int e0, int rows_pad, int dvp,
                    float* acc, Prefetcher& pf) {  // P: rows of W lanes
  for (int r0 = 0; r0 < rows_pad; r0 += RB) {
    nv a[VP][RB];
    for (int w = 0; w < VP; ++w)
      for (int i = 0; i < RB; ++i) a[w][i] = loadn(acc + static_cast<size_t>(r0 + i) * dvp + e0 + w * NW) * alpha[r0 + i];
    for (int t = 0; t < n; ++t) {
#pragma GCC unroll 16
      for (int w = 0; w < VP; ++w) {
        pf.step();
        const nv vv = load_nw(vp[t] + e0 + w * NW);
        for (int i = 0; i < RB; ++i) a[w][i] += P[(r0 + i) * W + t] * vv;
      }
    }
    for (int w = 0; w < VP; ++w)
      for (int i = 0; i < RB; ++i) storen(acc + static_cast<size_t>(r0 + i) * dvp + e0 + w * NW, a[w][i]);
  }
}

// One chunk of n <= W = NV * 16 tokens whose K/V rows are kp[t], vp[t] (unit stride, dp / dvp elements readable, tokens
// t >= n point at zeros): scores, online softmax, accumulation. Rows go RB at a time (RB = rows_pad <= 8, else 8).
template <typename T, int RB, int NV>
inline void chunk(const Problem& pb, const T* const* kp, const T* const* vp, int n, int64_t j0, int rows, int rows_pad,
                  Scratch& sc, const float* qf, const float* qt, float* m, vf* lv, float* acc, Prefetcher& pf,
                  const float* slope) {  // qf: the KV head's queries row-major, qt: dim-major per block of RB rows
  constexpr int W = NV * L;  // tokens of the chunk (NV = 1 with RoPE at read: sc.rc / sc.rs hold 16 positions)
  const int dp = pb.d_pad, dvp = pb.dv_pad;
  float* S = sc.s.data();
  float* P = sc.p.data();
  float* alpha = sc.alpha.data();
  float* kt = sc.kt.data();
  // K of the W tokens, transposed: kt[e * W + t] holds dim e of token t
  for (int v = 0; v < NV; ++v)
    for (int e0 = 0; e0 < dp; e0 += L) {
      vf tile[L];
      for (int t = 0; t < L; ++t) tile[t] = load16(kp[v * L + t] + e0);
      transpose16_to(tile, kt + static_cast<size_t>(e0) * W + v * L, W);
    }
  if (NV == 1 && pb.rope_freq) {  // RoPE at read time: turn the 16 keys by their positions (sc.rc / sc.rs, set by attend)
    const int half = pb.d / 2;
    for (int i = 0; i < half; ++i) {
      const vf a = loadu(kt + static_cast<size_t>(i) * L), b = loadu(kt + static_cast<size_t>(i + half) * L);
      const vf c = loadu(sc.rc.data() + static_cast<size_t>(i) * L), sn = loadu(sc.rs.data() + static_cast<size_t>(i) * L);
      storeu(kt + static_cast<size_t>(i) * L, a * c - b * sn);
      storeu(kt + static_cast<size_t>(i + half) * L, b * c + a * sn);
    }
  }
  // scores: S[r] = q_r . k_t for the W tokens, RB rows at a time (each query broadcast feeds NV FMAs, each kt load RB);
  // NA accumulator sets (dims e = j mod NA, NA a power of 2) keep about ACC_REGS (vec.h) FMA chains in flight
  // (in hardware-width parts of NW tokens, vec.h: on AVX2 NA * RB = 8 accumulators are 8 of the 16 ymm registers).
  // One pointer each into K and the queries (qt: dim-major per row block), stepped per NA dims: constant offsets
  constexpr int NA = pow2_floor(ACC_REGS / (RB * NV) > 0 ? ACC_REGS / (RB * NV) : 1);
  for (int r0 = 0; r0 < rows_pad; r0 += RB) {
    const float* q0 = qt + static_cast<size_t>(r0) * dp;
    const float* qr = qf + static_cast<size_t>(r0) * dp;
    for (int c = 0; c < NH; ++c) {
      nv a[NA][NV][RB] = {};
      const float* kv_p = kt + c * NW;
      const float* qe = q0;
      for (int e = 0; e < dp; e += NA, kv_p += NA * W, qe += NA * RB) {
#pragma GCC unroll 16
        for (int j = 0; j < NA; ++j) {
#pragma GCC unroll 2
          for (int v = 0; v < NV; ++v) {
            pf.step();
            const nv kv = loadn(kv_p + j * W + v * L);
            // NV = 1: the row-major queries (GCC then keeps the broadcasts as memory operands; from qt it loaded
            // them into registers and spilled accumulators)
            if constexpr (NV == 1)
              for (int i = 0; i < RB; ++i) a[j][v][i] += qr[i * dp + e + j] * kv;
            else
              for (int i = 0; i < RB; ++i) a[j][v][i] += qe[j * RB + i] * kv;
          }
        }
      }
      for (int v = 0; v < NV; ++v)
        for (int i = 0; i < RB; ++i) {
          nv sum = a[0][v][i];
          for (int j = 1; j < NA; ++j) sum += a[j][v][i];
          storen(S + (r0 + i) * W + v * L + c * NW, sum);
        }
    }
  }
  online_softmax<NV>(pb, sc, rows, j0, n, m, lv, slope);
  // acc[r] = acc[r] * alpha[r] + sum_t P[r, t] v_t, RB rows x VP vectors of NW dims (vec.h) of accumulators at a time
  constexpr int VP = pow2_floor(ACC_REGS / RB);
  int e0 = 0;
  for (; e0 + VP * NW <= dvp; e0 += VP * NW) pv_rows<T, RB, VP, W>(P, alpha, vp, n, e0, rows_pad, dvp, acc, pf);
  for (; e0 < dvp; e0 += NW) pv_rows<T, RB, 1, W>(P, alpha, vp, n, e0, rows_pad, dvp, acc, pf);
  pf.rest();
}

#include "chunk_pairs.h"  // chunk_pairs: chunk() for bf16 caches, reading K / V as 32-bit words

// Online softmax of rows [0, rows) of every KV head over KV positions [lo, hi) of item `it`. `state` holds, per KV
// head, m [rows_pad], l [rows_pad], acc [rows_pad, dv_pad] (head_size floats), updated in place. The KV heads of a
// chunk are processed back to back, so a token's rows of all heads (often one contiguous run) are read together.
template <typename TK, int RB>
void attend(const Problem& pb, const Item& it, int64_t lo, int64_t hi, int rows, int rows_pad, Scratch& sc,
            float* state, int64_t head_size) {
  const TK* kc = static_cast<const TK*>(pb.k);
  const TK* vc = static_cast<const TK*>(pb.v);
  const int32_t* table = pb.table + it.b * pb.table_stride;
  const int d = pb.d, dp = pb.d_pad, dvp = pb.dv_pad, nh = pb.num_kv_heads;
  // rows are read in place when unit-stride and a multiple of 16 long; otherwise staged (converted, zero-padded)
  const bool direct = pb.sk[3] == 1 && pb.sv[3] == 1 && d == dp && pb.d_v == dvp;
  // bf16 rows read in place go through chunk_pairs (accumulators in its layout while this pass runs)
  constexpr bool bf16 = std::is_same_v<TK, c10::BFloat16>;
  const bool pairs = bf16 && direct && d % (2 * L) == 0 && pb.d_v % (2 * NW) == 0 && !pb.rope_freq;
  if (pairs)
    for (int h = 0; h < nh; ++h) pair_layout(state + h * head_size + 2 * rows_pad, rows_pad, dvp, true);
  for (int h = 0; h < nh; ++h)  // the running sum carries over from an earlier pass (sinks), in lane 0
    for (int r = 0; r < rows_pad; ++r) {
      vf l0{};
      l0[0] = r < rows ? state[h * head_size + rows_pad + r] : 0.f;
      sc.lv[static_cast<size_t>(h) * rows_pad + r] = l0;
    }
  const int k_bytes = d * static_cast<int>(sizeof(TK)), v_bytes = pb.d_v * static_cast<int>(sizeof(TK));
  // chunks of CW tokens: WIDE_NV * 16 (vec.h) for rows read in place without RoPE at read whose chunk of one KV head
  // fits WIDE_UNIT_BYTES (the chunk being computed and the one prefetched stay in L1: 32 fp32 tokens of head_dim 128
  // were 5% slower than 16), else 16
  const bool wide = WIDE_NV > 1 && direct && !pb.rope_freq && 2 * L * (k_bytes + v_bytes) <= WIDE_UNIT_BYTES;
  const int CW = wide ? WIDE_NV * L : L;
  if (wide)  // the queries of each block of RB rows dim-major (qt[e * RB + i]): one base register for the broadcasts
    for (int h = 0; h < nh; ++h)
      for (int r0 = 0; r0 < rows_pad; r0 += RB) {
        const float* src = sc.qf.data() + (static_cast<size_t>(h) * rows_pad + r0) * dp;
        float* dst = sc.qt.data() + (static_cast<size_t>(h) * rows_pad + r0) * dp;
        for (int e = 0; e < dp; ++e)
          for (int i = 0; i < RB; ++i) dst[e * RB + i] = src[static_cast<size_t>(i) * dp + e];
      }
  const TK* kb[2 * L];
  const TK* vb[2 * L];
  const TK* kp[2 * L];
  const TK* vp[2 * L];
  const float* kps[L];
  const float* vps[L];
  const TK* zeros = reinterpret_cast<const TK*>(sc.zeros.data());
  // head 0's rows of positions [j, j + n): one division per run of positions, then (block, row) steps
  auto token_bases = [&](int64_t j, int n, const TK** k, const TK** v) {
    int64_t blk_i = j / pb.block_size, row = j % pb.block_size;
    int64_t blk = table[blk_i];
    for (int t = 0; t < n; ++t) {
      k[t] = kc + blk * pb.sk[0] + row * pb.sk[1];
      v[t] = vc + blk * pb.sv[0] + row * pb.sv[1];
      if (++row == pb.block_size && t + 1 < n) {
        row = 0;
        blk = table[++blk_i];
      }
    }
  };
  // software prefetch (the blocks are scattered, so the hardware prefetcher alone leaves chunks waiting on memory):
  // work goes in units (chunk, KV head); while unit u is computed, the lines of unit u + ahead are issued one per
  // inner step of its math (Prefetcher), `ahead` sized so that ~PREFETCH_BYTES of K/V are in flight (within L1)
  const int unit_bytes = CW * (k_bytes + v_bytes);
  const int ahead = std::max(1, (PREFETCH_BYTES + unit_bytes - 1) / unit_bytes);
  const TK* fk[2 * L];
  const TK* fv[2 * L];
  const char* fkc[2 * L];  // the same as bytes (what the Prefetcher walks)
  const char* fvc[2 * L];
  int64_t fj = -1;  // the chunk whose bases fk/fv hold
  int fn = 0;  // its tokens
  const int kl = pb.sk[3] == 1 ? (k_bytes + 63) / 64 : 0, vl = pb.sv[3] == 1 ? (v_bytes + 63) / 64 : 0;
  auto list_lines = [&](int64_t j, int h) {
    if (j >= hi) return Prefetcher(fkc, fvc, 0, 0, 0, 0, 0);
    if (j != fj) {
      fj = j;
      fn = static_cast<int>(std::min<int64_t>(CW, hi - j));
      token_bases(j, fn, fk, fv);
      for (int t = 0; t < fn; ++t) {
        fkc[t] = reinterpret_cast<const char*>(fk[t]);
        fvc[t] = reinterpret_cast<const char*>(fv[t]);
      }
    }
    return Prefetcher(fkc, fvc, h * pb.sk[2] * static_cast<int64_t>(sizeof(TK)), h * pb.sv[2] * static_cast<int64_t>(sizeof(TK)),
                      fn, kl, vl);
  };
  for (int u = 0; u < ahead; ++u) list_lines(lo + int64_t(u / nh) * CW, u % nh).rest();  // the first units: at once
  const int half = pb.d / 2;
  if (pb.rope_freq) {  // the rotation at the first key position; later ones by exact steps (double)
    const double p0 = static_cast<double>(lo - pb.seq_start(it.b));
    for (int i = 0; i < half; ++i) {
      sc.rope_c[i] = std::cos(p0 * pb.rope_freq[i]);
      sc.rope_s[i] = std::sin(p0 * pb.rope_freq[i]);
    }
  }
  for (int64_t j0 = lo; j0 < hi; j0 += CW) {
    const int n = static_cast<int>(std::min<int64_t>(CW, hi - j0));
    token_bases(j0, n, kb, vb);
    if (pb.rope_freq) {  // cos/sin of the chunk's 16 positions, shared by its KV heads
      double* c = sc.rope_c.data();
      double* sn = sc.rope_s.data();
      const double* sc_ = sc.rope_step_c.data();
      const double* ss_ = sc.rope_step_s.data();
      for (int t = 0; t < L; ++t) {
        for (int i = 0; i < half; ++i) {
          sc.rc[static_cast<size_t>(i) * L + t] = static_cast<float>(c[i]);
          sc.rs[static_cast<size_t>(i) * L + t] = static_cast<float>(sn[i]);
          const double nc = c[i] * sc_[i] - sn[i] * ss_[i], ns = sn[i] * sc_[i] + c[i] * ss_[i];
          c[i] = nc;
          sn[i] = ns;
        }
      }
    }
    for (int h = 0; h < nh; ++h) {
      const float* slope = pb.alibi ? sc.slope.data() + static_cast<size_t>(h) * rows_pad : nullptr;
      Prefetcher pf = list_lines(j0 + int64_t((h + ahead) / nh) * CW, (h + ahead) % nh);
      const float* qf = sc.qf.data() + static_cast<size_t>(h) * rows_pad * dp;  // the KV head's queries
      const float* qt = sc.qt.data() + static_cast<size_t>(h) * rows_pad * dp;  // the same, dim-major per row block
      float* m = state + h * head_size;
      float* acc = m + 2 * rows_pad;
      vf* lv = sc.lv.data() + static_cast<size_t>(h) * rows_pad;
      for (int t = 0; t < CW; ++t) {  // positions >= hi are never read: their rows point at zeros
        kp[t] = t < n ? kb[t] + h * pb.sk[2] : zeros;
        vp[t] = t < n ? vb[t] + h * pb.sv[2] : zeros;
      }
      if constexpr (bf16) {
        if (pairs) {
          if (wide)
            chunk_pairs<RB, WIDE_NV>(pb, kp, vp, n, j0, rows, rows_pad, sc, qf, qt, m, lv, acc, pf, slope);
          else
            chunk_pairs<RB, 1>(pb, kp, vp, n, j0, rows, rows_pad, sc, qf, qt, m, lv, acc, pf, slope);
          continue;
        }
      }
      if (direct) {
        if (wide)
          chunk<TK, RB, WIDE_NV>(pb, kp, vp, n, j0, rows, rows_pad, sc, qf, qt, m, lv, acc, pf, slope);
        else
          chunk<TK, RB, 1>(pb, kp, vp, n, j0, rows, rows_pad, sc, qf, qt, m, lv, acc, pf, slope);
        continue;
      }
      for (int t = 0; t < L; ++t) {
        float* kr = sc.ktmp.data() + static_cast<size_t>(t) * dp;
        float* vr = sc.vtmp.data() + static_cast<size_t>(t) * dvp;
        if (t < n) {
          load_row(kp[t], pb.sk[3], d, kr, dp);
          load_row(vp[t], pb.sv[3], pb.d_v, vr, dvp);
        } else {
          std::memset(kr, 0, sizeof(float) * dp);
          std::memset(vr, 0, sizeof(float) * dvp);
        }
        kps[t] = kr;
        vps[t] = vr;
      }
      chunk<float, RB, 1>(pb, kps, vps, n, j0, rows, rows_pad, sc, qf, qt, m, lv, acc, pf, slope);
    }
  }
  for (int h = 0; h < nh; ++h)
    for (int r = 0; r < rows; ++r) state[h * head_size + rows_pad + r] = hsum(sc.lv[h * rows_pad + r]);
  if (pairs)
    for (int h = 0; h < nh; ++h) pair_layout(state + h * head_size + 2 * rows_pad, rows_pad, dvp, false);
}

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

// The value contracts of paged_attention (kvops/_checks/values.py, docs/semantics.md §7) over the int32 index
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

// The message of the first violated contract, in values.py's order and words (_raise_attention); only on failure.
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

// Eager CPU calls' value check (kvops/_checks/values.py): true when a contract is violated (values.py then raises).
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
