// One K or V segment of kvops::_packed_attention_native as stored, and its dequantization into fp32 tiles (included
// by packed_attention.cpp inside its namespace, after vec.h; hashed with the sources by kvops/native/__init__.py).
//
// Seg::rows(): the rows of a 16-token tile as fp32, vectorized where a row's codes are unit-stride and head_dim is a
// multiple of 16 (every layout kvops.packed.packed_layout allocates; int4 / int2 also need group_size % 16 == 0):
// 16 values at a time -- int8: sign-extend 16 codes, convert, times the row's scale; int4: 8 bytes spread to 16
// lanes, nibbles shifted out per lane, (code - zero / 8) * scale of the group; int2: the centroid row plus each
// stage's 4 bytes spread the same way; bf16: 16-bit words shifted up by 16; fp16: F16C / AVX-512 conversion; fp8:
// the e4m3 table. Any other stride goes through Seg::scalar(), one value at a time. K's tile is then transposed in
// registers (packed_attention.cpp); V's stays row-major.
#pragma once

inline float h2f(const void* p, int64_t i) { return static_cast<float>(static_cast<const c10::Half*>(p)[i]); }

enum Kind { F32, BF16, F16, INT8, FP8, INT4, INT2 };

struct Field {
  const void* p = nullptr;
  int64_t st[5] = {0, 0, 0, 0, 0};
  void set(const at::Tensor& t) {
    p = t.data_ptr();
    for (int i = 0; i < t.dim(); ++i) st[i] = t.stride(i);
  }
};


// 16 int32 lanes from 16 bytes: sign-extended (int8 codes) or zero-extended (GCC lowers __builtin_convertvector of
// byte vectors to scalar code: a quarter of int8 decode's time, perf); 16 fp16 values -> fp32: half16 (vec.h)
#if defined(__AVX512F__)
inline vi widen(__m512i w) { vi r; std::memcpy(&r, &w, sizeof r); return r; }
inline vi sext16(const int8_t* x) { return widen(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)))); }
inline vi zext16(__m128i b) { return widen(_mm512_cvtepu8_epi32(b)); }
inline vi zext16w(const uint16_t* x) {
  return widen(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))));
}
#elif defined(__AVX2__)
inline vi widen(__m256i lo, __m256i hi) {
  vi r;
  std::memcpy(&r, &lo, 32);
  std::memcpy(reinterpret_cast<int32_t*>(&r) + 8, &hi, 32);
  return r;
}
inline vi sext16(const int8_t* x) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return widen(_mm256_cvtepi8_epi32(b), _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}
inline vi zext16(__m128i b) { return widen(_mm256_cvtepu8_epi32(b), _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))); }
inline vi zext16w(const uint16_t* x) {
  return widen(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))),
               _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8))));
}
#else
inline vi sext16(const int8_t* x) { vi r; for (int i = 0; i < L; ++i) r[i] = x[i]; return r; }
inline vi zext16w(const uint16_t* x) { vi r; for (int i = 0; i < L; ++i) r[i] = x[i]; return r; }
#endif

// the codes of 16 consecutive values packed PER to a byte (int4: 2, int2: 4), value i in bits (i % PER) * 8 / PER:
// each byte copied to its PER lanes (one byte shuffle), widened, shifted per lane, masked
template <int PER>
inline vf codes16(const uint8_t* x) {
  vi sh;
  for (int i = 0; i < L; ++i) sh[i] = (i % PER) * (8 / PER);
#if defined(__AVX2__)
  int64_t raw = 0;
  std::memcpy(&raw, x, L / PER);
  alignas(16) int8_t idx[L];
  for (int i = 0; i < L; ++i) idx[i] = static_cast<int8_t>(i / PER);
  const __m128i b = _mm_shuffle_epi8(_mm_cvtsi64_si128(raw), _mm_load_si128(reinterpret_cast<const __m128i*>(idx)));
  const vi w = zext16(b);
#else
  vi w;
  for (int i = 0; i < L; ++i) w[i] = x[i / PER];
#endif
  return __builtin_convertvector((w >> sh) & ((1 << (8 / PER)) - 1), vf);
}

constexpr int AHEAD = 32;  // tokens between a row's prefetch and its read

struct Seg {
  Kind kind;
  int n, d;  // tokens, values per row
  int group = 0, stages = 0;  // int4 / int2
  const int32_t* counts = nullptr;  // row_counts of this segment's rows (nullptr: every row once)
  Field codes, scales, zeros, centroids, ids;
  bool fast = false;  // rows() vectorized (set by finish())

  void finish() {
    const int last = kind == INT2 ? 4 : 3;
    fast = d % L == 0 && codes.st[last] == 1 && (group == 0 || group % L == 0) &&
           (kind != INT2 || centroids.st[3] == 1);
  }

  // n_rows rows from token t0 of (batch b, KV head h) as fp32: values [16c, 16c + 16) of row j go to
  // dst + j * rs + c * cs (16 consecutive floats). Only the bytes of those rows (and their scales, zero points,
  // centroids) are read.
  void rows(int b, int h, int t0, int n_rows, float* dst, int rs, int cs) const {
    if (!fast) {
      for (int j = 0; j < n_rows; ++j)
        for (int c = 0; c < d / L + (d % L != 0); ++c)
          scalar(b, h, t0 + j, c * L, std::min(L, d - c * L), dst + static_cast<int64_t>(j) * rs + c * cs);
      return;
    }
    const int64_t* c = codes.st;
    const int chunks = d / L;
    for (int j = 0; j < n_rows; ++j) {
      const int64_t t = t0 + j;
      float* o = dst + static_cast<int64_t>(j) * rs;
      const int64_t base = b * c[0] + t * c[1] + h * c[2];
      if (t + AHEAD < n) prefetch_row(b, h, t + AHEAD);
      switch (kind) {
        case F32:
          for (int k = 0; k < chunks; ++k) std::memcpy(o + k * cs, static_cast<const float*>(codes.p) + base + k * L, 64);
          break;
        case BF16:
          for (int k = 0; k < chunks; ++k)
            storeu(o + k * cs, (vf)(zext16w(static_cast<const uint16_t*>(codes.p) + base + k * L) << 16));
          break;
        case F16:
          for (int k = 0; k < chunks; ++k) storeu(o + k * cs, half16(static_cast<const uint16_t*>(codes.p) + base + k * L));
          break;
        case INT8: {
          const int8_t* x = static_cast<const int8_t*>(codes.p) + base;
          const float s = h2f(scales.p, b * scales.st[0] + t * scales.st[1] + h * scales.st[2]);
          for (int k = 0; k < chunks; ++k) storeu(o + k * cs, __builtin_convertvector(sext16(x + k * L), vf) * s);
          break;
        }
        case FP8: {
          const uint8_t* x = static_cast<const uint8_t*>(codes.p) + base;
          const float s = static_cast<const float*>(scales.p)[b * scales.st[0] + h * scales.st[1]];
          const float* lut = fp8_lut().v;
          for (int k = 0; k < chunks; ++k) {
            vf v;
            for (int i = 0; i < L; ++i) v[i] = lut[x[k * L + i]];
            storeu(o + k * cs, v * s);
          }
          break;
        }
        case INT4: {
          const uint8_t* x = static_cast<const uint8_t*>(codes.p) + base;
          const int64_t srow = b * scales.st[0] + t * scales.st[1] + h * scales.st[2];
          const int64_t zrow = b * zeros.st[0] + t * zeros.st[1] + h * zeros.st[2];
          const int8_t* z = static_cast<const int8_t*>(zeros.p);
          for (int g = 0, k = 0; g < d / group; ++g) {  // scale and zero point (in eighths) once per group
            const float s = h2f(scales.p, srow + g * scales.st[3]);
            const float zs = static_cast<float>(z[zrow + g * zeros.st[3]]) * 0.125f * s;
            for (const int k1 = k + group / L; k < k1; ++k) storeu(o + k * cs, codes16<2>(x + k * L / 2) * s - zs);
          }
          break;
        }
        case INT2: {
          const int cid = static_cast<const uint8_t*>(ids.p)[b * ids.st[0] + t * ids.st[1] + h * ids.st[2]];
          const uint16_t* cent = static_cast<const uint16_t*>(centroids.p) + b * centroids.st[0] +
                                 h * centroids.st[1] + cid * centroids.st[2];
          const int8_t* z = static_cast<const int8_t*>(zeros.p);
          for (int k = 0; k < chunks; ++k) storeu(o + k * cs, half16(cent + k * L));
          for (int st = 0; st < stages; ++st) {  // each stage adds (code - zero / 8) * scale, per group
            const uint8_t* x = static_cast<const uint8_t*>(codes.p) + base + st * c[3];
            const int64_t srow = b * scales.st[0] + t * scales.st[1] + h * scales.st[2] + st * scales.st[3];
            const int64_t zrow = b * zeros.st[0] + t * zeros.st[1] + h * zeros.st[2] + st * zeros.st[3];
            for (int g = 0, k = 0; g < d / group; ++g) {
              const float s = h2f(scales.p, srow + g * scales.st[4]);
              const float zs = static_cast<float>(z[zrow + g * zeros.st[4]]) * 0.125f * s;
              for (const int k1 = k + group / L; k < k1; ++k)
                storeu(o + k * cs, loadu(o + k * cs) + (codes16<4>(x + k * L / 4) * s - zs));
            }
          }
          break;
        }
      }
    }
  }

  // the cache lines of token t's codes (and int8 scales): a KV head's rows are strided (by H_kv rows), which the
  // hardware prefetcher follows poorly (perf, AVX-512 host: int8 decode stalled on the code loads), so rows() asks
  // for each row AHEAD tokens before it reads it, one row at a time (a burst per tile would overflow the miss buffers)
  void prefetch_row(int b, int h, int64_t t) const {
    const int64_t* c = codes.st;
    const int64_t base = b * c[0] + t * c[1] + h * c[2];
    static constexpr int size[] = {4, 2, 2, 1, 1, 1, 1};  // bytes per stored element of each Kind
    const char* x = static_cast<const char*>(codes.p) + base * size[kind];
    const int bytes = kind == INT4 ? d / 2 : kind == INT2 ? d / 4 : d * size[kind];
    for (int st = 0; st < (kind == INT2 ? stages : 1); ++st)
      for (int i = 0; i < bytes; i += 64) prefetch_line(x + st * c[3] + i);
    if (kind == INT8 || kind == INT4)
      prefetch_line(static_cast<const char*>(scales.p) + 2 * (b * scales.st[0] + t * scales.st[1] + h * scales.st[2]));
  }

  // values [e0, e0 + m) of token t's row to o[0, m), one at a time through the strides (any layout)
  void scalar(int b, int h, int64_t t, int e0, int m, float* o) const {
    const int64_t* c = codes.st;
    const int64_t base = b * c[0] + t * c[1] + h * c[2];
    for (int i = 0; i < m; ++i) {
      const int e = e0 + i;
      float v = 0.f;
      switch (kind) {
        case F32: v = static_cast<const float*>(codes.p)[base + e * c[3]]; break;
        case BF16: {
          const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(codes.p)[base + e * c[3]]) << 16;
          std::memcpy(&v, &bits, 4);
          break;
        }
        case F16: v = h2f(codes.p, base + e * c[3]); break;
        case INT8:
          v = static_cast<float>(static_cast<const int8_t*>(codes.p)[base + e * c[3]]) *
              h2f(scales.p, b * scales.st[0] + t * scales.st[1] + h * scales.st[2]);
          break;
        case FP8:
          v = fp8_lut().v[static_cast<const uint8_t*>(codes.p)[base + e * c[3]]] *
              static_cast<const float*>(scales.p)[b * scales.st[0] + h * scales.st[1]];
          break;
        case INT4: {  // two codes per byte (value 2i low nibble), (code - zero / 8) * scale per group
          const int byte = static_cast<const uint8_t*>(codes.p)[base + (e >> 1) * c[3]];
          const int g = e / group;
          const float s = h2f(scales.p, b * scales.st[0] + t * scales.st[1] + h * scales.st[2] + g * scales.st[3]);
          const float zf = static_cast<float>(static_cast<const int8_t*>(zeros.p)[
                               b * zeros.st[0] + t * zeros.st[1] + h * zeros.st[2] + g * zeros.st[3]]) * 0.125f;
          v = (static_cast<float>((byte >> (4 * (e & 1))) & 15) - zf) * s;
          break;
        }
        case INT2: {  // centroid of the token's cluster + every stage's (code - zero / 8) * scale, 4 codes per byte
          const int cid = static_cast<const uint8_t*>(ids.p)[b * ids.st[0] + t * ids.st[1] + h * ids.st[2]];
          v = h2f(centroids.p, b * centroids.st[0] + h * centroids.st[1] + cid * centroids.st[2] + e * centroids.st[3]);
          const int g = e / group;
          for (int st = 0; st < stages; ++st) {
            const int byte = static_cast<const uint8_t*>(codes.p)[base + st * c[3] + (e >> 2) * c[4]];
            const int64_t s_at = b * scales.st[0] + t * scales.st[1] + h * scales.st[2] + st * scales.st[3];
            const int64_t z_at = b * zeros.st[0] + t * zeros.st[1] + h * zeros.st[2] + st * zeros.st[3];
            const float s = h2f(scales.p, s_at + g * scales.st[4]);
            const float zf = static_cast<float>(static_cast<const int8_t*>(zeros.p)[z_at + g * zeros.st[4]]) * 0.125f;
            v += (static_cast<float>((byte >> (2 * (e & 3))) & 3) - zf) * s;
          }
          break;
        }
      }
      o[i] = v;
    }
  }
};
