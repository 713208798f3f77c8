// Vector helpers shared by the native CPU kernels (paged_attention.cpp, packed_attention.cpp): 16-lane fp32/int32
// vectors (GCC/Clang vector extensions under -march=native: one zmm register on AVX-512, two ymm on AVX2, four q on
// NEON), unaligned loads and stores, select, horizontal sum, a vectorized exp, and the fp8 e4m3 -> fp32 table; and
// nv, the hardware-width vector the hottest loops accumulate in. Header-only; each kernel includes it inside its own
// namespace. kvops/native/__init__.py hashes it with the sources.
#pragma once

constexpr int L = 16;  // vector lanes
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
typedef float nv __attribute__((vector_size(NW * 4)));
inline nv loadn(const float* p) { nv v; std::memcpy(&v, p, sizeof v); return v; }
inline void storen(float* p, nv v) { std::memcpy(p, &v, sizeof v); }
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline vf loadu(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void storeu(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{} + x; }
inline vf vsel(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
inline float hsum(vf v) { float s = 0.f; for (int i = 0; i < L; ++i) s += v[i]; return s; }
// whether a lane is NaN (a visible key's NaN score makes its row NaN, as SDPA's: the kernels check it explicitly,
// because a max over lanes may drop a NaN)
inline bool any_nan(vf v) {
  const vi bad = v != v;
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
inline vf vexp(vf x) { return vexp_t<vf, vi>(x); }
typedef int32_t nvi __attribute__((vector_size(NW * 4)));
inline nv vexpn(nv x) { return vexp_t<nv, nvi>(x); }

struct Fp8Lut {
  float v[256];
  Fp8Lut() {
    for (int i = 0; i < 256; ++i)
      v[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
  }
};
inline const Fp8Lut& fp8_lut() { static const Fp8Lut lut; return lut; }
