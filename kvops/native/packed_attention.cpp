// Native CPU kernel for kvops::packed_attention (docs/semantics.md §2), registered as
// kvops::_packed_attention_native.
//
// Built on first use together with paged_attention.cpp (one extension, kvops/native/__init__.py); the Python op
// kvops::packed_attention calls it for CPU tensors after its validator ran (kvops/_checks/packed.py), so this file
// trusts the arguments' metadata (dtypes, ranks, shapes) and reads values only. The one index among those values,
// int2 cluster ids, is checked against the number of centroids before any work (check_cluster_ids); row_counts are
// weights (their length is metadata), never addresses.
//
// Semantics: softmax attention of q [B, T, H_q, D] to every row of every segment (no mask), GQA query head h reading
// KV head h / (H_q / H_kv); out [B, T, H_q, D_v] in q's dtype, lse [B, H_q, T] fp32 (natural log). Segments are dense
// [B, n, H_kv, D] tensors (fp32/bf16/fp16) or packed ones (layouts: kvops.packed.packed_layout): their stored tensors
// are read directly -- codes, scales, integer zero points, centroids and cluster ids -- and dequantized into a 16-token
// fp32 tile in registers/L1 inside the tile loop, so the bytes read per call are the packed bytes and no dense copy of
// the window exists. One online softmax (running max m, sum l, accumulator acc, fp32) runs across all segments, which
// is the LSE merge of per-segment results done incrementally.
//
// Work: one item per (batch, KV head, tile of <= 128 query rows), row r = query i * G + group head g, under
// at::parallel_for. Every tensor is addressed through its strides (pool slots, head slices, narrowed rows).
// Per 16-token tile: K's rows dequantized 16 values at a time (packed_tile.h: vectorized for unit-stride rows, one
// value at a time otherwise; each row prefetched 32 tokens ahead) into 16x16 blocks that the in-register transpose of
// vec.h turns into K^T; scores, online softmax, then V's rows dequantized row-major and accumulated (unit-stride
// int8 V: accumulated straight from its codes, the row scales folded into the softmax weights). A KV head's rows
// go through the math in blocks of RB = 1, 2, 3, 4 (decode with GQA ratio <= 4: no padded rows) or 8, with 8 / RB
// accumulator sets in the scores (attend_regs.h's chunk()). Measured (AVX-512 with AMX Xeon, 1 thread, decode
// B = 8, bf16 q, benchmarks/paged_decode.py): scalar dequantization with K written transposed one value at a time
// and rows always padded to 8 made int8 1.8x (Qwen2.5-0.5B) to 5.6x (Llama-3.1-8B) and int4 2.7-4.3x the time of
// dense bf16 paged attention over the same values; docs/packed-cache.md has the table after.
// Vector code uses GCC/Clang vector extensions (AVX-512 / AVX2 / NEON under -march=native).

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace kvops_packed_native {
namespace {

#include "vec.h"  // L = 16 lanes, vf/vi, loadu/storeu/splat/vsel/hsum, vexp, fp8_lut
constexpr int BN = L;  // tokens per tile = vector lanes
constexpr int ROWS = 128;  // query rows per item (per KV head)

inline float hmax(vf v) { float m = v[0]; for (int i = 1; i < BN; ++i) m = v[i] > m ? v[i] : m; return m; }

#include "packed_tile.h"  // Seg: one K or V segment as stored, and its dequantization into fp32 tiles

Seg dense_seg(const at::Tensor& x) {
  Seg s;
  s.kind = x.scalar_type() == at::kFloat ? F32 : x.scalar_type() == at::kBFloat16 ? BF16 : F16;
  s.n = static_cast<int>(x.size(1));
  s.d = static_cast<int>(x.size(3));
  s.codes.set(x);
  s.finish();
  return s;
}

// fields of one packed segment in kvops.packed.packed_layout's order: codes, scales[, zeros[, centroids, ids]]
// int2 cluster ids [B, T, H] (uint8, any strides) index the segment's C centroids: a PackedKV is a public tuple, so
// they are checked (before any parallel region) rather than trusted; one pass over a byte per (token, head).
void check_cluster_ids(const at::Tensor& ids, int64_t clusters) {
  if (clusters >= 256) return;  // every uint8 is a centroid
  const uint8_t* p = ids.data_ptr<uint8_t>();
  for (int64_t b = 0; b < ids.size(0); ++b)
    for (int64_t t = 0; t < ids.size(1); ++t)
      for (int64_t h = 0; h < ids.size(2); ++h) {
        const int64_t id = p[b * ids.stride(0) + t * ids.stride(1) + h * ids.stride(2)];
        TORCH_CHECK(id < clusters, "kvops.packed_attention: cluster_ids[", b, ", ", t, ", ", h, "] = ", id,
                    " is not a centroid of its segment: cluster ids must be in [0, ", clusters, ") (centroids [B, H, ",
                    clusters, ", D]). Pass the cluster_ids that kvops.packed.quantize_kv wrote with those centroids.");
      }
}

Seg packed_seg(const std::string& quant, const std::vector<at::Tensor>& f, size_t i) {
  Seg s;
  s.codes.set(f[i]);
  s.scales.set(f[i + 1]);
  s.n = static_cast<int>(f[i].size(1));
  if (quant == "int8" || quant == "fp8") {
    s.kind = quant == "int8" ? INT8 : FP8;
    s.d = static_cast<int>(f[i].size(3));
  } else if (quant == "int4") {
    s.kind = INT4;
    s.d = static_cast<int>(f[i].size(3)) * 2;
    s.group = s.d / static_cast<int>(f[i + 1].size(3));
    s.zeros.set(f[i + 2]);
  } else {
    s.kind = INT2;
    s.d = static_cast<int>(f[i].size(4)) * 4;
    s.stages = static_cast<int>(f[i].size(3));
    s.group = s.d / static_cast<int>(f[i + 1].size(4));
    s.zeros.set(f[i + 2]);
    s.centroids.set(f[i + 3]);
    s.ids.set(f[i + 4]);
    check_cluster_ids(f[i + 4], f[i + 3].size(2));
  }
  s.finish();
  return s;
}

inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

struct Problem {
  const void* q;
  int64_t sq[4];
  int batch, tokens, num_heads, num_kv_heads, group, d, d_v, dp, dvp;
  float scale;
  std::vector<Seg> ks, vs;
  void* out;  // [B, T, H_q, D_v] contiguous
  float* lse;  // [B, H_q, T] contiguous
};

struct Item { int b, h, r0, rows; };

// rows of an item padded to the row block of the math: 1, 2, 3, 4 (decode with GQA ratio <= 4), else a multiple of 8
inline int pad_rows(int rows) { return rows <= 4 ? rows : round_up(rows, 8); }

// scores p[r] = q_r . k_t of the tile's 16 tokens (kt[e * 16 + t]: K transposed), RB rows at a time (each kt[e]
// load feeds RB FMAs); NA accumulator sets (dims e = j mod NA) keep 8 FMA chains in flight when RB < 8 (in
// hardware-width parts of NW tokens, vec.h: on AVX2 the NA * RB = 8 accumulators are 8 ymm registers)
template <int RB>
void scores(const float* qf, int dp, const float* kt, int rows_pad, vf* p) {
  constexpr int NA = 8 / RB;
  for (int r0 = 0; r0 < rows_pad; r0 += RB) {
    const float* q0 = qf + static_cast<size_t>(r0) * dp;
    for (int c = 0; c < NH; ++c) {
      nv a[NA][RB] = {};
      for (int e = 0; e < dp; e += NA)
        for (int j = 0; j < NA; ++j) {
          const nv kv = loadn(kt + static_cast<size_t>(e + j) * BN + c * NW);
          for (int i = 0; i < RB; ++i) a[j][i] += q0[i * dp + e + j] * kv;
        }
      for (int i = 0; i < RB; ++i) {
        nv sum = a[0][i];
        for (int j = 1; j < NA; ++j) sum += a[j][i];
        storen(reinterpret_cast<float*>(&p[r0 + i]) + c * NW, sum);
      }
    }
  }
}

// acc[r] = acc[r] * alpha[r] + sum_t p[r][t] v_t (vt[t * dvp + e]: V row-major), RB rows x NW dims at a time
template <int RB>
void accumulate(float* acc, int dvp, const float* vt, int nt, const vf* p, const float* alpha, int rows_pad) {
  for (int e0 = 0; e0 < dvp; e0 += NW)
    for (int r0 = 0; r0 < rows_pad; r0 += RB) {
      nv a[RB];
      for (int i = 0; i < RB; ++i) a[i] = loadn(acc + static_cast<size_t>(r0 + i) * dvp + e0) * alpha[r0 + i];
      for (int j = 0; j < nt; ++j) {
        const nv vv = loadn(vt + static_cast<size_t>(j) * dvp + e0);
        for (int i = 0; i < RB; ++i) a[i] += p[r0 + i][j] * vv;
      }
      for (int i = 0; i < RB; ++i) storen(acc + static_cast<size_t>(r0 + i) * dvp + e0, a[i]);
    }
}

// accumulate() straight from unit-stride int8 V codes (row j at x + j * rs): no fp32 tile; the rows' scales are
// folded into the weights pw (pw[r][j] = p[r][j] * scale_j, 0 for rows not visible)
inline nv sext_nw(const int8_t* x) {
#if defined(__AVX512F__)
  return __builtin_convertvector(sext16(x), vf);
#elif defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x))));
  nv r;
  std::memcpy(&r, &f, sizeof r);
  return r;
#else
  nv r;
  for (int i = 0; i < NW; ++i) r[i] = x[i];
  return r;
#endif
}
template <int RB>
void accumulate_int8(float* acc, int dvp, const int8_t* x, int64_t rs, int nt, const vf* pw, const float* alpha,
                     int rows_pad) {
  for (int e0 = 0; e0 < dvp; e0 += NW)
    for (int r0 = 0; r0 < rows_pad; r0 += RB) {
      nv a[RB];
      for (int i = 0; i < RB; ++i) a[i] = loadn(acc + static_cast<size_t>(r0 + i) * dvp + e0) * alpha[r0 + i];
      for (int j = 0; j < nt; ++j) {
        const nv vv = sext_nw(x + j * rs + e0);
        for (int i = 0; i < RB; ++i) a[i] += pw[r0 + i][j] * vv;
      }
      for (int i = 0; i < RB; ++i) storen(acc + static_cast<size_t>(r0 + i) * dvp + e0, a[i]);
    }
}

struct Math {
  void (*scores)(const float*, int, const float*, int, vf*);
  void (*accumulate)(float*, int, const float*, int, const vf*, const float*, int);
  void (*accumulate_int8)(float*, int, const int8_t*, int64_t, int, const vf*, const float*, int);
};
template <int RB>
constexpr Math math_of() { return {&scores<RB>, &accumulate<RB>, &accumulate_int8<RB>}; }
inline Math math_for(int rows_pad) {
  switch (rows_pad) {
    case 1: return math_of<1>();
    case 2: return math_of<2>();
    case 3: return math_of<3>();
    case 4: return math_of<4>();
    default: return math_of<8>();
  }
}

template <typename TQ>
void run(const Problem& pb, const std::vector<Item>& items) {
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    const int dp = pb.dp, dvp = pb.dvp;
    avec<float> qf(static_cast<size_t>(ROWS) * dp), acc(static_cast<size_t>(ROWS) * dvp);
    // K tile as 16x16 blocks kb[e / 16][t][e % 16] (dequantized), then transposed: kt[e * 16 + t]; V row-major
    std::vector<vf> kbv(dp, vf{});  // vector-aligned: transpose16_to reads it as vf rows
    float* kb = reinterpret_cast<float*>(kbv.data());
    avec<float> kt(static_cast<size_t>(dp) * BN, 0.f);
    avec<float> vt(static_cast<size_t>(BN) * dvp, 0.f);
    std::vector<vf> p(ROWS), pw(ROWS);
    float m[ROWS], alpha[ROWS];
    vf lv[ROWS];
    for (int64_t w = begin; w < end; ++w) {
      const Item& it = items[w];
      const int rows_pad = pad_rows(it.rows);
      const Math math = math_for(rows_pad);
      std::fill(qf.begin(), qf.begin() + static_cast<size_t>(rows_pad) * dp, 0.f);
      std::fill(acc.begin(), acc.begin() + static_cast<size_t>(rows_pad) * dvp, 0.f);
      for (int r = 0; r < rows_pad; ++r) { m[r] = NEG_INF; lv[r] = vf{}; p[r] = vf{}; alpha[r] = 1.f; }
      for (int r = 0; r < it.rows; ++r) {  // row r = query i * G + g
        const int row = it.r0 + r, i = row / pb.group, hq = it.h * pb.group + row % pb.group;
        const TQ* src = static_cast<const TQ*>(pb.q) + it.b * pb.sq[0] + i * pb.sq[1] + hq * pb.sq[2];
        float* dst = qf.data() + static_cast<size_t>(r) * dp;
        for (int e = 0; e < pb.d; ++e) dst[e] = static_cast<float>(src[e * pb.sq[3]]) * pb.scale;
      }
      for (size_t si = 0; si < pb.ks.size(); ++si) {
        const Seg& ks = pb.ks[si];
        const Seg& vs = pb.vs[si];
        for (int t0 = 0; t0 < ks.n; t0 += BN) {
          const int nt = std::min(BN, ks.n - t0);
          vf wv = splat(1.0f);  // row weights (row_counts); a tile with no visible row is skipped unread
          bool masked = nt < BN;
          if (ks.counts) {
            bool any = false;
            for (int j = 0; j < BN; ++j) {
              const int32_t c = j < nt ? ks.counts[t0 + j] : 0;
              wv[j] = static_cast<float>(c);
              any |= c > 0;
              masked |= c != 1;
            }
            if (!any) continue;
          }
          if (nt < BN)  // tokens past the segment's end: zeros (their scores are masked below)
            for (int e0 = 0; e0 < dp; e0 += BN)
              std::fill(kb + static_cast<size_t>(e0) * BN + nt * BN, kb + (e0 + BN) * BN, 0.f);
          ks.rows(it.b, it.h, t0, nt, kb, BN, BN * BN);
          for (int e0 = 0; e0 < dp; e0 += BN)
            transpose16_to(reinterpret_cast<const vf*>(kb + static_cast<size_t>(e0) * BN),
                           kt.data() + static_cast<size_t>(e0) * BN);
          math.scores(qf.data(), dp, kt.data(), rows_pad, p.data());
          vi lane;
          for (int c = 0; c < BN; ++c) lane[c] = c;
          const vi valid = ilt(lane, vi{} + nt) & vgt(wv, splat(0.0f));
          for (int r = 0; r < it.rows; ++r) {
            vf s = masked ? vsel(valid, p[r], splat(NEG_INF)) : p[r];
            if (any_nan(s)) {  // a visible row's NaN score: the query's result is NaN, as SDPA's (l stays NaN)
              lv[r] = splat(std::numeric_limits<float>::quiet_NaN());
              alpha[r] = 1.f;
              p[r] = vf{};
              continue;
            }
            const float mc = hmax(s);
            if (mc <= m[r]) {
              alpha[r] = 1.f;
            } else {
              alpha[r] = std::exp(m[r] - mc);  // 0 when m was -inf
              m[r] = mc;
            }
            p[r] = ks.counts ? vexp(s - m[r]) * wv : vexp(s - m[r]);
            lv[r] = lv[r] * alpha[r] + p[r];
          }
          if (vs.fast && vs.kind == INT8) {  // V from its codes, the row scales in the weights
            vf sv{};
            for (int j = 0; j < nt; ++j) {
              if (t0 + j + AHEAD < vs.n) vs.prefetch_row(it.b, it.h, t0 + j + AHEAD);
              if (wv[j] != 0.0f)
                sv[j] = h2f(vs.scales.p, it.b * vs.scales.st[0] + (t0 + j) * vs.scales.st[1] + it.h * vs.scales.st[2]);
            }
            for (int r = 0; r < rows_pad; ++r) pw[r] = p[r] * sv;
            const int8_t* x = static_cast<const int8_t*>(vs.codes.p) + it.b * vs.codes.st[0] +
                              static_cast<int64_t>(t0) * vs.codes.st[1] + it.h * vs.codes.st[2];
            math.accumulate_int8(acc.data(), dvp, x, vs.codes.st[1], nt, pw.data(), alpha, rows_pad);
            continue;
          }
          vs.rows(it.b, it.h, t0, nt, vt.data(), dvp, BN);  // V row-major: vt[j * dvp + e]
          if (ks.counts)  // a row not visible may hold anything (stale ring rows): never let it reach acc
            for (int j = 0; j < nt; ++j)
              if (wv[j] == 0.0f) std::fill(vt.begin() + static_cast<size_t>(j) * dvp, vt.begin() + (j + 1) * dvp, 0.f);
          math.accumulate(acc.data(), dvp, vt.data(), nt, p.data(), alpha, rows_pad);
        }
      }
      TQ* out = static_cast<TQ*>(pb.out);
      for (int r = 0; r < it.rows; ++r) {
        const int row = it.r0 + r, i = row / pb.group, hq = it.h * pb.group + row % pb.group;
        const float l = hsum(lv[r]);
        const float w = l > 0.f || l != l ? 1.f / l : 0.f;  // NaN: a visible row's NaN score (above)
        TQ* o = out + ((static_cast<int64_t>(it.b) * pb.tokens + i) * pb.num_heads + hq) * pb.d_v;
        for (int e = 0; e < pb.d_v; ++e) o[e] = static_cast<TQ>(acc[static_cast<size_t>(r) * dvp + e] * w);
        const int64_t at = (static_cast<int64_t>(it.b) * pb.num_heads + hq) * pb.tokens + i;
        pb.lse[at] = l > 0.f || l != l ? m[r] + std::log(l) : NEG_INF;
      }
    }
  });
}

// Metadata of every tensor the kernel addresses (kvops/_checks/packed.py checks it all first, with better messages):
// a direct call of this private op (torch.ops.kvops._packed_attention_native) gets these checks instead of a read out
// of bounds. Shapes follow kvops.packed.packed_layout; returns the total rows.
int64_t check_args(const at::Tensor& q, const std::vector<at::Tensor>& k_dense, const std::vector<at::Tensor>& v_dense,
                   const std::vector<at::Tensor>& k_packed, const std::vector<at::Tensor>& v_packed,
                   const std::string& quant, const std::optional<at::Tensor>& row_counts) {
  const char* op = "kvops::_packed_attention_native";
  TORCH_CHECK(q.dim() == 4 && q.device().is_cpu(), op, ": q must be a 4-D CPU tensor [B, T, H_q, D], got ",
              q.sizes());
  const auto qt = q.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16 || qt == at::kHalf, op, ": unsupported q dtype ", qt);
  const int64_t fields = quant == "int2" ? 5 : quant == "int4" ? 3 : 2;
  TORCH_CHECK(k_dense.size() == v_dense.size() && k_packed.size() == v_packed.size() &&
                  k_packed.size() % fields == 0 && (k_dense.size() + k_packed.size()) > 0,
              op, ": need as many K as V segments (dense and packed, ", fields, " tensors per ", quant,
              " segment) and at least one");
  TORCH_CHECK(k_packed.empty() || quant == "int8" || quant == "fp8" || quant == "int4" || quant == "int2", op,
              ": unknown quant ", quant);
  const at::Tensor& k0 = !k_dense.empty() ? k_dense[0] : k_packed[0];
  TORCH_CHECK(k0.dim() >= 3, op, ": segment tensors are [B, n, H_kv, ...], got ", k0.sizes());
  const int64_t batch = q.size(0), hkv = k0.size(2), d = q.size(3);
  TORCH_CHECK(hkv >= 1 && d >= 1 && q.size(2) % hkv == 0, op, ": num_heads (", q.size(2),
              ") must be a multiple of num_kv_heads (", hkv, ") >= 1, and head_dim (", d, ") >= 1");
  int64_t d_v = -1, rows = 0;
  auto need = [&](const at::Tensor& t, at::ScalarType dtype, std::vector<int64_t> shape) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.sizes() == at::IntArrayRef(shape), op,
                ": a segment tensor of shape ", t.sizes(), " and dtype ", t.scalar_type(), " should be ",
                at::IntArrayRef(shape), " ", dtype, " on the CPU");
  };
  for (int side = 0; side < 2; ++side) {
    const auto& dense = side ? v_dense : k_dense;
    const auto& packed = side ? v_packed : k_packed;
    for (size_t i = 0; i < dense.size(); ++i) {
      const at::Tensor& x = dense[i];
      TORCH_CHECK(x.dim() == 4, op, ": dense segments are [B, n, H_kv, D], got ", x.sizes());
      const auto xt = x.scalar_type();
      TORCH_CHECK(xt == at::kFloat || xt == at::kBFloat16 || xt == at::kHalf, op, ": dense segment dtype ", xt);
      const int64_t dim = side ? (d_v < 0 ? x.size(3) : d_v) : d;
      need(x, xt, {batch, side ? k_dense[i].size(1) : x.size(1), hkv, dim});
      if (side) d_v = dim; else rows += x.size(1);
    }
    for (size_t i = 0; i < packed.size(); i += fields) {
      const at::Tensor& codes = packed[i];
      TORCH_CHECK(codes.dim() == (quant == "int2" ? 5 : 4), op, ": packed codes of shape ", codes.sizes());
      const int64_t n = side ? k_packed[i].size(1) : codes.size(1);
      if (!side) rows += n;
      if (quant == "int8" || quant == "fp8") {
        const int64_t dim = side ? (d_v < 0 ? codes.size(3) : d_v) : d;
        if (side) d_v = dim;
        need(codes, quant == "int8" ? at::kChar : at::kFloat8_e4m3fn, {batch, n, hkv, dim});
        if (quant == "int8") need(packed[i + 1], at::kHalf, {batch, n, hkv});
        else need(packed[i + 1], at::kFloat, {batch, hkv});
      } else {
        const int64_t per = quant == "int4" ? 2 : 4, last = codes.size(codes.dim() - 1) * per;
        const int64_t dim = side ? (d_v < 0 ? last : d_v) : d;
        if (side) d_v = dim;
        const at::Tensor& sc = packed[i + 1];
        const int64_t groups = sc.dim() >= 1 ? sc.size(sc.dim() - 1) : 0;
        TORCH_CHECK(groups >= 1 && dim % groups == 0 && (dim / groups) % per == 0, op, ": scales ", sc.sizes(),
                    " do not split head_dim ", dim, " into groups");
        if (quant == "int4") {
          need(codes, at::kByte, {batch, n, hkv, dim / 2});
          need(sc, at::kHalf, {batch, n, hkv, groups});
          need(packed[i + 2], at::kChar, {batch, n, hkv, groups});
        } else {
          const int64_t stages = codes.size(3);
          need(codes, at::kByte, {batch, n, hkv, stages, dim / 4});
          need(sc, at::kHalf, {batch, n, hkv, stages, groups});
          need(packed[i + 2], at::kChar, {batch, n, hkv, stages, groups});
          const at::Tensor& cent = packed[i + 3];
          TORCH_CHECK(cent.dim() == 4 && cent.size(2) >= 1, op, ": centroids [B, H_kv, C, D] with C >= 1, got ",
                      cent.sizes());
          need(cent, at::kHalf, {batch, hkv, cent.size(2), dim});
          need(packed[i + 4], at::kByte, {batch, n, hkv});
        }
      }
    }
  }
  TORCH_CHECK(d_v >= 1, op, ": the value head_dim must be >= 1");
  if (row_counts.has_value())
    TORCH_CHECK(row_counts->scalar_type() == at::kInt && row_counts->dim() == 1 && row_counts->is_contiguous() &&
                    row_counts->device().is_cpu() && row_counts->size(0) == rows,
                op, ": row_counts must be a contiguous int32 CPU tensor [", rows, "], got ", row_counts->sizes());
  return rows;
}

std::tuple<at::Tensor, at::Tensor> packed_attention_native(
    const at::Tensor& q, const std::vector<at::Tensor>& k_dense, const std::vector<at::Tensor>& v_dense,
    const std::vector<at::Tensor>& k_packed, const std::vector<at::Tensor>& v_packed, const std::string& quant,
    double scale, const std::optional<at::Tensor>& row_counts) {
  check_args(q, k_dense, v_dense, k_packed, v_packed, quant, row_counts);
  Problem pb{};
  pb.batch = static_cast<int>(q.size(0));
  pb.tokens = static_cast<int>(q.size(1));
  pb.num_heads = static_cast<int>(q.size(2));
  pb.d = static_cast<int>(q.size(3));
  for (size_t i = 0; i < k_dense.size(); ++i) {
    pb.ks.push_back(dense_seg(k_dense[i]));
    pb.vs.push_back(dense_seg(v_dense[i]));
  }
  const size_t fields = quant == "int2" ? 5 : quant == "int4" ? 3 : 2;
  for (size_t i = 0; i < k_packed.size(); i += fields) {
    pb.ks.push_back(packed_seg(quant, k_packed, i));
    pb.vs.push_back(packed_seg(quant, v_packed, i));
  }
  if (row_counts.has_value()) {  // contiguous int32 [total rows], dense segments first (checked by the caller)
    const int32_t* c = row_counts->data_ptr<int32_t>();
    for (auto& seg : pb.ks) { seg.counts = c; c += seg.n; }
  }
  const at::Tensor& k0 = !k_dense.empty() ? k_dense[0] : k_packed[0];
  pb.num_kv_heads = static_cast<int>(k0.size(2));
  pb.d_v = pb.vs[0].d;
  at::Tensor out = at::zeros({q.size(0), q.size(1), q.size(2), pb.d_v}, q.options());
  at::Tensor lse = at::full({q.size(0), q.size(2), q.size(1)}, NEG_INF, q.options().dtype(at::kFloat));
  if (q.numel() == 0) return {out, lse};
  pb.q = q.data_ptr();
  for (int i = 0; i < 4; ++i) pb.sq[i] = q.stride(i);
  pb.group = pb.num_heads / pb.num_kv_heads;
  pb.dp = round_up(pb.d, BN);
  pb.dvp = round_up(pb.d_v, BN);
  pb.scale = static_cast<float>(scale);
  pb.out = out.data_ptr();
  pb.lse = lse.data_ptr<float>();
  std::vector<Item> items;
  const int rows = pb.tokens * pb.group;
  for (int b = 0; b < pb.batch; ++b)
    for (int h = 0; h < pb.num_kv_heads; ++h)
      for (int r0 = 0; r0 < rows; r0 += ROWS) items.push_back({b, h, r0, std::min(ROWS, rows - r0)});
  switch (q.scalar_type()) {
    case at::kFloat: run<float>(pb, items); break;
    case at::kBFloat16: run<c10::BFloat16>(pb, items); break;
    case at::kHalf: run<c10::Half>(pb, items); break;
    default: TORCH_CHECK(false, "kvops::_packed_attention_native: unsupported q dtype ", q.scalar_type());
  }
  return {out, lse};
}

}  // namespace
}  // namespace kvops_packed_native

// The schema of kvops::_packed_attention_native is in kvops/_library.py (defined at import); this file registers its CPU kernel.
TORCH_LIBRARY_IMPL(kvops, CPU, m) { m.impl("_packed_attention_native", &kvops_packed_native::packed_attention_native); }
