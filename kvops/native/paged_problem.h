// The register kernel's building blocks and the arguments of one call of the native paged attention (included by
// paged_attention.cpp after vec.h; hashed with the sources by kvops/native/__init__.py): small vector helpers,
// loading rows of any stored dtype as fp32, the software prefetcher, Problem (the call's arguments), Item (one
// sequence's query tile and KV range) and Scratch (per-thread buffers).
#pragma once

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
    } else if constexpr (std::is_same_v<T, c10::Half>) {
      for (; i + L <= n; i += L) storeu(dst + i, half16(reinterpret_cast<const uint16_t*>(src) + i));
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
// rows of a KV head in an item's state and query scratch, padded to the row block of the math: none up to 8 (the
// register kernel's templates; decode at GQA ratios 1-8: Qwen2.5's 5, 6 and 7 padded to 8 spent 12-37% of the FMAs on
// zero rows), else a multiple of 8; from 32 rows (the GEMM path: GEMM_MIN_ROWS) a multiple of 32, so its GEMMs come
// in few shapes
inline int pad_rows(int rows) { return rows <= 8 ? rows : round_up(rows, rows >= 32 ? 32 : 8); }

// The K/V rows of one KV head of a later chunk, prefetched one cache line per inner-loop step of the current chunk's
// math: a burst of hundreds of prefetches overflows the core's miss buffers and most of them are dropped, while one
// per step keeps memory busy under the arithmetic (a token's whole rows per step, 16 lines for fp32 Llama, was 10%
// slower there). The lines are walked from attend's token bases (KV head 0) plus the head's byte offsets, row by row:
// no per-line list is built (building one per chunk and head was ~12% of decode at GQA 7).
struct Prefetcher {
  // where the walk stands: the next line, the lines left in its row, 2 x its token + 1 at the token's V row. Kept
  // apart from the walk's constants and passed by value, so that the inner loops hold it in registers (PfStep): as a
  // member of an object whose address next_row took, it went through memory at every step, a store-to-load chain
  // longer than the step's FMAs on AVX2 (Zen 3: ~20% of Qwen2.5-0.5B fp32 decode sampled at the prefetch)
  struct Cursor {
    const char* p;
    int64_t lt;  // (2 x token + 1 at its V row) << 32 | lines left in the row: one register (two ints were packed
                 // into the return register through the stack, a failed store-to-load forward per row)
  };
  const char* const* k;  // row starts of the unit's tokens, KV head 0
  const char* const* v;
  int64_t hk, hv;  // byte offsets of the unit's KV head
  int n, kl, vl;  // tokens; cache lines per K / V row (0: rows not unit-stride, not prefetched)
  Cursor first;  // the walk's start (before the first step: "past token -1's V row")
  Prefetcher(const char* const* k_, const char* const* v_, int64_t hk_, int64_t hv_, int n_, int kl_, int vl_)
      : k(k_), v(v_), hk(hk_), hv(hv_), n(n_), kl(kl_), vl(vl_) {
    if (kl + vl == 0) n = 0;
    first = next_row(Cursor{nullptr, int64_t(-1) * (int64_t(1) << 32)});
  }
  static int left(int64_t lt) { return static_cast<int32_t>(lt & 0xffffffff); }  // lines left in the row
  // the next row, inline where K and V rows both have lines (unit-stride rows), else next_row: for chunk_dot and
  // chunk_pairs (the bf16 forms), whose short rows (Qwen2.5-0.5B: 2 lines) put ~8% of its decode's samples in
  // next_row's calls (AMD EPYC Zen 4, K/V in L2: AVX-512 build, chunk_dot; x86-64-v3 build, chunk_pairs: 7.5%, the
  // call 2.19 -> 2.13 ms, 10th percentiles of 50 ms windows, medians of 6 processes). Inlined in every chunk form it
  // was slower there: Qwen2.5-0.5B fp32 (chunk()) B 8 ctx 1024 0.54 -> 0.65 ms
  Cursor advance(Cursor c) const {
    const int64_t tv = (c.lt >> 32) + 1;
    if (tv < 2 * n && kl > 0 && vl > 0) {
      const int t = static_cast<int>(tv >> 1);
      return (tv & 1) ? Cursor{v[t] + hv, tv * (int64_t(1) << 32) + vl}
                      : Cursor{k[t] + hk, tv * (int64_t(1) << 32) + kl};
    }
    return next_row(c);
  }
  // the next row with lines to issue (left == 0 when done)
  __attribute__((noinline)) Cursor next_row(Cursor c) const {
    int64_t tv = c.lt >> 32;
    while (tv < 2 * n - 1) {
      ++tv;
      const int t = static_cast<int>(tv >> 1);
      const int lines = (tv & 1) ? vl : kl;
      if (lines) return Cursor{(tv & 1) ? v[t] + hv : k[t] + hk, tv * (int64_t(1) << 32) + lines};
    }
    return Cursor{nullptr, tv * (int64_t(1) << 32)};
  }
};

// One unit's walk as the inner loops step it (a local of chunk(): its cursor stays in registers)
struct PfStep {
  const Prefetcher* w;
  Prefetcher::Cursor c;
  explicit PfStep(const Prefetcher& pf) : w(&pf), c(pf.first) {}
  template <bool INLINE_ADVANCE = false>  // Prefetcher::advance
  inline void step() {
    if (Prefetcher::left(c.lt) > 0) {
      prefetch_line(c.p);
      c.p += 64;
      if (Prefetcher::left(--c.lt) == 0) c = INLINE_ADVANCE ? w->advance(c) : w->next_row(c);
    }
  }
  inline void rest() {
    while (Prefetcher::left(c.lt) > 0) step();
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
  bool bf16_dot;  // bf16 q, AVX512-BF16 build, bf16_dot_wanted(): bf16 caches read in place take chunk_dot.h
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
  avec<uint32_t> qw, pw;  // chunk_dot.h: the queries' bf16 words, P's bf16 token pairs
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
    pw.resize(static_cast<size_t>(rows_pad) * L);
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
