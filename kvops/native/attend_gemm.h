// The GEMM path of the native paged attention (included by paged_attention.cpp, after attend_regs.h; hashed with the
// sources by kvops/native/__init__.py): work items with many rows per KV head (chunked prefill: the tile's queries times the
// GQA group) multiply through PyTorch's own CPU GEMMs instead of the register kernel, whose FMA loops are written for a
// few rows.
//
// Per tile of up to GEMM_KV positions (outer) and KV head (inner): the tile's K and V rows are gathered from their
// blocks into scratch in the layout the GEMM reads (read once, in their stored dtype, for all of the item's up to
// GEMM_ITEM_ROWS rows, which then go through the GEMMs GEMM_ROWS at a time: softmax_tile; each such sub-tile multiplies
// only the tile's columns its rows see, from the first to the last visible position rounded out to 64), S = Q K^T,
// masking / softcap / ALiBi / custom mask are the register kernel's (mask_scores), the online softmax is per row over
// those columns (in hardware-width vectors), and acc = acc * alpha + P V. Every GEMM is a call of
// at::native::cpublas::brgemm (oneDNN's brgemm ukernel, what torch's CPU flash attention and Inductor's CPP GEMM
// template call; where oneDNN has no ukernel it falls back to the BLAS itself). Two forms:
// * fp32 (TC = float): K / V converted to fp32 as they are gathered (RoPE at read rotates K here), Q is
//   load_queries' scaled fp32 rows. oneDNN's fp32 ukernel against at::mm_out / addmm_ (MKL) in the same code,
//   chunked prefill 4 x (512 + 128), AMD EPYC Zen 4: Qwen2.5-0.5B heads 16.1 -> 14.0 ms, Llama-3.1-8B 67.8 -> 61.3
//   (AVX-512), 16.7 -> 15.2 and 71.0 -> 67.0 (AVX2 code: x86-64-v3 build, ONEDNN_MAX_CPU_ISA=AVX2, MKL AVX2).
// * the cache dtype (TC = bf16 / fp16; low_precision_gemm: where oneDNN packs it (AMX), and for bf16 where the CPU
//   has AVX512-BF16 dot products): Q as given and P in bf16, the scale applied to S, K / V in the VNNI layout (pairs
//   along the reduction dim: K^T [d/2][GEMM_KV][2], V [n_pad/2][dv_n][2]), fp32 accumulation: S in GEMM_QK_N-column
//   calls, P V in one call (64-column calls ran the AMX micro-kernel at half the rate). What torch's
//   scaled_dot_product_attention computes on such hosts. Needs an even head_dim, no RoPE at read. All scratch is
//   64-byte aligned (avec, vec.h).
#pragma once

constexpr int GEMM_KV = 512;  // KV positions per GEMM tile (a multiple of GEMM_N)
constexpr int GEMM_N = 64;  // K rows per register transpose block; S / P rows and V's row stride are rounded to it
constexpr int GEMM_COLS = 64;  // a sub-tile's column range is rounded out to multiples of it
constexpr int GEMM_QK_N = 256;  // S columns per Q K^T micro-kernel call (cache-dtype form)
constexpr int GEMM_ROWS = 256;  // rows (queries x GQA group) per GEMM: the S / P tile is GEMM_ROWS x GEMM_KV
constexpr int GEMM_ITEM_ROWS = 4 * GEMM_ROWS;  // rows per prefill work item: its GEMM_ROWS sub-tiles share each
                                               // gathered K / V tile
constexpr int GEMM_MIN_ROWS = 32;  // rows per KV head from which an item takes this path (pad_rows: its multiple)

struct GemmScratch {
  avec<float> s;  // S [rows][GEMM_KV] (fp32 form: then P in place)
  avec<char> k, v, q, p;  // K^T, V (micro-kernel layouts), Q [H_kv][rows_pad][d] and P [rows][GEMM_KV] (TC)
  avec<float> rc, rs;  // RoPE: cos / sin [GEMM_KV][d / 2] of the tile's positions
  avec<uint32_t> krows;  // the K rows of one GEMM_N-token block, before their transpose (32-bit words)
  void size(int rows_pad, const Problem& pb, size_t tc) {
    krows.resize(static_cast<size_t>(GEMM_N) * pb.d);
    const size_t dv_n = static_cast<size_t>(round_up(pb.d_v, GEMM_N));
    s.resize(static_cast<size_t>(std::min(rows_pad, GEMM_ROWS)) * GEMM_KV);
    k.resize(static_cast<size_t>(GEMM_KV) * round_up(pb.d, 2) * tc);
    v.resize(static_cast<size_t>(GEMM_KV) * dv_n * tc);
    if (tc != sizeof(float)) {
      q.resize(static_cast<size_t>(pb.num_kv_heads) * rows_pad * pb.d * tc);
      p.resize(static_cast<size_t>(std::min(rows_pad, GEMM_ROWS)) * GEMM_KV * tc);
    }
    if (pb.rope_freq) {
      rc.resize(static_cast<size_t>(GEMM_KV) * (pb.d / 2));
      rs.resize(static_cast<size_t>(GEMM_KV) * (pb.d / 2));
    }
  }
};

// whether oneDNN's brgemm multiplies bf16 in the VNNI form with the CPU's own bf16 dot products where it does not
// pack (AVX512-BF16 without AMX: AMD Zen 4, Intel Cooper Lake): the CPU has them and a one-row call runs (oneDNN's ISA
// may be capped below AVX-512 by ONEDNN_MAX_CPU_ISA, where brgemm refuses the VNNI form). Asked once, with
// torch.backends.mkldnn enabled (the caller checks it per call: the refusal it causes must not be remembered).
inline bool bf16_dot_brgemm() {
#if defined(__x86_64__)
  static const bool ok = [] {
    if (!__builtin_cpu_supports("avx512bf16")) return false;
    try {
      alignas(64) c10::BFloat16 a[2] = {}, b[2 * 16] = {};
      alignas(64) float c[16];
      at::native::cpublas::brgemm(1, 16, 2, 2, 16, 16, false, a, b, c, true);
      at::native::cpublas::brgemm_release(true);
      return true;
    } catch (const c10::Error&) {
      return false;
    }
  }();
  return ok;
#else
  return false;
#endif
}

// whether the cache-dtype form runs for this problem (else fp32): where oneDNN packs the dtype (AMX), or for bf16
// where the CPU has AVX512-BF16 dot products (bf16_dot_brgemm), as torch's own CPU SDPA multiplies bf16 there
template <typename TQ, typename TK>
inline bool low_precision_gemm(const Problem& pb) {
  if constexpr (std::is_same_v<TQ, TK> && (std::is_same_v<TK, c10::BFloat16> || std::is_same_v<TK, c10::Half>)) {
    if (pb.d % 2 != 0 || pb.rope_freq) return false;
    // asked per call: both follow torch.backends.mkldnn.enabled, which brgemm's VNNI form also needs
    if (at::native::cpublas::could_pack(c10::CppTypeToScalarType<TK>::value)) return true;
    return std::is_same_v<TK, c10::BFloat16> && at::globalContext().userEnabledMkldnn() && bf16_dot_brgemm();
  }
  return false;
}

// element (r, c) of a VNNI block: pairs along the reduction dim r, `width` columns: [r / 2][width][2]
inline size_t vnni(int r, int c, int width) { return (static_cast<size_t>(r >> 1) * width + c) * 2 + (r & 1); }

// P's bf16 words of 16 lanes (round to nearest even; p finite): one vcvtneps2bf16 where the host has AVX512-BF16
inline void store_bf16(c10::BFloat16* dst, nv p) {
#if defined(__AVX512BF16__)
  if constexpr (NW == 16) {
    const __m256bh b = _mm512_cvtneps_pbh(reinterpret_cast<__m512>(p));
    std::memcpy(dst, &b, sizeof b);
    return;
  }
#endif
  typedef uint32_t nvu __attribute__((vector_size(NW * 4)));
  typedef uint16_t nvh __attribute__((vector_size(NW * 2)));
  const nvu u = (nvu)p;
  const nvh b = __builtin_convertvector((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, nvh);
  std::memcpy(dst, &b, sizeof b);
}

// The online softmax of rows [r0, r0 + rs) over n KV positions from j0: S [rs][n_pad] (fp32 scores, row stride ld,
// n_pad a multiple of GEMM_COLS: whole vexpn_k steps of 4 vectors) is scaled (qk_scale: the cache-dtype form's
// softmax scale), masked (mask_scores: softcap, ALiBi, the rows' ranges, the custom mask), its exp is P [rs][n_pad]
// in TC (row stride ld; in place over S in the fp32 form; bf16 rounded to nearest even; zeros from n on), and m, l,
// acc of the rows (indexed by row) are rescaled.
// A row that sees all n positions with nothing to mask (prefill's cached positions) is read as stored: its max is
// max(S) * qk_scale (the scale is positive, so the same value) and P = exp(S * qk_scale - m) in one FMA, without a
// scaled copy of S.
template <typename TC>
void softmax_tile(const Problem& pb, const Scratch& sc, int r0, int rs, int64_t j0, int n, int n_pad, int ld, float* S,
                  TC* P, float* m, float* l, float* acc, const float* slope, float qk_scale) {
  constexpr bool low = !std::is_same_v<TC, float>;
  const int dv = pb.d_v, dvp = pb.dv_pad;
  const bool plain = !(pb.softcap > 0.f) && !slope && !pb.mask && qk_scale > 0.f && n % L == 0;
  for (int r = r0; r < r0 + rs; ++r) {
    float* sr = S + static_cast<size_t>(r - r0) * ld;
    bool whole = plain && sc.row_lo[r] <= j0 && j0 + n <= sc.row_hi[r];
    auto scale_and_mask = [&] {  // in place (columns past n: stale K rows, masked)
      const bool plain_row = !(pb.softcap > 0.f) && !slope && !pb.mask;
      for (int c0 = 0; c0 < n; c0 += L) {
        const int nn = std::min(L, n - c0);
        vf s = loadu(sr + c0);
        if (low) s *= qk_scale;
        if (!(plain_row && nn == L && sc.row_lo[r] <= j0 + c0 && j0 + c0 + L <= sc.row_hi[r]))
          mask_scores(pb, sc, r, j0 + c0, nn, s, slope);
        storeu(sr + c0, s);
      }
    };
    float mx;
    bool nan;
    // the row's max and NaN lanes, in hardware-width vectors (no call in the loop: the vectors stay in registers), A
    // independent maxima (one compare-and-blend chain ran at its latency, ~1/3 of the bf16 form's softmax)
    auto row_max = [&] {
      constexpr int A = 4;
      nv vmax[A];
      nvi vnan[A];
      for (int a = 0; a < A; ++a) vmax[a] = nv{} + NEG_INF, vnan[a] = nvi{};
      auto step = [&](int a, int c) {
        const nv x = loadn(sr + c);
        const nvi more = x > vmax[a];
        vnan[a] |= x != x;
        vmax[a] = (nv)((more & (nvi)x) | (~more & (nvi)vmax[a]));
      };
      int c = 0;
      for (; c + A * NW <= n; c += A * NW)
        for (int a = 0; a < A; ++a) step(a, c + a * NW);
      for (; c < n; c += NW) step(0, c);
      for (int a = 1; a < A; ++a) {  // into one vector, then its lanes
        const nvi more = vmax[a] > vmax[0];
        vmax[0] = (nv)((more & (nvi)vmax[a]) | (~more & (nvi)vmax[0]));
        vnan[0] |= vnan[a];
      }
      mx = NEG_INF;
      int32_t any = 0;
      for (int i = 0; i < NW; ++i) {
        mx = std::max(mx, vmax[0][i]);
        any |= vnan[0][i];
      }
      nan = any != 0;
    };
    if (!whole) scale_and_mask();
    row_max();
    if (whole && !nan && mx * qk_scale > std::numeric_limits<float>::max()) {
      // the scaled max overflows to +inf: scaled in place as any other row, so the row is NaN (exp(inf - inf)) as
      // the decode rows and SDPA's fp32 math make it, never the zeros of "no keys" that exp(S * scale - inf) gives
      whole = false;
      scale_and_mask();
      row_max();
    }
    const float f = whole ? qk_scale : 1.f;  // S's factor to scaled scores
    mx *= f;
    TC* pr = P + static_cast<size_t>(r - r0) * ld;
    if (nan || mx == NEG_INF) {  // a NaN row stays NaN (its l); nothing visible: the row is unchanged
      if (nan) l[r] = std::numeric_limits<float>::quiet_NaN();
      for (int c = 0; c < n_pad; ++c) pr[c] = TC(0.f);
      continue;
    }
    const float m_new = std::max(m[r], mx), alpha = std::exp(m[r] - m_new);  // 0 when m was -inf
    nv sum{};
    constexpr int K = 4;  // vectors per step: vexpn_k interleaves them
    static_assert(GEMM_COLS % (K * NW) == 0, "a sub-tile's column range is whole steps");
    for (int c0 = 0; c0 < n_pad; c0 += K * NW) {
      nv p[K];
      for (int k = 0; k < K; ++k) {
        const int c = c0 + k * NW;
        p[k] = c < n ? loadn(sr + c) * f - m_new : nv{} + NEG_INF;  // masked lanes and columns past n: exp(-inf) = 0
      }
      vexpn_k<K>(p);
      for (int k = 0; k < K; ++k) {
        const int c = c0 + k * NW;
        sum += p[k];
        if constexpr (std::is_same_v<TC, c10::BFloat16>) {
          store_bf16(pr + c, p[k]);
        } else if constexpr (low) {
          for (int i = 0; i < NW; ++i) pr[c + i] = TC(p[k][i]);
        } else {
          storen(pr + c, p[k]);
        }
      }
    }
    float sum_all = 0.f;
    for (int i = 0; i < NW; ++i) sum_all += sum[i];
    l[r] = l[r] * alpha + sum_all;
    m[r] = m_new;
    if (alpha != 1.f) {
      float* ar = acc + static_cast<size_t>(r) * dvp;
      for (int e = 0; e < dv; ++e) ar[e] *= alpha;
    }
  }
}

// attend()'s contract: rows [0, rows) of every KV head over KV positions [lo, hi) of item `it`, state m / l / acc per
// KV head updated in place. TC: float (fp32 form) or TK (cache-dtype form, low_precision_gemm).
template <typename TQ, typename TK, typename TC>
void attend_gemm(const Problem& pb, const Item& it, int64_t lo, int64_t hi, int rows, int rows_pad, Scratch& sc,
                 GemmScratch& gs, float* state, int64_t head_size) {
  constexpr bool low = !std::is_same_v<TC, float>;
  RECORD_FUNCTION(low ? "kvops::paged_attention::gemm_path(cache dtype)" : "kvops::paged_attention::gemm_path(fp32)",
                  c10::ArrayRef<const c10::IValue>{});  // (torch.profiler shows which items took this path)
  const TK* kc = static_cast<const TK*>(pb.k);
  const TK* vc = static_cast<const TK*>(pb.v);
  const int32_t* table = pb.table + it.b * pb.table_stride;
  const int d = pb.d, dv = pb.d_v, dvp = pb.dv_pad, nh = pb.num_kv_heads, half = d / 2;
  const int dv_n = round_up(dv, GEMM_N);
  gs.size(rows_pad, pb, sizeof(TC));
  float* S = gs.s.data();
  TC* K = reinterpret_cast<TC*>(gs.k.data());
  TC* V = reinterpret_cast<TC*>(gs.v.data());
  TC* P = low ? reinterpret_cast<TC*>(gs.p.data()) : reinterpret_cast<TC*>(S);
  // Q rows r = i * G + g of KV head h: load_queries' scaled fp32 rows, or the queries as given (scale goes onto S)
  const TC* Q = reinterpret_cast<const TC*>(sc.qf.data());
  int64_t ld_q = pb.d_pad;
  if constexpr (low) {
    TC* q = reinterpret_cast<TC*>(gs.q.data());
    const TQ* src = static_cast<const TQ*>(pb.q);
    const int64_t t0 = pb.cu[it.b] + it.q0;
    for (int h = 0; h < nh; ++h)  // rows [rows, rows_pad): zeros (the GEMMs' M is rounded up to 32)
      std::memset(q + (static_cast<size_t>(h) * rows_pad + rows) * d, 0, sizeof(TC) * (rows_pad - rows) * d);
    for (int h = 0; h < nh; ++h)
      for (int r = 0; r < rows; ++r) {
        const TQ* row = src + (t0 + r / pb.group) * pb.sq[0] + static_cast<int64_t>(h * pb.group + r % pb.group) * pb.sq[1];
        TC* dst = q + (static_cast<size_t>(h) * rows_pad + r) * d;
        if (pb.sq[2] == 1) std::memcpy(dst, row, sizeof(TC) * d);
        else for (int e = 0; e < d; ++e) dst[e] = row[e * pb.sq[2]];
      }
    Q = q;
    ld_q = d;
  }
  const int64_t start = pb.seq_start(it.b);
  const float qk_scale = low ? pb.scale : 1.f;
  // the rows go through the GEMMs GEMM_ROWS at a time (sub-tiles); a sub-tile skips KV tiles none of its rows sees,
  // and a KV tile no sub-tile sees is not gathered
  const int subs = (rows + GEMM_ROWS - 1) / GEMM_ROWS;
  std::vector<int64_t> sub_lo(subs), sub_hi(subs);
  for (int u = 0; u < subs; ++u) {
    sub_lo[u] = hi;
    sub_hi[u] = lo;
    for (int r = u * GEMM_ROWS; r < std::min(rows, (u + 1) * GEMM_ROWS); ++r) {
      sub_lo[u] = std::min(sub_lo[u], sc.row_lo[r]);
      sub_hi[u] = std::max(sub_hi[u], sc.row_hi[r]);
    }
  }
  auto sees = [&](int u, int64_t j0, int n) { return j0 < sub_hi[u] && j0 + n > sub_lo[u]; };
  // the staged K rows [0, last] of a GEMM_N-token block (w 32-bit words each: fp32 values or bf16 / fp16 pairs) into
  // K^T's block at dst (row stride ld words), in 16 x 16 register transposes; token rows past `last` are stale
  auto turn = [&gs](int w, uint32_t* dst, int64_t ld, int last) {
    float tmp[L * L];
    for (int t0 = 0; t0 <= last; t0 += L)
      for (int w0 = 0; w0 < w; w0 += L) {
        vf tile[L];
        for (int i = 0; i < L; ++i)
          std::memcpy(&tile[i], gs.krows.data() + static_cast<size_t>(t0 + i) * w + w0, sizeof(vf));
        transpose16_to(tile, tmp);
        for (int e = 0; e < L; ++e) std::memcpy(dst + static_cast<size_t>(w0 + e) * ld + t0, tmp + e * L, sizeof(vf));
      }
  };
  for (int64_t j0 = lo; j0 < hi; j0 += GEMM_KV) {
    const int n = static_cast<int>(std::min<int64_t>(GEMM_KV, hi - j0));
    const int n_pad = round_up(n, GEMM_N);  // V's rows (zeros past n)
    if (pb.rope_freq) {  // cos / sin of the tile's positions (relative to the sequence start), angles in double
      for (int t = 0; t < n; ++t)
        for (int i = 0; i < half; ++i) {
          const double a = static_cast<double>(j0 + t - start) * pb.rope_freq[i];
          gs.rc[static_cast<size_t>(t) * half + i] = static_cast<float>(std::cos(a));
          gs.rs[static_cast<size_t>(t) * half + i] = static_cast<float>(std::sin(a));
        }
    }
    bool any = false;
    for (int u = 0; u < subs; ++u) any |= sees(u, j0, n);
    if (!any) continue;
    for (int h = 0; h < nh; ++h) {
      // gather the tile's K / V rows of KV head h (positions < hi of blocks the table references: nothing else)
      // into K^T [d][GEMM_KV] and V [n_pad][dv_n] (fp32), or their VNNI forms
      // K^T columns past n are left stale (their scores are never read); V rows past n must be zeros (their P is 0,
      // and 0 x NaN is NaN): the token pairs from n / 2 * 2 on
      if constexpr (low) {
        std::memset(V + static_cast<size_t>(n / 2 * 2) * dv_n, 0,
                    sizeof(TC) * static_cast<size_t>(n_pad - n / 2 * 2) * dv_n);
      } else {
        std::memset(V + static_cast<size_t>(n) * dv_n, 0, sizeof(TC) * static_cast<size_t>(n_pad - n) * dv_n);
      }
      int64_t blk_i = j0 / pb.block_size, row = j0 % pb.block_size, blk = table[blk_i];
      const TK* vprev = nullptr;  // the previous token's V row (the cache-dtype form interleaves pairs)
      for (int t = 0; t < n; ++t) {
        const TK* ks = kc + blk * pb.sk[0] + row * pb.sk[1] + h * pb.sk[2];
        const TK* vs = vc + blk * pb.sv[0] + row * pb.sv[1] + h * pb.sv[2];
        const int tb = t / GEMM_N, tc = t % GEMM_N;
        if constexpr (low) {
          if (pb.sk[3] == 1 && (d / 2) % L == 0) {  // a pair of dims is one 32-bit word: K^T's VNNI form is a
            std::memcpy(gs.krows.data() + static_cast<size_t>(tc) * (d / 2), ks, sizeof(TC) * d);  // word transpose
            if (tc == GEMM_N - 1 || t == n - 1)
              turn(d / 2, reinterpret_cast<uint32_t*>(K) + static_cast<size_t>(tb) * GEMM_N, GEMM_KV, tc);
          } else {
            for (int e = 0; e < d; ++e) K[vnni(e, t, GEMM_KV)] = ks[e * pb.sk[3]];
          }
          if (pb.sv[3] == 1 && dv % 16 == 0 && (t & 1)) {  // the pair (t - 1, t), 16 dims at a time
            const uint16_t* a = reinterpret_cast<const uint16_t*>(vprev);
            const uint16_t* b = reinterpret_cast<const uint16_t*>(vs);
            uint16_t* o = reinterpret_cast<uint16_t*>(V) + static_cast<size_t>(t / 2) * dv_n * 2;
            for (int e = 0; e < dv; e += 16) {
              vh x, y;
              std::memcpy(&x, a + e, sizeof x);
              std::memcpy(&y, b + e, sizeof y);
              // (x0, y0, x1, y1, ...): one 32-bit word per dim, little-endian (even token first)
              const vu w = __builtin_convertvector(x, vu) | (__builtin_convertvector(y, vu) << 16);
              std::memcpy(o + 2 * e, &w, sizeof w);
            }
          } else if (!(pb.sv[3] == 1 && dv % 16 == 0 && t + 1 < n)) {  // else the next token writes the pair
            for (int e = 0; e < dv; ++e) V[vnni(t, e, dv_n)] = vs[e * pb.sv[3]];
          }
          vprev = vs;
        } else {
          float* kr = reinterpret_cast<float*>(gs.krows.data()) + static_cast<size_t>(tc) * d;
          load_row(ks, pb.sk[3], d, kr, d);
          if (pb.rope_freq) {
            const float* c = gs.rc.data() + static_cast<size_t>(t) * half;
            const float* sn = gs.rs.data() + static_cast<size_t>(t) * half;
            for (int i = 0; i < half; ++i) {
              const float x1 = kr[i], x2 = kr[i + half];
              kr[i] = x1 * c[i] - x2 * sn[i];
              kr[i + half] = x2 * c[i] + x1 * sn[i];
            }
          }
          if (d % L == 0) {
            if (tc == GEMM_N - 1 || t == n - 1) turn(d, reinterpret_cast<uint32_t*>(K) + tb * GEMM_N, GEMM_KV, tc);
          } else {
            for (int e = 0; e < d; ++e) K[static_cast<size_t>(e) * GEMM_KV + t] = kr[e];
          }
          load_row(vs, pb.sv[3], dv, V + static_cast<size_t>(t) * dv_n, dv);
        }
        if (++row == pb.block_size && t + 1 < n) {
          row = 0;
          blk = table[++blk_i];
        }
      }
      float* m = state + h * head_size;
      float* l = m + rows_pad;
      float* acc = m + 2 * rows_pad;
      const float* slope = pb.alibi ? sc.slope.data() + static_cast<size_t>(h) * rows_pad : nullptr;
      for (int u = 0; u < subs; ++u) {
        if (!sees(u, j0, n)) continue;
        const int r0 = u * GEMM_ROWS, rs = std::min(GEMM_ROWS, rows - r0);
        // the GEMMs' M: rs rounded up to 32 (pad_rows; rows past `rows`: zero queries, never finalized) and the
        // columns to GEMM_COLS, with fixed row strides, so that few distinct micro-kernels are generated: oneDNN JITs
        // one per shape (~55 us) and keeps it per thread for the process's life (fp32, 3000 chunked prefills of
        // varied lengths, 1 thread, AMD EPYC Zen 4, AVX-512 build: +131 MB RSS at M / columns rounded to 8 / 16, +54
        // at 8 / 64)
        const int rm = std::min(round_up(rs, 32), rows_pad - r0);
        // the sub-tile's columns [c0, c1) of the tile: those its rows see (the causal diagonal, a window's start),
        // widened to multiples of GEMM_COLS (V's rows past n are zeros)
        const int c0 = static_cast<int>(std::max<int64_t>(sub_lo[u] - j0, 0)) / GEMM_COLS * GEMM_COLS;
        const int c1 = round_up(static_cast<int>(std::min<int64_t>(sub_hi[u] - j0, n)), GEMM_COLS);
        const int nc = c1 - c0;
        // S [rm][c0, c1) = Q K^T for rows [r0, r0 + rm): GEMM_QK_N columns at a time (cache-dtype form), in one call
        // (fp32 form); every row stride of K^T, S and P is GEMM_KV
        const TC* qh = Q + (static_cast<size_t>(h) * rows_pad + r0) * ld_q;
        if constexpr (low) {
          for (int c = c0; c < c1; c += GEMM_QK_N)
            at::native::cpublas::brgemm(rm, std::min(GEMM_QK_N, c1 - c), d, ld_q, GEMM_KV, GEMM_KV, false, qh,
                                        K + static_cast<size_t>(c) * 2, S + c, true);
          for (int r = rs; r < rm; ++r)  // P's padding rows: zeros (their products go to padding rows of acc)
            std::memset(P + static_cast<size_t>(r) * GEMM_KV + c0, 0, sizeof(TC) * nc);
        } else {
          at::native::cpublas::brgemm(rm, nc, d, ld_q, GEMM_KV, GEMM_KV, false, qh, K + c0, S + c0, false);
        }
        softmax_tile<TC>(pb, sc, r0, rs, j0 + c0, std::min(n, c1) - c0, nc, GEMM_KV, S + c0, P + c0, m, l, acc, slope,
                         qk_scale);
        // acc [rows][dv_pad] += P V over the columns [c0, c1) (V's rows past n are zeros)
        float* acc0 = acc + static_cast<size_t>(r0) * dvp;
        const TC* vc0 = V + static_cast<size_t>(c0) * dv_n;  // (the VNNI form: pair row c0 / 2 of 2 * dv_n values)
        at::native::cpublas::brgemm(rm, dv, nc, GEMM_KV, dv_n, dvp, true, P + c0, vc0, acc0, low);
      }
    }
  }
  if constexpr (low) at::native::cpublas::brgemm_release(true);
}
