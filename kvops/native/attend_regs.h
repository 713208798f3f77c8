// The register kernel of the native paged attention (included by paged_attention.cpp after paged_problem.h; hashed
// with the sources by kvops/native/__init__.py): the queries of a KV head's rows in fp32 (load_queries, RoPE at
// read), masking (mask_scores), the online softmax, the PV accumulation and chunk() (16 or 32 tokens of one KV
// head), chunk_pairs.h and chunk_dot.h for bf16 caches, and attend(), the pass of an item's rows over a KV range.
#pragma once

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
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return half_nw(reinterpret_cast<const uint16_t*>(p));
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
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    return half16(reinterpret_cast<const uint16_t*>(p));
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

// online_softmax: how far a score may pass the running max before it is raised, ln 256 (FlashAttention-4's 8 in log2
// units): a weight exp(s - m) stays below 256, so the accumulator sum(p v) is at most 256x the exact online softmax's:
// finite while max |v| x visible keys stays below the fp32 maximum / 256, and may overflow past |out| x l at that
// bound (l = sum_j exp(s_j - max s)) where the exact form stays finite (docs/native-kernel.md, "Lazy rescale"; with 8:
// e^8 ~ 2981x, and a V row of 2e35 under one key 7.5 above the rest overflowed)
constexpr float RESCALE_SLACK = 5.5451774f;

// Online softmax of rows [0, rows) over the chunk's scores S (sc.s, rows of NV * 16 lanes): softcap before masking
// (mask_scores), running max m, per-lane sums lv, the rescale alpha of each row's accumulator (sc.alpha) and
// P = exp(S - m) (sc.p, the same layout; m raised lazily: RESCALE_SLACK); lane c is position j0 + c. Shared by chunk
// (NV = 1), chunk_pairs and chunk_dot.
// Out of line: where GCC inlined it, chunk_dot (its caller) no longer was inlined into attend (AVX-512 build,
// Qwen2.5-0.5B bf16 decode ~3% slower).
template <int NV = 1>
__attribute__((noinline)) void online_softmax(const Problem& pb, Scratch& sc, int rows, int64_t j0, int n, float* m,
                                               vf* lv, const float* slope) {
  constexpr int W = NV * L;
  const float* S = sc.s.data();
  float* P = sc.p.data();
  float* alpha = sc.alpha.data();
  // masks only where some row needs them: softcap, ALiBi, a custom mask, a row's range not covering the chunk
  bool plain = !(pb.softcap > 0.f) && !slope && !pb.mask && n == W;
  for (int r = 0; plain && r < rows; ++r) plain = sc.row_lo[r] <= j0 && j0 + W <= sc.row_hi[r];
  // 1. per row: masks, the running max and alpha; P holds S - m (-inf where nothing is visible: exp gives 0). The row
  // is handled as VR hardware-width parts (nv): on AVX2 a 16-lane vf lives on the stack, and its loads and stores went
  // through 16-byte moves that 32-byte loads then read back (store-forwarding stalls: perf, x86-64-v3 build,
  // Qwen2.5-0.5B bf16 decode, a quarter of online_softmax's samples on one such load)
  constexpr int VR = W / NW;  // hardware-width parts of a row
  for (int r = 0; r < rows; ++r) {
    const float* Sr = S + r * W;
    nv s[VR];
    for (int v = 0; v < NV; ++v) {
      if (plain) {
        for (int h = 0; h < NH; ++h) s[v * NH + h] = loadn(Sr + v * L + h * NW);
      } else {
        vf x = loadu(Sr + v * L);
        mask_scores(pb, sc, r, j0 + v * L, std::clamp(n - v * L, 0, L), x, slope);
        std::memcpy(&s[v * NH], &x, sizeof x);
      }
    }
    // the running max is raised only when a score passes it by more than RESCALE_SLACK (as FlashAttention-4 does):
    // P = exp(S - m) stays below 256, and most chunks skip the max over lanes and alpha (a NaN score
    // passes nothing: it reaches P and l as below)
    if (m[r] != NEG_INF) {
      bool over = false;
      for (int k = 0; k < VR; ++k) over |= any_gt_n(s[k], m[r] + RESCALE_SLACK);
      if (!over) {
        alpha[r] = 1.f;
        for (int k = 0; k < VR; ++k) storen(P + r * W + k * NW, s[k] - m[r]);
        continue;
      }
    }
    nv mp[NH];  // the lane-wise max over the row's 16-lane vectors, then over lanes
    for (int k = 0; k < NH; ++k) mp[k] = s[k];
    for (int k = NH; k < VR; ++k) {
      const nvi gt = s[k] > mp[k % NH];
      mp[k % NH] = (nv)((gt & (nvi)s[k]) | (~gt & (nvi)mp[k % NH]));
    }
    vf mx;
    std::memcpy(&mx, mp, sizeof mx);
    // a visible key's NaN score (NaN in q or K, a NaN slope) makes the row NaN, as SDPA's: the max over lanes drops
    // NaN, so with a finite max the NaN lanes reach exp, P and l (finalize then writes NaN); only a chunk whose
    // other lanes are all masked needs the explicit check
    const float mc = hmax(mx);
    if (mc <= m[r]) {  // running max unchanged (also: nothing visible in this chunk)
      alpha[r] = 1.f;
      if (mc == NEG_INF) {
        bool nan = false;
        for (int k = 0; k < VR; ++k) {
          nan |= any_nan_n(s[k]);
          storen(P + r * W + k * NW, nv{} + NEG_INF);
        }
        if (nan) lv[r] = splat(std::numeric_limits<float>::quiet_NaN());
        continue;
      }
    } else {
      alpha[r] = std::exp(m[r] - mc);  // 0 when m was -inf
      m[r] = mc;
    }
    for (int k = 0; k < VR; ++k) storen(P + r * W + k * NW, s[k] - m[r]);
  }
  // 2. P = exp(P) in place, four rows per step on AVX-512 (32 registers), else two (vexpn_k interleaves their vectors'
  // polynomial steps: one exp is a chain of ~11 dependent 4-cycle steps, so 4 vectors in flight left it latency-bound),
  // and the rows' per-lane sums lv = lv * alpha + P (part k of a row adds to lane part k mod NH of lv, in the row's
  // order)
  auto exp_rows = [&](int r0, auto rows_per_step) {
    constexpr int R = decltype(rows_per_step)::value, K = R * VR;
    nv x[K];
    for (int k = 0; k < K; ++k) x[k] = loadn(P + r0 * W + k * NW);
    vexpn_k<K>(x);
    for (int k = 0; k < K; ++k) storen(P + r0 * W + k * NW, x[k]);
    for (int i = 0; i < R; ++i) {
      float* l = reinterpret_cast<float*>(&lv[r0 + i]);
      for (int h = 0; h < NH; ++h) {
        nv sum = loadn(l + h * NW) * alpha[r0 + i];
        for (int k = h; k < VR; k += NH) sum += x[i * VR + k];
        storen(l + h * NW, sum);
      }
    }
  };
  int r = 0;
  if constexpr (ACC_REGS >= 16)  // AVX-512
    for (; r + 4 <= rows; r += 4) exp_rows(r, std::integral_constant<int, 4>{});
  for (; r + 2 <= rows; r += 2) exp_rows(r, std::integral_constant<int, 2>{});
  if (r < rows) exp_rows(r, std::integral_constant<int, 1>{});
}

// acc[r, dims [e0, e0 + VP * NW)] = acc * alpha + P V, RB rows at a time (RB x VP accumulators; one prefetch step per
// V vector load)
template <typename T, int RB, int VP, int W>
inline void pv_rows(const float* P, const float* alpha, const T* const* vp, int n, int e0, int rows_pad, int dvp,
                    float* acc, PfStep& pf) {  // P: rows of W lanes
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
                  Scratch& sc, const float* qf, const float* qt, float* m, vf* lv, float* acc, const Prefetcher& pfw,
                  const float* slope) {  // qf: the KV head's queries row-major, qt: dim-major per block of RB rows
  PfStep pf(pfw);
  constexpr int W = NV * L;  // tokens of the chunk (NV = 1 with RoPE at read: sc.rc / sc.rs hold 16 positions)
  const int dp = pb.d_pad, dvp = pb.dv_pad;
  float* S = sc.s.data();
  float* P = sc.p.data();
  float* alpha = sc.alpha.data();
  float* kt = sc.kt.data();
  // K of the W tokens, transposed: kt[e * W + t] holds dim e of token t
  for (int v = 0; v < NV; ++v)
    for (int e0 = 0; e0 < dp; e0 += L) {
      if constexpr (std::is_same_v<T, float>) {  // fp32 rows read in place (vec.h: transpose16_rows)
        transpose16_rows([&](int t) { return kp[v * L + t] + e0; }, kt + static_cast<size_t>(e0) * W + v * L, W);
      } else {
        vf tile[L];
        for (int t = 0; t < L; ++t) tile[t] = load16(kp[v * L + t] + e0);
        transpose16_to(tile, kt + static_cast<size_t>(e0) * W + v * L, W);
      }
    }
  if (NV == 1 && pb.rope_freq) {  // RoPE at read time: turn the 16 keys by their positions (sc.rc / sc.rs, set by attend)
    const int half = pb.d / 2;
    for (int i = 0; i < half; ++i)  // per hardware-width part (nv: on AVX2 a 16-lane vf round-trips the stack)
      for (int k = 0; k < L; k += NW) {
        float* x1 = kt + static_cast<size_t>(i) * L + k;
        float* x2 = kt + static_cast<size_t>(i + half) * L + k;
        const nv a = loadn(x1), b = loadn(x2);
        const nv c = loadn(sc.rc.data() + static_cast<size_t>(i) * L + k);
        const nv sn = loadn(sc.rs.data() + static_cast<size_t>(i) * L + k);
        storen(x1, a * c - b * sn);
        storen(x2, b * c + a * sn);
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
#include "chunk_dot.h"  // chunk_dot: bf16 dot products (AVX512-BF16) for bf16 caches and queries

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
  // bf16 rows read in place go through chunk_dot (AVX512-BF16 builds, bf16 q) or chunk_pairs (accumulators in its
  // layout while this pass runs)
  constexpr bool bf16 = std::is_same_v<TK, c10::BFloat16>;
  const bool pairs = bf16 && direct && d % (2 * L) == 0 && pb.d_v % (2 * NW) == 0 && !pb.rope_freq;
  const bool dot = pairs && pb.bf16_dot && !pb.k_scale;  // chunk_dot.h
  for (int h = 0; pairs && h < nh; ++h)
    (dot ? dot_layout : pair_layout)(state + h * head_size + 2 * rows_pad, rows_pad, dvp, true);
  if (dot) load_query_words<RB>(pb, it, rows, rows_pad, sc);
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
  if (pairs && !dot && !wide && ROWS_FORM<RB>) split_queries(pb, rows_pad, sc);  // what chunk_pairs' scores_rows reads
  const TK* kb[2 * L];
  const TK* vb[2 * L];
  const TK* kp[2 * L];
  const TK* vp[2 * L];
  const float* kps[L];
  const float* vps[L];
  const TK* zeros = reinterpret_cast<const TK*>(sc.zeros.data());
  // head 0's rows of positions [j, j + n) (as const TK* or const char*): one division per run of positions, then
  // pointer steps along a block's rows (the strides in locals: stored through k / v, pb's would be reloaded per row)
  auto token_bases = [&](int64_t j, int n, auto* k, auto* v) {
    using P = std::remove_pointer_t<decltype(k)>;
    const int64_t bs = pb.block_size, sk0 = pb.sk[0], sk1 = pb.sk[1], sv0 = pb.sv[0], sv1 = pb.sv[1];
    int64_t blk_i = j / bs, row = j % bs;
    const TK* kr = kc + table[blk_i] * sk0 + row * sk1;
    const TK* vr = vc + table[blk_i] * sv0 + row * sv1;
    for (int t = 0; t < n; ++t) {
      k[t] = reinterpret_cast<P>(kr);
      v[t] = reinterpret_cast<P>(vr);
      if (t + 1 == n) break;
      if (++row == bs) {
        row = 0;
        ++blk_i;
        kr = kc + table[blk_i] * sk0;
        vr = vc + table[blk_i] * sv0;
      } else {
        kr += sk1;
        vr += sv1;
      }
    }
  };
  // software prefetch (the blocks are scattered, so the hardware prefetcher alone leaves chunks waiting on memory):
  // work goes in units (chunk, KV head); while unit u is computed, the lines of unit u + ahead are issued one per
  // inner step of its math (Prefetcher), `ahead` sized so that ~PREFETCH_BYTES of K/V are in flight
  const int unit_bytes = CW * (k_bytes + v_bytes);
  const int ahead = std::max(1, (PREFETCH_BYTES + unit_bytes - 1) / unit_bytes);
  const char* fkc[2 * L];  // the prefetched chunk's token bases, as bytes (what the Prefetcher walks)
  const char* fvc[2 * L];
  int64_t fj = -1;  // the chunk whose bases fkc/fvc hold
  int fn = 0;  // its tokens
  const int kl = pb.sk[3] == 1 ? (k_bytes + 63) / 64 : 0, vl = pb.sv[3] == 1 ? (v_bytes + 63) / 64 : 0;
  auto list_lines = [&](int64_t j, int h) {
    if (j >= hi) return Prefetcher(fkc, fvc, 0, 0, 0, 0, 0);
    if (j != fj) {
      fj = j;
      fn = static_cast<int>(std::min<int64_t>(CW, hi - j));
      token_bases(j, fn, fkc, fvc);
    }
    return Prefetcher(fkc, fvc, h * pb.sk[2] * static_cast<int64_t>(sizeof(TK)), h * pb.sv[2] * static_cast<int64_t>(sizeof(TK)),
                      fn, kl, vl);
  };
  for (int u = 0; u < ahead; ++u) PfStep(list_lines(lo + int64_t(u / nh) * CW, u % nh)).rest();  // the first units: at once
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
    // the pages of the blocks TLB_AHEAD positions on: a line where each K and V block's run of [ja, je) starts and
    // ends (blocks of TLB_MIN_BLOCK positions or more: at block_size 1 the touches cost more than they saved)
    if (pb.block_size >= TLB_MIN_BLOCK && j0 + TLB_AHEAD < hi) {
      const int64_t ja = j0 + TLB_AHEAD, je = std::min<int64_t>(hi, ja + CW);
      for (int64_t bi = ja / pb.block_size; bi * pb.block_size < je; ++bi) {
        const int64_t blk = table[bi], b0 = bi * pb.block_size;
        const int64_t first = std::max(ja, b0) - b0, last = std::min<int64_t>(je, b0 + pb.block_size) - 1 - b0;
        prefetch_line(reinterpret_cast<const char*>(kc + blk * pb.sk[0] + first * pb.sk[1]));
        prefetch_line(reinterpret_cast<const char*>(vc + blk * pb.sv[0] + first * pb.sv[1]));
        if (last > first) {
          prefetch_line(reinterpret_cast<const char*>(kc + blk * pb.sk[0] + last * pb.sk[1]));
          prefetch_line(reinterpret_cast<const char*>(vc + blk * pb.sv[0] + last * pb.sv[1]));
        }
      }
    }
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
#if defined(__AVX512BF16__)
        if (dot) {
          const uint32_t* qw = sc.qw.data() + static_cast<size_t>(h) * rows_pad * (d / 2);
          if (wide)
            chunk_dot<RB, WIDE_NV>(pb, kp, vp, n, j0, rows, rows_pad, sc, qw, m, lv, acc, pf, slope);
          else
            chunk_dot<RB, 1>(pb, kp, vp, n, j0, rows, rows_pad, sc, qw, m, lv, acc, pf, slope);
          continue;
        }
#endif
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
  for (int h = 0; pairs && h < nh; ++h)
    (dot ? dot_layout : pair_layout)(state + h * head_size + 2 * rows_pad, rows_pad, dvp, false);
}
