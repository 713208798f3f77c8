// The register kernel's chunk for bf16 caches read in place (included by attend_regs.h after chunk(); hashed
// with the sources by kvops/native/__init__.py). A bf16's fp32 value is its 16 bits shifted up by 16, so a 32-bit word
// holding the bf16 of dims (2w, 2w + 1) gives the fp32 of the even dim as (word << 16) and of the odd dim as
// (word & 0xffff0000): one integer op per vector, where converting bf16 -> fp32 through vpmovzxwd costs the shuffle
// port the K transpose and the FMAs also need (perf, AVX-512 host, Qwen2.5-0.5B decode at GQA 7: the K conversion and
// transpose were a quarter of the kernel's time). So K of a chunk is transposed as words (16 words = 32 dims per
// 16x16 transpose: half the permutes of transposing fp32, no conversion), and V is read as words too. The arithmetic
// is chunk()'s: fp32 FMAs (the scores' even and odd dims may sum apart: ACC_REGS chains, see below).
//
// V's words give the even and the odd dims of 2 * NW consecutive dims as two vectors, so while attend runs the
// accumulator rows hold each group of 2 * NW dims as [even dims | odd dims] (pair_layout on entry and exit).
// Needs head_dim % 32 == 0 and head_dim_v % (2 * NW) == 0 (NW: vec.h), unit-stride rows, no RoPE at read.
//
// Where the registers allow (AVX-512: ACC_REGS 16, vec.h) a chunk is WIDE_NV = 2 vectors of 16 tokens: each load of K
// words feeds twice the FMAs (the score loop was bound by its loads: one K vector and 2 RB query broadcasts per 2 RB
// FMAs), and the online softmax (row max, rescale) and the PV accumulators' loads and stores run once per 32 tokens.
#pragma once

#include "scores_rows.h"  // AVX2 at 1-5 rows: the scores along K rows

// acc rows [rows][dvp]: plain dim order -> [even dims | odd dims] per group of 2 * NW dims (to_pairs), or back
inline void pair_layout(float* acc, int rows, int dvp, bool to_pairs) {
  float tmp[2 * NW];
  for (int r = 0; r < rows; ++r)
    for (int g0 = 0; g0 < dvp; g0 += 2 * NW) {
      float* a = acc + static_cast<size_t>(r) * dvp + g0;
      for (int k = 0; k < NW; ++k) {
        if (to_pairs) {
          tmp[k] = a[2 * k];
          tmp[NW + k] = a[2 * k + 1];
        } else {
          tmp[2 * k] = a[k];
          tmp[2 * k + 1] = a[NW + k];
        }
      }
      std::memcpy(a, tmp, sizeof tmp);
    }
}

// K of a chunk's NV * 16 tokens transposed as 32-bit words: kt[w * NV * 16 + t] holds word w (dims 2w, 2w + 1) of
// token t (chunk_pairs and chunk_dot.h's chunk_dot)
template <int NV>
inline void transpose_k_words(const c10::BFloat16* const* kp, int words, float* kt) {
  constexpr int W = NV * L;
  for (int v = 0; v < NV; ++v)
    for (int w0 = 0; w0 < words; w0 += L)
      transpose16_rows([&](int t) { return reinterpret_cast<const float*>(kp[v * L + t] + 2 * w0); },
                       kt + static_cast<size_t>(w0) * W + v * L, W);
}

// acc[r, groups [g0, g0 + WP)] = acc * alpha + P V for RB rows at a time: each V word vector gives the even and the
// odd dims of a group, so a pass keeps WP groups x 2 halves x RB rows of accumulators (ACC_REGS in flight: one V
// load feeds 2 RB FMAs; one prefetch step per word)
template <int RB, int WP, int W>
inline void pv_words(const float* P, const float* alpha, const c10::BFloat16* const* vp, int n, int g0, int rows_pad,
                     int dvp, float* acc, PfStep& pf) {  // P: rows of W lanes
  for (int r0 = 0; r0 < rows_pad; r0 += RB) {
    nv a[WP][2][RB];
    for (int w = 0; w < WP; ++w)
      for (int o = 0; o < 2; ++o)
        for (int i = 0; i < RB; ++i)
          a[w][o][i] = loadn(acc + static_cast<size_t>(r0 + i) * dvp + (g0 + w) * 2 * NW + o * NW) * alpha[r0 + i];
    for (int t = 0; t < n; ++t) {
#pragma GCC unroll 8
      for (int w = 0; w < WP; ++w) {
        pf.step<true>();
        nv word;
        std::memcpy(&word, vp[t] + (g0 + w) * 2 * NW, sizeof word);
        const nv ve = even_dims(word), vo = odd_dims(word);
        for (int i = 0; i < RB; ++i) {
          const float p = P[(r0 + i) * W + t];
          a[w][0][i] += p * ve;
          a[w][1][i] += p * vo;
        }
      }
    }
    for (int w = 0; w < WP; ++w)
      for (int o = 0; o < 2; ++o)
        for (int i = 0; i < RB; ++i) storen(acc + static_cast<size_t>(r0 + i) * dvp + (g0 + w) * 2 * NW + o * NW, a[w][o][i]);
  }
}

// One chunk of n <= NV * 16 tokens (kp / vp: NV * 16 rows, those past n pointing at zeros)
template <int RB, int NV>
inline void chunk_pairs(const Problem& pb, const c10::BFloat16* const* kp, const c10::BFloat16* const* vp, int n,
                        int64_t j0, int rows, int rows_pad, Scratch& sc, const float* qf, const float* qt, float* m,
                        vf* lv, float* acc, const Prefetcher& pfw, const float* slope) {  // queries as chunk()'s
  PfStep pf(pfw);
  constexpr int W = NV * L;  // tokens of the chunk = lanes of a row of S and P
  const int dp = pb.d_pad, dvp = pb.dv_pad, words = pb.d / 2;
  float* S = sc.s.data();
  const float* P = sc.p.data();
  const float* alpha = sc.alpha.data();
  float* kt = sc.kt.data();  // kt[w * W + t]: word w (dims 2w, 2w + 1) of token t
  // AVX2 at 1-5 rows (then RB = rows_pad: one row block): scores along K rows (scores_rows.h)
  constexpr bool rows_form = NV == 1 && ROWS_FORM<RB>;
  if constexpr (rows_form)
    scores_rows<RB>(kp, qt, dp, words, S, pf);  // qt: the queries split by attend (split_queries)
  else
    transpose_k_words<NV>(kp, words, kt);
  // scores: as chunk(), with the dims of a word taken apart, for the NV vectors of tokens at once (one query broadcast
  // feeds NV FMAs); NA accumulator sets over words, and where the registers allow (SPLIT) the even and the odd dims
  // accumulate apart, keep about ACC_REGS FMA chains in flight
  constexpr int NA = pow2_floor(ACC_REGS / (RB * NV) > 0 ? ACC_REGS / (RB * NV) : 1);
  constexpr bool SPLIT = ACC_REGS >= 2 * NA * RB * NV;
  for (int r0 = 0; r0 < (rows_form ? 0 : rows_pad); r0 += RB) {
    const float* q0 = qt + static_cast<size_t>(r0) * dp;
    const float* qr = qf + static_cast<size_t>(r0) * dp;
    for (int c = 0; c < NH; ++c) {
      nv a[SPLIT ? 2 : 1][NA][NV][RB] = {};
      // one pointer each into K and the queries, stepped per NA words: the broadcasts take constant offsets (indexing
      // by word made GCC keep a pointer per row and spill the accumulators)
      const float* kw_p = kt + c * NW;
      const float* qe = q0;
      for (int w = 0; w < words; w += NA, kw_p += NA * W, qe += 2 * NA * RB) {
#pragma GCC unroll 16
        for (int j = 0; j < NA; ++j) {
#pragma GCC unroll 2
          for (int v = 0; v < NV; ++v) {
            pf.step<true>();
            const nv kw = loadn(kw_p + j * W + v * L);
            const nv ke = even_dims(kw), ko = odd_dims(kw);
            if constexpr (NV == 1) {  // row-major queries, as chunk()
              const int e = 2 * (w + j);
              for (int i = 0; i < RB; ++i) a[0][j][v][i] += qr[i * dp + e] * ke;
              for (int i = 0; i < RB; ++i) a[SPLIT][j][v][i] += qr[i * dp + e + 1] * ko;
            } else {
              for (int i = 0; i < RB; ++i) a[0][j][v][i] += qe[2 * j * RB + i] * ke;
              for (int i = 0; i < RB; ++i) a[SPLIT][j][v][i] += qe[(2 * j + 1) * RB + i] * ko;
            }
          }
        }
      }
      for (int v = 0; v < NV; ++v)
        for (int i = 0; i < RB; ++i) {
          nv sum = a[0][0][v][i];
          for (int j = 1; j < NA; ++j) sum += a[0][j][v][i];
          if constexpr (SPLIT)
            for (int j = 0; j < NA; ++j) sum += a[1][j][v][i];
          storen(S + (r0 + i) * W + v * L + c * NW, sum);
        }
    }
  }
  online_softmax<NV>(pb, sc, rows, j0, n, m, lv, slope);
  // acc = acc * alpha + P V: WP groups of 2 * NW dims per pass where the registers hold both halves of a group for RB
  // rows; otherwise (AVX2 at RB > 4) two blocks of rows
  const int groups = dvp / (2 * NW);
  constexpr int WP = ACC_REGS / (2 * RB);
  if constexpr (WP >= 1) {
    int g = 0;
    for (; g + WP <= groups; g += WP) pv_words<RB, WP, W>(P, alpha, vp, n, g, rows_pad, dvp, acc, pf);
    for (; g < groups; ++g) pv_words<RB, 1, W>(P, alpha, vp, n, g, rows_pad, dvp, acc, pf);
  } else {
    // AVX2 at RB > 4: each block of RB rows as two of R1 and RB - R1 rows, both halves of a group at once (one V word
    // load and two integer ops per R1 rows; per row a P broadcast feeds two FMAs). The even, then the odd dims of all
    // RB rows (one broadcast per FMA, a V load per half) was slower: x86-64-v3 build, Qwen2.5-0.5B bf16 decode at GQA 7
    constexpr int R1 = (RB + 1) / 2, R2 = RB - R1;
    for (int r0 = 0; r0 < rows_pad; r0 += RB)
      for (int g = 0; g < groups; ++g) {
        pv_words<R1, 1, W>(P + r0 * W, alpha + r0, vp, n, g, R1, dvp, acc + static_cast<size_t>(r0) * dvp, pf);
        pv_words<R2, 1, W>(P + (r0 + R1) * W, alpha + r0 + R1, vp, n, g, R2, dvp,
                           acc + static_cast<size_t>(r0 + R1) * dvp, pf);
      }
  }
  pf.rest();
}
