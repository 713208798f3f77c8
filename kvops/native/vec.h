// Vector helpers shared by the native CPU kernels (paged_attention.cpp, packed_attention.cpp): 16-lane fp32/int32
// vectors (GCC/Clang vector extensions under -march=native: one zmm register on AVX-512, two ymm on AVX2, four q on
// NEON), unaligned loads and stores, select, horizontal sum, a vectorized exp, prefetch_line, the 16x16 in-register transpose
// (transpose16_to) and the fp8 e4m3 -> fp32 table; and nv, the hardware-width vector the hottest loops accumulate in.
// Header-only; each kernel includes it inside its own namespace, after <immintrin.h> on x86-64 (the AVX2 transpose
// uses its intrinsics). kvops/native/__init__.py hashes it with the sources.
#pragma once

constexpr int L = 16;  // vector lanes
// Scratch vectors on 64-byte (cache-line) boundaries: malloc's 16-byte alignment made every row of the GEMM path's
// scratch straddle two lines, and oneDNN's AMX micro-kernel ran at a third of its speed on such rows (tile loads and
// stores: 510 against 1520 GFLOP/s for a 256 x 256 x 128 bf16 product on an AVX-512 host with AMX); vector loads of
// the register kernel's scratch split lines too.
template <typename T>
struct Align64 {
  using value_type = T;
  Align64() = default;
  template <typename U>
  Align64(const Align64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const Align64<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Align64<U>&) const { return false; }
};
template <typename T>
using avec = std::vector<T, Align64<T>>;

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
// GCC lowers arrays of 16-lane vectors badly where the hardware vector is narrower: on AVX2 (Zen 3) the
// accumulators of the score and PV loops went through the stack and general registers (vmovq / vpinsrq) at every
// FMA. Those loops accumulate in nv instead: 8 lanes (one ymm) on x86 without AVX-512, and the 16-lane vf elsewhere
// (AVX-512, NEON: unchanged), looping over the NH = L / NW parts of a 16-lane row; the sums are the same.
#if defined(__x86_64__) && !defined(__AVX512F__)
constexpr int NW = 8;
#else
constexpr int NW = L;
#endif
constexpr int NH = L / NW;
// accumulator vectors (nv) the score and PV loops keep in flight: 16 of the 32 zmm registers on AVX-512 (each FMA's
// 4-cycle latency hidden at 2 FMAs per cycle); 8 where there are 16 registers (AVX2) or an nv is 4 of them (NEON)
#if defined(__AVX512F__)
constexpr int ACC_REGS = 16;
#else
constexpr int ACC_REGS = 8;
#endif
constexpr int pow2_floor(int x) { return x >= 16 ? 16 : x >= 8 ? 8 : x >= 4 ? 4 : x >= 2 ? 2 : 1; }
// 16-token vectors per chunk of the register kernel where the registers allow (AVX-512): each K load feeds 2 RB FMAs
// and the online softmax runs once per 32 tokens (attend_regs.h: chunk, chunk_pairs.h)
constexpr int WIDE_NV = ACC_REGS >= 16 ? 2 : 1;
typedef float nv __attribute__((vector_size(NW * 4)));
inline nv loadn(const float* p) { nv v; std::memcpy(&v, p, sizeof v); return v; }
inline void storen(float* p, nv v) { std::memcpy(p, &v, sizeof v); }
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline vf loadu(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void storeu(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{} + x; }
inline vf vsel(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
inline float hsum(vf v) { float s = 0.f; for (int i = 0; i < L; ++i) s += v[i]; return s; }
typedef int32_t nvi __attribute__((vector_size(NW * 4)));
// a 32-bit word holding the bf16 of dims (2w, 2w + 1): the fp32 of the even dim is the word shifted up by 16, of the
// odd dim its high half (chunk_pairs.h, scores_rows.h)
inline nv even_dims(nv w) { return (nv)((nvi)w << 16); }
inline nv odd_dims(nv w) { return (nv)((nvi)w & (nvi{} + static_cast<int32_t>(0xffff0000u))); }
// fp16 bits -> fp32: 16 values (half16) or NW (half_nw), with vcvtph2ps (AVX-512, F16C: every x86-64-v3 CPU), else
// per value. c10::Half's own conversion is per value: the register kernel read fp16 caches that way, 4x the time of
// bf16 (AVX-512 build, AMD EPYC Zen 4, Llama-3.1-8B fp16 decode B 8 ctx 1024 with its K/V in L2: 156 ns per token and
// KV head against 38 for bf16; perf: the scalar conversions 43% of the samples)
inline vf half16(const uint16_t* x) {
  vf r;
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  std::memcpy(&r, &v, sizeof r);
#elif defined(__F16C__)
  const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8)));
  std::memcpy(&r, &a, 32);
  std::memcpy(reinterpret_cast<float*>(&r) + 8, &b, 32);
#else
  for (int i = 0; i < L; ++i) r[i] = static_cast<float>(c10::Half(x[i], c10::Half::from_bits()));
#endif
  return r;
}
inline nv half_nw(const uint16_t* x) {
  nv r;
#if defined(__F16C__) && !defined(__AVX512F__)  // NW = 8
  const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  std::memcpy(&r, &a, sizeof r);
#else
  if constexpr (NW == L) {
    const vf v = half16(x);
    std::memcpy(&r, &v, sizeof r);
  } else {
    for (int i = 0; i < NW; ++i) r[i] = static_cast<float>(c10::Half(x[i], c10::Half::from_bits()));
  }
#endif
  return r;
}
// Compares of 16-lane vectors (all-ones lanes where true). GCC 12 lowers a compare of two 16-lane float or int32
// vectors to 16 scalar compares where the hardware vector is narrower (the x86-64-v3 build: vcomiss / cmp and seta
// per lane, in vexp, the softmax's masks and NaN checks: online_softmax took 19% of Qwen2.5-0.5B decode there, 13%
// after), so there they compare the NW-lane parts; elsewhere the operator.
template <typename V, typename Op>
inline vi cmp_parts(V a, V b, Op op) {  // V: vf or vi
  if constexpr (NW == L) {
    return op(a, b);
  } else {
    typedef std::conditional_t<std::is_same_v<V, vf>, nv, nvi> part;
    part x[NH], y[NH];
    nvi r[NH];
    std::memcpy(x, &a, sizeof a);
    std::memcpy(y, &b, sizeof b);
    for (int k = 0; k < NH; ++k) r[k] = op(x[k], y[k]);
    vi out;
    std::memcpy(&out, r, sizeof out);
    return out;
  }
}
inline vi vlt(vf a, vf b) { return cmp_parts(a, b, [](auto x, auto y) { return x < y; }); }
inline vi vgt(vf a, vf b) { return vlt(b, a); }
inline vi visnan(vf a) { return cmp_parts(a, a, [](auto x, auto y) { return x != y; }); }
inline vi ilt(vi a, vi b) { return cmp_parts(a, b, [](auto x, auto y) { return x < y; }); }
inline vi ige(vi a, vi b) { return cmp_parts(a, b, [](auto x, auto y) { return x >= y; }); }
inline vi ine(vi a, vi b) { return cmp_parts(a, b, [](auto x, auto y) { return x != y; }); }
// whether a lane of one hardware-width vector is greater than th (false for NaN lanes), or is NaN (the softmax's
// row parts)
inline bool any_gt_n(nv v, float th) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(th), _CMP_GT_OQ) != 0;
#elif defined(__AVX2__)
  return _mm256_movemask_ps(_mm256_cmp_ps((__m256)v, _mm256_set1_ps(th), _CMP_GT_OQ)) != 0;
#else
  bool any = false;
  for (int i = 0; i < NW; ++i) any |= v[i] > th;
  return any;
#endif
}
inline bool any_nan_n(nv v) {
  bool any = false;
  for (int i = 0; i < NW; ++i) any |= v[i] != v[i];
  return any;
}
// whether a lane is NaN (a visible key's NaN score makes its row NaN, as SDPA's: the kernels check it explicitly,
// because a max over lanes may drop a NaN)
inline bool any_nan(vf v) {
  const vi bad = visnan(v);
  int32_t any = 0;
  for (int i = 0; i < L; ++i) any |= bad[i];
  return any != 0;
}

// exp with exact 0 for x < -87 (incl. -inf); Cephes expf polynomial, ~1 ulp; any vector width (V: float lanes, VI:
// int32 lanes of the same count): vf, or nv where the hardware vector is narrower
template <typename V, typename VI>
inline V vexp_t(V x) {
  auto sel = [](VI mask, V a, V b) { return (V)((mask & (VI)a) | (~mask & (VI)b)); };
  const VI under = x < (V{} - 87.0f);
  x = sel(under, V{} - 87.0f, x);
  x = sel(x > (V{} + 88.0f), V{} + 88.0f, x);
  const V n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  V r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  V p = V{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const VI e = (__builtin_convertvector(n, VI) + 127) << 23;
  return sel(under, V{}, p * (V)e);
}
inline nv vexpn(nv x) { return vexp_t<nv, nvi>(x); }
// vexpn of K independent vectors in place, each polynomial step applied to all K before the next (vexpn's values
// for x <= 88; on AVX-512 the last rounding may differ by an ulp, and x > 88 gives inf, where the softmax never
// calls it: x = score - max <= 0): one exp is a ~20-deep chain of dependent FMAs, and a loop of single exps kept the
// out-of-order window full of waiting steps (the GEMM path's softmax ran at ~1.7 cycles per score on an AVX-512 host)
template <int K>
inline void vexpn_k(nv* x) {
#if defined(__AVX512F__)
  if constexpr (NW == 16) {
    // AVX-512: the same reduction and polynomial; 2^n applied by vscalefps (no clamps, no integer exponent), lanes
    // under -87 (incl. -inf) zeroed by its mask, NaN kept. Chunked prefill 4 x (512 + 128), Qwen2.5-0.5B heads, AMD
    // EPYC Zen 4: bf16 8.10 -> 7.69 ms, fp32 13.29 -> 12.6 (the softmax was ~a third of the bf16 form's non-GEMM time)
    const __m512 lo = _mm512_set1_ps(-87.0f);
    __mmask16 keep[K];
    __m512 n[K], r[K], p[K];
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) {
      const __m512 v = reinterpret_cast<__m512>(x[k]);
      keep[k] = _mm512_cmp_ps_mask(v, lo, _CMP_NLT_UQ);
      n[k] = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r[k] = _mm512_fnmadd_ps(n[k], _mm512_set1_ps(0.693359375f), v);
      r[k] = _mm512_fnmadd_ps(n[k], _mm512_set1_ps(-2.12194440e-4f), r[k]);
    }
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) p[k] = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500e-4f), r[k], _mm512_set1_ps(1.3981999507e-3f));
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) p[k] = _mm512_fmadd_ps(p[k], r[k], _mm512_set1_ps(8.3334519073e-3f));
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) p[k] = _mm512_fmadd_ps(p[k], r[k], _mm512_set1_ps(4.1665795894e-2f));
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) p[k] = _mm512_fmadd_ps(p[k], r[k], _mm512_set1_ps(1.6666665459e-1f));
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) p[k] = _mm512_fmadd_ps(p[k], r[k], _mm512_set1_ps(5.0000001201e-1f));
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) {
      p[k] = _mm512_fmadd_ps(_mm512_mul_ps(p[k], r[k]), r[k], _mm512_add_ps(r[k], _mm512_set1_ps(1.0f)));
      x[k] = reinterpret_cast<nv>(_mm512_maskz_scalef_ps(keep[k], p[k], n[k]));
    }
    return;
  }
#endif
  auto sel = [](nvi mask, nv a, nv b) { return (nv)((mask & (nvi)a) | (~mask & (nvi)b)); };
  nvi under[K];
  nv n[K], r[K], p[K];
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) {
    under[k] = x[k] < (nv{} - 87.0f);
    x[k] = sel(under[k], nv{} - 87.0f, x[k]);
    x[k] = sel(x[k] > (nv{} + 88.0f), nv{} + 88.0f, x[k]);
    n[k] = (x[k] * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  }
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) r[k] = x[k] - n[k] * 0.693359375f;
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) r[k] = r[k] + n[k] * 2.12194440e-4f;
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) p[k] = (nv{} + 1.9875691500e-4f) * r[k] + 1.3981999507e-3f;
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) p[k] = p[k] * r[k] + 8.3334519073e-3f;
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) p[k] = p[k] * r[k] + 4.1665795894e-2f;
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) p[k] = p[k] * r[k] + 1.6666665459e-1f;
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) p[k] = p[k] * r[k] + 5.0000001201e-1f;
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) {
    p[k] = p[k] * r[k] * r[k] + r[k] + 1.0f;
    const nvi e = (__builtin_convertvector(n[k], nvi) + 127) << 23;
    x[k] = sel(under[k], nv{}, p[k] * (nv)e);
  }
}
inline vf vexp(vf x) {  // (per NW-lane part where the hardware vector is narrower: cmp_parts; the same values)
  if constexpr (NW == L) {
    return vexp_t<vf, vi>(x);
  } else {
    nv h[NH];
    std::memcpy(h, &x, sizeof x);
    for (int k = 0; k < NH; ++k) h[k] = vexpn(h[k]);
    vf r;
    std::memcpy(&r, h, sizeof r);
    return r;
  }
}

// in-register 16x16 transpose: rows m[0..15] -> columns. Stage H swaps bit H of row and lane index: rows i and
// i + H (bit H clear in i) become shuffle(a, b, lo) and shuffle(a, b, hi) with constant index vectors (indices >= 16
// pick from b), so each stage is 16 two-source permutes and nothing else.
template <int H>
inline void transpose_stage(vf* m, const vi lo, const vi hi) {
#pragma GCC unroll 16
  for (int i = 0; i < L; ++i) {
    if (i & H) continue;
    const vf a = m[i], b = m[i + H];
#if defined(__clang__)
    vf x, y;
    for (int c = 0; c < L; ++c) {
      x[c] = lo[c] < L ? a[lo[c]] : b[lo[c] - L];
      y[c] = hi[c] < L ? a[hi[c]] : b[hi[c] - L];
    }
    m[i] = x;
    m[i + H] = y;
#else
    m[i] = __builtin_shuffle(a, b, lo);
    m[i + H] = __builtin_shuffle(a, b, hi);
#endif
  }
}

__attribute__((always_inline)) inline void transpose16(vf* m) {
  transpose_stage<8>(m, vi{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                     vi{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  transpose_stage<4>(m, vi{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                     vi{4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
  transpose_stage<2>(m, vi{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                     vi{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
  transpose_stage<1>(m, vi{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
                     vi{1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
}

// 16 rows of 16 floats (row(t): token t's, read in place) -> out [16 dims][16 tokens] (row e of out, at out + e *
// stride: dim e of every token); transpose16_to: the rows of a tile [16 tokens][16 dims]. The register kernel reads
// K rows in place, not copied into a tile first, and the transpose is always inlined: GCC 12 had kept the fp32 chunk's
// transpose16_to out of line, its tile copied through memmove and m through memory (AVX-512 build, AMD EPYC Zen 4,
// Llama-3.1-8B fp32 decode B 8 ctx 1024 with its K/V in L2: 3.70 -> 2.61 ms, ctx 4096 from memory 19.4 -> 17.3 ms).
// On AVX2 the tile's 16-byte stores were read back by 32-byte loads (store-forwarding stalls: 10% of Qwen2.5-0.5B
// bf16 decode's samples, x86-64-v3 build); its time moved within noise.
#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2: four 8x8 transposes of ymm registers (unpack, shuffle, lane permute: 24 instructions each). GCC lowers
// transpose16's 16-lane two-source shuffles to ~950 scalar moves on AVX2, which made the K transpose the main cost
// of decode at small GQA groups (G = 1: 2.4x SDPA's time at head_dim 64).
inline void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

template <typename Row>
__attribute__((always_inline)) inline void transpose16_rows(Row row, float* out, int stride = L) {
  for (int bt = 0; bt < L; bt += 8)  // tokens [bt, bt + 8) x dims [be, be + 8) -> out rows be.., columns bt..
    for (int be = 0; be < L; be += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(row(bt + i) + be);
      transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + (be + i) * stride + bt, r[i]);
    }
}
#else
template <typename Row>  // where transpose16 was out of line, m went through memory (Qwen2.5-0.5B bf16 at GQA 7, K/V
// in L2: 1.07 -> 1.32 ms)
__attribute__((always_inline)) inline void transpose16_rows(Row row, float* out, int stride = L) {
  vf m[L];
  for (int t = 0; t < L; ++t) m[t] = loadu(row(t));
  transpose16(m);
  for (int e = 0; e < L; ++e) storeu(out + e * stride, m[e]);
}
#endif
inline void transpose16_to(const vf* tile, float* out, int stride = L) {
  transpose16_rows([tile](int t) { return reinterpret_cast<const float*>(tile + t); }, out, stride);
}

struct Fp8Lut {
  float v[256];
  Fp8Lut() {
    for (int i = 0; i < 256; ++i)
      v[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
  }
};
inline const Fp8Lut& fp8_lut() { static const Fp8Lut lut; return lut; }

// one cache line ahead of its use, into L2 (prefetcht1; GCC 12 was seen to drop __builtin_prefetch in these kernels,
// so the x86 instruction is emitted directly). prefetcht0 (into L1) made decode from memory up to 1.6x slower on AMD
// EPYC Zen 4: Llama-3.1-8B bf16 B 8 ctx 4096 0.63-0.73 -> 0.42-0.43 the ideal (AVX-512 build), 0.86-0.88 -> 0.55-0.57
// (x86-64-v3 build), fp32 B 8 ctx 1024 0.76-0.78 -> 0.48; the L2 hits cost nothing measurable (docs/native-kernel.md).
// On a Sapphire Rapids Xeon the two were the same within noise.
inline void prefetch_line(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p);
#endif
}
