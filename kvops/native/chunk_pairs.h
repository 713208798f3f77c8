// The register kernel's chunk for bf16 caches read in place (included by paged_attention.cpp after chunk(); hashed
// with the sources by kvops/native/__init__.py). A bf16's fp32 value is its 16 bits shifted up by 16, so a 32-bit word
// holding the bf16 of dims (2w, 2w + 1) gives the fp32 of the even dim as (word << 16) and of the odd dim as
// (word & 0xffff0000): one integer op per vector, where converting bf16 -> fp32 through vpmovzxwd costs the shuffle
// port the K transpose and the FMAs also need (perf, AVX-512 host, Qwen2.5-0.5B decode at GQA 7: the K conversion and
// transpose were a quarter of the kernel's time). So K of a chunk is transposed as words (16 words = 32 dims per
// 16x16 transpose: half the permutes of transposing fp32, no conversion), and V is read as words too. The arithmetic
// is chunk()'s: fp32 FMAs, in the same order over dims for the scores.
//
// V's words give the even and the odd dims of 2 * NW consecutive dims as two vectors, so while attend runs the
// accumulator rows hold each group of 2 * NW dims as [even dims | odd dims] (pair_layout on entry and exit).
// Needs head_dim % 32 == 0 and head_dim_v % (2 * NW) == 0 (NW: vec.h), unit-stride rows, no RoPE at read.
#pragma once

inline nv even_dims(nv w) { return (nv)((nvi)w << 16); }
inline nv odd_dims(nv w) { return (nv)((nvi)w & (nvi{} + static_cast<int32_t>(0xffff0000u))); }

// The dim held at position k of a group of accumulator lanes: chunk_pairs' [even | odd] groups of 2 * NW dims, or
// chunk_dp's groups of 32 (vpunpck{l,h}wd interleave within 128-bit lanes: [dims 0-3, 8-11, 16-19, 24-27 | 4-7, ...])
inline int group_dim(int k, bool dp) {
  if (!dp) return k < NW ? 2 * k : 2 * (k - NW) + 1;
  const int half = k / 16, j = k % 16;
  return j / 4 * 8 + half * 4 + j % 4;
}

// acc rows [rows][dvp]: plain dim order -> the kernel's groups (to_group), or back
inline void pair_layout(float* acc, int rows, int dvp, bool dp, bool to_group) {
  const int width = dp ? 32 : 2 * NW;
  float tmp[32];
  for (int r = 0; r < rows; ++r)
    for (int g0 = 0; g0 < dvp; g0 += width) {
      float* a = acc + static_cast<size_t>(r) * dvp + g0;
      for (int k = 0; k < width; ++k) {
        if (to_group)
          tmp[k] = a[group_dim(k, dp)];
        else
          tmp[group_dim(k, dp)] = a[k];
      }
      std::memcpy(a, tmp, sizeof(float) * width);
    }
}

template <int RB>
inline void chunk_pairs(const Problem& pb, const c10::BFloat16* const* kp, const c10::BFloat16* const* vp, int n,
                        int64_t j0, int rows, int rows_pad, Scratch& sc, const float* qf, float* m, vf* lv, float* acc,
                        Prefetcher& pf, const float* slope) {
  const int dp = pb.d_pad, dvp = pb.dv_pad, words = pb.d / 2;
  float* S = sc.s.data();
  const float* P = sc.p.data();
  const float* alpha = sc.alpha.data();
  float* kt = sc.kt.data();  // kt[w] holds word w (dims 2w, 2w + 1) of every token
  for (int w0 = 0; w0 < words; w0 += L) {
    vf tile[L];
    for (int t = 0; t < L; ++t) std::memcpy(&tile[t], kp[t] + 2 * w0, sizeof(vf));
    transpose16_to(tile, kt + static_cast<size_t>(w0) * L);
  }
  // scores: as chunk(), with the dims of a word taken apart; NA accumulator sets over words keep 8 FMA chains
  constexpr int NA = 8 / RB;
  for (int r0 = 0; r0 < rows_pad; r0 += RB) {
    const float* q0 = qf + static_cast<size_t>(r0) * dp;
    for (int c = 0; c < NH; ++c) {
      nv a[NA][RB] = {};
      for (int w = 0; w < words; w += NA) {
        for (int j = 0; j < NA; ++j) {
          pf.step();
          const nv kw = loadn(kt + static_cast<size_t>(w + j) * L + c * NW);
          const nv ke = even_dims(kw), ko = odd_dims(kw);
          const int e = 2 * (w + j);
          for (int i = 0; i < RB; ++i) a[j][i] += q0[i * dp + e] * ke;
          for (int i = 0; i < RB; ++i) a[j][i] += q0[i * dp + e + 1] * ko;
        }
      }
      for (int i = 0; i < RB; ++i) {
        nv sum = a[0][i];
        for (int j = 1; j < NA; ++j) sum += a[j][i];
        storen(S + (r0 + i) * L + c * NW, sum);
      }
    }
  }
  online_softmax(pb, sc, rows, j0, n, m, lv, slope);
  // acc = acc * alpha + P V over the even, then the odd dims of each group of 2 * NW dims (NW words)
  for (int g0 = 0; g0 < dvp; g0 += 2 * NW) {
    for (int odd = 0; odd < 2; ++odd) {
      float* ab = acc + g0 + odd * NW;
      for (int r0 = 0; r0 < rows_pad; r0 += RB) {
        nv a[RB];
        for (int i = 0; i < RB; ++i) a[i] = loadn(ab + static_cast<size_t>(r0 + i) * dvp) * alpha[r0 + i];
        for (int t = 0; t < n; ++t) {
          pf.step();
          nv w;
          std::memcpy(&w, vp[t] + g0, sizeof w);
          const nv vv = odd ? odd_dims(w) : even_dims(w);
          for (int i = 0; i < RB; ++i) a[i] += P[(r0 + i) * L + t] * vv;
        }
        for (int i = 0; i < RB; ++i) storen(ab + static_cast<size_t>(r0 + i) * dvp, a[i]);
      }
    }
  }
  pf.rest();
}

#if defined(__AVX512BF16__)
// chunk_pairs with AVX512-BF16 dot products (vdpbf16ps: two bf16 products per lane into fp32), half the instructions
// of its FMAs: scores of the 16 tokens take word w of every token (the word transpose) against q's word w (q as given in
// bf16, sc.qw; the scale multiplies S); P of a row is rounded to bf16 in token pairs (as torch's CPU flash attention
// rounds P for its bf16 P V GEMM; l sums the fp32 P), and V's rows of tokens (2u, 2u + 1) are interleaved into pairs
// by vpunpck{l,h}wd. Needs head_dim and head_dim_v % 32 == 0 and bf16 queries (load_queries fills sc.qw).
template <int RB>
inline void chunk_dp(const Problem& pb, const c10::BFloat16* const* kp, const c10::BFloat16* const* vp, int n,
                     int64_t j0, int rows_pad, Scratch& sc, const uint32_t* qw, float* m, vf* lv, float* acc,
                     Prefetcher& pf, const float* slope, int rows) {
  const int dvp = pb.dv_pad, words = pb.d / 2;
  float* S = sc.s.data();
  const float* P = sc.p.data();
  const float* alpha = sc.alpha.data();
  uint32_t* pw = sc.pw.data();
  float* kt = sc.kt.data();
  for (int w0 = 0; w0 < words; w0 += L) {
    vf tile[L];
    for (int t = 0; t < L; ++t) std::memcpy(&tile[t], kp[t] + 2 * w0, sizeof(vf));
    transpose16_to(tile, kt + static_cast<size_t>(w0) * L);
  }
  // NA accumulator sets over words: >= 16 dot-product chains in flight
  constexpr int NA = RB >= 8 ? 2 : RB >= 4 ? 4 : 8;
  const __m512 scale = _mm512_set1_ps(pb.scale);
  for (int r0 = 0; r0 < rows_pad; r0 += RB) {
    const uint32_t* q0 = qw + static_cast<size_t>(r0) * words;
    __m512 a[NA][RB];
    for (int j = 0; j < NA; ++j)
      for (int i = 0; i < RB; ++i) a[j][i] = _mm512_setzero_ps();
    for (int w = 0; w < words; w += NA)
      for (int j = 0; j < NA; ++j) {
        pf.step();
        const __m512bh kw = (__m512bh)_mm512_loadu_si512(kt + static_cast<size_t>(w + j) * L);
        for (int i = 0; i < RB; ++i)
          a[j][i] = _mm512_dpbf16_ps(a[j][i], (__m512bh)_mm512_set1_epi32(static_cast<int>(q0[i * words + w + j])), kw);
      }
    for (int i = 0; i < RB; ++i) {
      __m512 sum = a[0][i];
      for (int j = 1; j < NA; ++j) sum = _mm512_add_ps(sum, a[j][i]);
      _mm512_storeu_ps(S + (r0 + i) * L, _mm512_mul_ps(sum, scale));
    }
  }
  online_softmax(pb, sc, rows, j0, n, m, lv, slope);
  for (int r = 0; r < rows_pad; ++r)  // P in bf16: word u holds tokens (2u, 2u + 1)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pw + r * (L / 2)),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(P + r * L)));
  const int pairs = (n + 1) / 2;  // tokens t >= n point at zeros and have P = 0
  for (int g0 = 0; g0 < dvp; g0 += 32) {
    for (int r0 = 0; r0 < rows_pad; r0 += RB) {
      __m512 lo[RB], hi[RB];
      for (int i = 0; i < RB; ++i) {
        const __m512 al = _mm512_set1_ps(alpha[r0 + i]);
        lo[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + static_cast<size_t>(r0 + i) * dvp + g0), al);
        hi[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + static_cast<size_t>(r0 + i) * dvp + g0 + 16), al);
      }
      for (int u = 0; u < pairs; ++u) {
        pf.step();
        const __m512i wa = _mm512_loadu_si512(vp[2 * u] + g0), wb = _mm512_loadu_si512(vp[2 * u + 1] + g0);
        const __m512bh vlo = (__m512bh)_mm512_unpacklo_epi16(wa, wb), vhi = (__m512bh)_mm512_unpackhi_epi16(wa, wb);
        for (int i = 0; i < RB; ++i) {
          const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pw[(r0 + i) * (L / 2) + u]));
          lo[i] = _mm512_dpbf16_ps(lo[i], p, vlo);
          hi[i] = _mm512_dpbf16_ps(hi[i], p, vhi);
        }
      }
      for (int i = 0; i < RB; ++i) {
        _mm512_storeu_ps(acc + static_cast<size_t>(r0 + i) * dvp + g0, lo[i]);
        _mm512_storeu_ps(acc + static_cast<size_t>(r0 + i) * dvp + g0 + 16, hi[i]);
      }
    }
  }
  pf.rest();
}
#endif
