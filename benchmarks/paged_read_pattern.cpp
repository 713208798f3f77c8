// How fast one thread can read a paged K/V cache in the orders a decode kernel may take, with no attention math: the
// ceiling under benchmarks/paged_decode.py's bandwidth target (docs/native-kernel.md, "Reading order"). The cache is
// NHD bf16 [num_blocks][16][H][D] for K and for V, its blocks in random order (as a block table scatters them), read
// in chunks of 32 tokens (2 blocks):
//   0 head-major: per KV head, the 32 tokens' rows of that head (D * 2 bytes at a stride of H * D * 2), K and V, as
//     kvops' register kernel reads them; no software prefetch
//   1 the same with the kernel's prefetch: the next (chunk, head) unit's lines, one per 64 bytes read, prefetcht1
//     (into L2, as kvops/native/vec.h's prefetch_line)
//   2 mode 1 with prefetcht0 (into L1: the kernel's instruction before; slower on AMD Zen 4)
//   3 head-major, prefetching the next chunk's blocks whole, in address order (prefetcht0)
//   4 block-major: each block of K and of V read whole, in address order
//   5 token-major: each token's row of all heads (H * D * 2 contiguous bytes), K then V
// and, for reference, 9: one sequential read of the same bytes. Prints the best of 7 passes (64 MiB written between
// passes, so each pass reads from memory when the cache exceeds the last-level cache) in GB/s of K/V read, and in
// parentheses a lane of the sum of what was read (printed so that the compiler keeps the reads; meaningless).
// Another mode number is refused (exit status 2).
//   g++ -O2 -march=native -o /tmp/paged_read_pattern benchmarks/paged_read_pattern.cpp
//   for m in 9 0 1 2 3 4 5; do /tmp/paged_read_pattern 8 128 8 4096 $m; done   # Llama-3.1-8B heads, B 8, ctx 4096
// x86-64 with AVX-512 (the reads are 64-byte zmm loads); one thread.
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

static inline void prefetch_l1(const char* p) { asm volatile("prefetcht0 %0" : : "m"(*p)); }
static inline void prefetch_l2(const char* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); }

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s H_kv head_dim batch context mode (0 1 2 3 4 5 9)\n", argv[0]);
    return 2;
  }
  const int H = std::atoi(argv[1]), D = std::atoi(argv[2]), B = std::atoi(argv[3]), ctx = std::atoi(argv[4]);
  const int mode = std::atoi(argv[5]);
  if (mode < 0 || mode > 9 || mode == 6 || mode == 7 || mode == 8) {
    std::fprintf(stderr, "mode %s: not one of 0 1 2 3 4 5 9 (the header says what each reads)\n", argv[5]);
    return 2;
  }
  const int BS = 16, bpseq = ctx / BS, nb = B * bpseq, nchunks = bpseq / 2, hb = D * 2;
  const size_t row = static_cast<size_t>(H) * hb, blk = BS * row;
  char* K = static_cast<char*>(std::aligned_alloc(4096, nb * blk));
  char* V = static_cast<char*>(std::aligned_alloc(4096, nb * blk));
  std::memset(K, 1, nb * blk);
  std::memset(V, 1, nb * blk);
  std::vector<int> table(nb);
  for (int i = 0; i < nb; ++i) table[i] = i;
  std::shuffle(table.begin(), table.end(), std::mt19937(1));
  std::vector<char> flush(64 << 20);
  __m512 acc = _mm512_setzero_ps();
  auto read = [&acc](const char* p) { acc = _mm512_add_ps(acc, _mm512_loadu_ps(reinterpret_cast<const float*>(p))); };
  double best = 1e30;
  for (int pass = 0; pass < 7; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    if (mode == 9) {
      for (size_t e = 0; e < nb * blk; e += 64) {
        read(K + e);
        read(V + e);
      }
    }
    for (int b = 0; mode != 9 && b < B; ++b) {
      const int* tb = table.data() + static_cast<size_t>(b) * bpseq;
      for (int c = 0; c < nchunks; ++c) {
        if (mode == 4 || mode == 5) {
          for (int k = 0; k < 2; ++k) {
            const char* kb = K + tb[2 * c + k] * blk;
            const char* vb = V + tb[2 * c + k] * blk;
            if (mode == 4) {  // K's block, then V's
              for (size_t e = 0; e < blk; e += 64) read(kb + e);
              for (size_t e = 0; e < blk; e += 64) read(vb + e);
            } else {  // token by token: K's row, then V's
              for (size_t r = 0; r < blk; r += row) {
                for (size_t e = 0; e < row; e += 64) read(kb + r + e);
                for (size_t e = 0; e < row; e += 64) read(vb + r + e);
              }
            }
          }
          continue;
        }
        for (int h = 0; h < H; ++h) {
          const int nc = c + (h + 1) / H, nh = (h + 1) % H;  // mode 1: the next unit
          const int lines = 32 * 2 * (hb / 64);
          size_t pl = 0;
          for (int t = 0; t < 32; ++t) {
            const char* kr = K + tb[2 * c + t / 16] * blk + (t % 16) * row + h * hb;
            const char* vr = V + tb[2 * c + t / 16] * blk + (t % 16) * row + h * hb;
            for (int e = 0; e < hb; e += 64) {
              read(kr + e);
              read(vr + e);
              for (int k = 0; k < 2; ++k, ++pl) {
                if ((mode == 1 || mode == 2) && nc < nchunks && pl < static_cast<size_t>(lines)) {
                  const int tt = pl / (2 * (hb / 64)), w = pl % (2 * (hb / 64));
                  const char* line =
                      (w & 1 ? V : K) + tb[2 * nc + tt / 16] * blk + (tt % 16) * row + nh * hb + (w >> 1) * 64;
                  if (mode == 1)
                    prefetch_l2(line);
                  else
                    prefetch_l1(line);
                }
                if (mode == 3 && c + 1 < nchunks) {  // this head's share of the next chunk's 4 regions, in order
                  const size_t per = 4 * blk / 64 / H, li = h * per + pl;
                  if (pl >= per) continue;
                  const size_t region = li / (blk / 64), off = (li % (blk / 64)) * 64;
                  prefetch_l1((region & 2 ? V : K) + tb[2 * (c + 1) + (region & 1)] * blk + off);
                }
              }
            }
          }
        }
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s);
    std::memset(flush.data(), pass, flush.size());
  }
  float sink[16];
  _mm512_storeu_ps(sink, acc);
  std::printf("H_kv %d head_dim %d B %d ctx %d mode %d: %.2f ms, %.1f GB/s (%.0g)\n", H, D, B, ctx, mode, best * 1e3,
              2.0 * nb * blk / best / 1e9, sink[0]);
  return 0;
}
