// The register kernel's chunk for bf16 caches and bf16 queries on CPUs with AVX512-BF16 (Zen 4 and later, Sapphire
// Rapids, Cooper Lake; included by attend_regs.h after chunk_pairs.h; hashed with the sources by
// kvops/native/__init__.py). vdpbf16ps multiplies 16 pairs of bf16 and adds both products of each pair to an fp32
// lane: one instruction where chunk_pairs spends two FMAs and two integer ops per pair of dims.
// - Scores: K is transposed as 32-bit words (dims 2w, 2w + 1 of a token), as in chunk_pairs, and each word vector is
//   dotted with the broadcast word of a query row's bf16 q (the query as given, unscaled: the products are exact);
//   the fp32 sums are scaled after. So the scores are those of an fp32 dot product of the bf16 inputs.
// - PV: P is rounded to bf16 (round to nearest even), as PyTorch's CPU flash attention and FlashAttention do for bf16
//   inputs, and paired along tokens: the V rows of tokens t and t + 1 interleaved (vpunpcklwd / vpunpckhwd) give, per
//   group of 32 dims, the pairs (v_t, v_t+1) of dims {0-3, 8-11, 16-19, 24-27} and of {4-7, 12-15, 20-23, 28-31}, so
//   while attend runs the accumulator rows hold each group in that order (dot_layout on entry and exit). The row
//   sums l come from the fp32 P.
// Needs what chunk_pairs needs (head_dim % 32 == 0, head_dim_v % 32 == 0, unit-stride rows, no RoPE at read), a bf16
// q, and no k_scale (fp8 only). Runs where paged_attention.cpp's bf16_dot_wanted() says: on AMD CPUs by default
// (Zen 4: faster than chunk_pairs; on an Intel Xeon vdpbf16ps issued at half the FMAs' rate per product), or as
// KVOPS_NATIVE_BF16_DOT chooses.
#pragma once

#if defined(__AVX512BF16__)
constexpr bool DOT_BF16 = true;
#else
constexpr bool DOT_BF16 = false;
#endif

// lane l of a 32-dim group in the dot layout holds dim dot_dim(l)
constexpr int dot_dim(int l) { return 8 * ((l % 16) / 4) + 4 * (l / 16) + l % 4; }

// acc rows [rows][dvp]: plain dim order -> the dot layout per group of 32 dims (to_dot), or back
inline void dot_layout(float* acc, int rows, int dvp, bool to_dot) {
  float tmp[32];
  for (int r = 0; r < rows; ++r)
    for (int g0 = 0; g0 < dvp; g0 += 32) {
      float* a = acc + static_cast<size_t>(r) * dvp + g0;
      for (int l = 0; l < 32; ++l) {
        if (to_dot)
          tmp[l] = a[dot_dim(l)];
        else
          tmp[dot_dim(l)] = a[l];
      }
      std::memcpy(a, tmp, sizeof tmp);
    }
}

// The KV heads' bf16 query words, word-major per block of RB rows: qw[(h * rows_pad + r0) * words + w * RB + i] holds
// dims (2w, 2w + 1) of row r0 + i (rows past `rows`: zero), for broadcasts from one base register
template <int RB>
void load_query_words(const Problem& pb, const Item& it, int rows, int rows_pad, Scratch& sc) {
  const uint16_t* q = static_cast<const uint16_t*>(pb.q);
  const int64_t t0 = pb.cu[it.b] + it.q0;
  const int words = pb.d / 2;
  sc.qw.assign(static_cast<size_t>(pb.num_kv_heads) * rows_pad * words, 0u);
  for (int h = 0; h < pb.num_kv_heads; ++h)
    for (int r = 0; r < rows; ++r) {
      const int i = r / pb.group, g = r % pb.group;
      const uint16_t* src = q + (t0 + i) * pb.sq[0] + static_cast<int64_t>(h * pb.group + g) * pb.sq[1];
      uint32_t* dst = sc.qw.data() + (static_cast<size_t>(h) * rows_pad + (r / RB) * RB) * words + r % RB;
      for (int w = 0; w < words; ++w)
        dst[static_cast<size_t>(w) * RB] = src[2 * w * pb.sq[2]] | static_cast<uint32_t>(src[(2 * w + 1) * pb.sq[2]]) << 16;
    }
}

#if defined(__AVX512BF16__)
inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// One chunk of n <= NV * 16 tokens (kp / vp: NV * 16 rows, those past n pointing at zeros); qw: the KV head's query
// words (load_query_words)
template <int RB, int NV>
inline void chunk_dot(const Problem& pb, const c10::BFloat16* const* kp, const c10::BFloat16* const* vp, int n,
                      int64_t j0, int rows, int rows_pad, Scratch& sc, const uint32_t* qw, float* m, vf* lv,
                      float* acc, const Prefetcher& pfw, const float* slope) {
  PfStep pf(pfw);
  constexpr int W = NV * L;  // tokens of the chunk = lanes of a row of S and P
  const int dvp = pb.dv_pad, words = pb.d / 2;
  float* S = sc.s.data();
  const float* alpha = sc.alpha.data();
  float* kt = sc.kt.data();  // kt[w * W + t]: word w (dims 2w, 2w + 1) of token t
  transpose_k_words<NV>(kp, words, kt);
  // scores: NA accumulator sets over words keep about ACC_REGS chains in flight; each query word is broadcast from
  // memory into the dot product
  constexpr int NA = pow2_floor(ACC_REGS / (RB * NV) > 0 ? ACC_REGS / (RB * NV) : 1);
  const __m512 scale = _mm512_set1_ps(pb.scale);
  for (int r0 = 0; r0 < rows_pad; r0 += RB) {
    __m512 a[NA][NV][RB];
    for (int j = 0; j < NA; ++j)
      for (int v = 0; v < NV; ++v)
        for (int i = 0; i < RB; ++i) a[j][v][i] = _mm512_setzero_ps();
    const float* kw_p = kt;
    const uint32_t* qe = qw + static_cast<size_t>(r0) * words;
    for (int w = 0; w < words; w += NA, kw_p += NA * W, qe += NA * RB) {
#pragma GCC unroll 16
      for (int j = 0; j < NA; ++j) {
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) {
          pf.step<true>();
          const __m512bh kw = as_bh(_mm512_loadu_si512(kw_p + j * W + v * L));
          for (int i = 0; i < RB; ++i)
            a[j][v][i] = _mm512_dpbf16_ps(a[j][v][i], kw, as_bh(_mm512_set1_epi32(static_cast<int>(qe[j * RB + i]))));
        }
      }
    }
    for (int v = 0; v < NV; ++v)
      for (int i = 0; i < RB; ++i) {
        __m512 sum = a[0][v][i];
        for (int j = 1; j < NA; ++j) sum = _mm512_add_ps(sum, a[j][v][i]);
        _mm512_storeu_ps(S + (r0 + i) * W + v * L, _mm512_mul_ps(sum, scale));
      }
  }
  online_softmax<NV>(pb, sc, rows, j0, n, m, lv, slope);
  // P in bf16, rows of W / 2 words (token pairs)
  uint32_t* pw = sc.pw.data();
  for (int r = 0; r < rows_pad; ++r) {
    const float* p = sc.p.data() + r * W;
    if constexpr (NV == 2) {
      const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + L), _mm512_loadu_ps(p));
      std::memcpy(pw + r * L, &b, sizeof b);
    } else {
      const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(p));
      std::memcpy(pw + r * (L / 2), &b, sizeof b);
    }
  }
  // acc = acc * alpha + P V: WP groups of 32 dims x 2 halves x RB rows of accumulators per pass
  const int groups = dvp / 32;
  constexpr int WP = ACC_REGS / (2 * RB) > 0 ? ACC_REGS / (2 * RB) : 1;
  auto pass = [&](int g0, auto wp) {
    constexpr int P_ = decltype(wp)::value;
    for (int r0 = 0; r0 < rows_pad; r0 += RB) {
      __m512 a[P_][2][RB];
      for (int w = 0; w < P_; ++w)
        for (int o = 0; o < 2; ++o)
          for (int i = 0; i < RB; ++i)
            a[w][o][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + static_cast<size_t>(r0 + i) * dvp + (g0 + w) * 32 + o * L),
                                       _mm512_set1_ps(alpha[r0 + i]));
      const uint32_t* pr = pw + static_cast<size_t>(r0) * (W / 2);
      for (int t = 0; t < n; t += 2) {
#pragma GCC unroll 4
        for (int w = 0; w < P_; ++w) {
          pf.step<true>();
          const __m512i v0 = _mm512_loadu_si512(vp[t] + (g0 + w) * 32);
          const __m512i v1 = _mm512_loadu_si512(vp[t + 1] + (g0 + w) * 32);
          pf.step<true>();
          const __m512bh lo = as_bh(_mm512_unpacklo_epi16(v0, v1)), hi = as_bh(_mm512_unpackhi_epi16(v0, v1));
          for (int i = 0; i < RB; ++i) {
            const __m512bh pp = as_bh(_mm512_set1_epi32(static_cast<int>(pr[i * (W / 2) + t / 2])));
            a[w][0][i] = _mm512_dpbf16_ps(a[w][0][i], lo, pp);
            a[w][1][i] = _mm512_dpbf16_ps(a[w][1][i], hi, pp);
          }
        }
      }
      for (int w = 0; w < P_; ++w)
        for (int o = 0; o < 2; ++o)
          for (int i = 0; i < RB; ++i)
            _mm512_storeu_ps(acc + static_cast<size_t>(r0 + i) * dvp + (g0 + w) * 32 + o * L, a[w][o][i]);
    }
  };
  int g = 0;
  for (; g + WP <= groups; g += WP) pass(g, std::integral_constant<int, WP>{});
  for (; g < groups; ++g) pass(g, std::integral_constant<int, 1>{});
  pf.rest();
}
#endif
