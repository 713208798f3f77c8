// Vector helpers shared by the native CPU kernels (paged_attention.cpp, packed_attention.cpp): 16-lane fp32/int32
// vectors (GCC/Clang vector extensions; AVX-512 / AVX2 / NEON under -march=native), unaligned loads and stores,
// select, horizontal sum, a vectorized exp, and the fp8 e4m3 -> fp32 table. Header-only; each kernel includes it
// inside its own namespace. kvops/native/__init__.py hashes it with the sources.
#pragma once

constexpr int L = 16;  // vector lanes
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline vf loadu(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void storeu(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf splat(float x) { return vf{} + x; }
inline vf vsel(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
inline float hsum(vf v) { float s = 0.f; for (int i = 0; i < L; ++i) s += v[i]; return s; }

// exp with exact 0 for x < -87 (incl. -inf); Cephes expf polynomial, ~1 ulp
inline vf vexp(vf x) {
  const vi under = x < splat(-87.0f);
  x = vsel(under, splat(-87.0f), x);
  x = vsel(x > splat(88.0f), splat(88.0f), x);
  const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  vf r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  return vsel(under, splat(0.0f), p * (vf)e);
}

struct Fp8Lut {
  float v[256];
  Fp8Lut() {
    for (int i = 0; i < 256; ++i)
      v[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
  }
};
inline const Fp8Lut& fp8_lut() { static const Fp8Lut lut; return lut; }
