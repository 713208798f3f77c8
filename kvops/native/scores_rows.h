// The scores of chunk_pairs (bf16 caches read as 32-bit words) on AVX2 builds at 1-5 query rows per KV head
// (included by chunk_pairs.h; hashed with the sources by kvops/native/__init__.py).
//
// chunk_pairs() transposes a chunk's K words (kt: words x tokens) and multiplies each vector of 8 tokens with broadcast
// queries. On AVX2 at few rows per KV head that costs a broadcast per FMA, an 8 x 8 transpose per 8 words and tokens,
// and (at 1-2 rows) too few FMA chains to hide their latency. Here each token's K row is read as stored and multiplied
// with the rows' queries as vectors along the dims: per row two accumulators (the row's word vectors alternate between
// them), one K load per 2 RB FMAs, no broadcast, no transpose; per token the RB sums across lanes (hsum4) go to a 16 x
// 8 tile that one 8 x 8 transpose per 8 tokens turns into S's rows. Microbenchmark (x86-64-v3 build, AMD EPYC Zen 4, K
// in L1, one 16-token chunk): K transposed + scores took 1.3-2.2x as long as this at 1-4 rows (head_dim 64 and 128) and
// 1.1-1.5x at 5 rows; 0.99-1.4x at 6 rows in three runs and the same at 7, so 6-8 rows keep the transposed form. The
// kernel: Llama-3.1-8B bf16 decode (GQA 4), docs/native-kernel.md. The same form for fp32 caches (chunk()) was slower
// there (Llama fp32 B 8 ctx 1024: 5.5 -> 6.0 ms) and is not used. The sums run in another order than the transposed
// form's (the same fp32 FMAs).
#pragma once

#if defined(__AVX2__) && !defined(__AVX512F__)
template <int RB>
constexpr bool ROWS_FORM = RB <= 5;

inline __m128 hsum4(nv a0, nv a1, nv a2, nv a3) {  // [sum(a0), sum(a1), sum(a2), sum(a3)]
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps((__m256)a0, (__m256)a1), _mm256_hadd_ps((__m256)a2, (__m256)a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// one token's RB accumulator pairs -> st[0, RB): its scores
template <int RB>
inline void token_scores(const nv (&a)[RB][2], float* st) {
  nv s[8];
  for (int i = 0; i < 8; ++i) s[i] = i < RB ? a[i < RB ? i : 0][0] + a[i < RB ? i : 0][1] : nv{};
  _mm_store_ps(st, hsum4(s[0], s[1], s[2], s[3]));
  if constexpr (RB > 4) _mm_store_ps(st + 4, hsum4(s[4], s[5], s[6], s[7]));
}

// st[t][i] (16 tokens x 8) -> S[i * L + t] for rows i < RB
template <int RB>
inline void tile_to_rows(float (*st)[8], float* S) {
  for (int bt = 0; bt < L; bt += 8) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_load_ps(st[bt + i]);
    transpose8(r);
    for (int i = 0; i < RB; ++i) _mm256_storeu_ps(S + i * L + bt, r[i]);
  }
}

// bf16 rows read as 32-bit words (even / odd dims: vec.h): q holds per row its even dims' queries, then its odd
// dims' (split_queries), at a stride of dp; words = head_dim / 2, a multiple of 16
template <int RB>
inline void scores_rows(const c10::BFloat16* const* kp, const float* q, int dp, int words, float* S, PfStep& pf) {
  alignas(32) float st[L][8];
  for (int t = 0; t < L; ++t) {
    const float* kr = reinterpret_cast<const float*>(kp[t]);
    nv a[RB][2] = {};
    for (int w = 0; w < words; w += 2 * NW)
#pragma GCC unroll 2
      for (int o = 0; o < 2; ++o) {
        pf.step();
        const nv kw = loadn(kr + w + o * NW);
        const nv ke = even_dims(kw), ko = odd_dims(kw);
        for (int i = 0; i < RB; ++i) {
          a[i][o] += loadn(q + i * dp + w + o * NW) * ke;
          a[i][o] += loadn(q + i * dp + words + w + o * NW) * ko;
        }
      }
    token_scores<RB>(a, st[t]);
  }
  tile_to_rows<RB>(st, S);
}
#else
template <int RB>
constexpr bool ROWS_FORM = false;
template <int RB, typename... A>
inline void scores_rows(A...) {}
#endif

// the rows_pad query rows of every KV head, sc.qf -> sc.qt as the bf16 scores_rows reads them: per row its even
// dims, then its odd dims
inline void split_queries(const Problem& pb, int rows_pad, Scratch& sc) {
  const int dp = pb.d_pad, words = pb.d / 2;
  for (int r = 0; r < pb.num_kv_heads * rows_pad; ++r) {
    const float* src = sc.qf.data() + static_cast<size_t>(r) * dp;
    float* dst = sc.qt.data() + static_cast<size_t>(r) * dp;
    for (int w = 0; w < words; ++w) {
      dst[w] = src[2 * w];
      dst[words + w] = src[2 * w + 1];
    }
  }
}
