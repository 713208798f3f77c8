"""StreamingLLM on a paged cache (docs/attention_features.md): ``PagedKVCache(window_left=63, sink_tokens=4)`` with
block_size 16 frees the blocks wholly between the sinks and the window, and ``paged_attention`` sees exactly the
tokens {0..3} and [ctx - 64, ctx) — for context lengths that are and are not multiples of block_size, and over a
long decode loop with bounded memory; with RoPE at read time the kept keys take contiguous positions (StreamingLLM's
own cache positions: sinks 0..3, window keys 4..67, the query at 67)."""

from __future__ import annotations

import math
import unittest

import torch

import kvops
from kvops._checks.features import AttnFeatures
from kvops.cache.paged import OutOfBlocksError
from kvops.cpu.paged_attention import paged_attention as composite

SINKS, WINDOW, BS, H_Q, H_KV, D = 4, 64, 16, 4, 2, 16


def rope(x, position, theta=1e4):
    i = torch.arange(D // 2, dtype=torch.float64)
    ang = position * theta ** (-2.0 * i / D)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat((x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()), dim=-1)


def streaming_reference(q, keys, values, ctx, use_rope):
    """fp64 attention of the query of token ``ctx - 1`` over tokens {0..3} and [ctx - 64, ctx); with RoPE each kept
    key takes its index among the kept keys as position (StreamingLLM), the query the last one."""
    kept = sorted(set(range(min(SINKS, ctx))) | set(range(max(0, ctx - WINDOW), ctx)))
    out = torch.zeros(H_Q, D, dtype=torch.float64)
    for h in range(H_Q):
        hk = h // (H_Q // H_KV)
        qh = q[h].double() * D ** -0.5
        k = torch.stack([keys[j, hk].double() for j in kept])
        if use_rope:
            qh = rope(qh, len(kept) - 1)
            k = torch.stack([rope(k[n], n) for n in range(len(kept))])
        p = torch.softmax(k @ qh, 0)
        out[h] = p @ torch.stack([values[j, hk].double() for j in kept])
    return out


class TestStreamingPaged(unittest.TestCase):
    def make(self, num_blocks=12):
        cache = kvops.PagedKVCache(num_blocks, BS, H_KV, D, window_left=WINDOW - 1, sink_tokens=SINKS)
        cache.add_sequence(0)
        return cache

    def step(self, cache, keys, values, queries, start, n, use_rope):
        step = cache.prepare({0: n})
        cache.write(0, keys[start:start + n], values[start:start + n], step)
        kw = {"rope_theta": 1e4} if use_rope else {}
        return step, cache.attention(0, queries[start:start + n], step, **kw)

    def test_context_lengths(self):
        """Prefill ctx - 1 tokens, decode token ctx - 1: evicted entries are -1, the window's first block is kept."""
        g = torch.Generator().manual_seed(0)
        keys, values, queries = (torch.randn(200, h, D, generator=g) for h in (H_KV, H_KV, H_Q))
        for ctx in (100, 111, 112, 113):
            for use_rope in (False, True):
                with self.subTest(ctx=ctx, rope=use_rope):
                    cache = self.make()
                    self.step(cache, keys, values, queries, 0, ctx - 1, use_rope)
                    step, out = self.step(cache, keys, values, queries, ctx - 1, 1, use_rope)
                    torch.testing.assert_close(out[0].double(), streaming_reference(queries[ctx - 1], keys, values,
                                                                                    ctx, use_rope),
                                               atol=2e-5, rtol=0)
                    table = step.block_table[0].tolist()
                    first_window_block = (ctx - WINDOW) // BS
                    self.assertEqual(table[1:first_window_block], [-1] * (first_window_block - 1))
                    self.assertTrue(all(b >= 0 for b in [table[0]] + table[first_window_block:]))
                    # the composite (no native kernel) never gathers the evicted entries either
                    fixed = dict(scale=D ** -0.5, causal=True, window_left=WINDOW - 1, softcap=0.0)
                    out_c, _ = composite(queries[ctx - 1:ctx], cache.k_caches[0], cache.v_caches[0],
                                         step.cu_seqlens_q, step.seq_lens, step.block_table, 1, *fixed.values(), None,
                                         None, None, AttnFeatures(sink_tokens=SINKS,
                                                                  rope_theta=1e4 if use_rope else None))
                    torch.testing.assert_close(out_c, out, atol=2e-5, rtol=0)

    def test_long_decode_loop_bounded_memory(self):
        """20-token prompt, then 400 decode steps: every step matches the reference; held blocks stay bounded."""
        g = torch.Generator().manual_seed(1)
        n = 420
        keys, values, queries = (torch.randn(n, h, D, generator=g) for h in (H_KV, H_KV, H_Q))
        cache = self.make(num_blocks=8)  # 8 blocks = 128 tokens of memory for a 420-token stream
        bound = math.ceil(SINKS / BS) + math.ceil(WINDOW / BS) + 1
        self.step(cache, keys, values, queries, 0, 20, True)
        worst = 0
        for ctx in range(21, n + 1):
            _, out = self.step(cache, keys, values, queries, ctx - 1, 1, True)
            worst = max(worst, cache.num_blocks - cache.num_free_blocks)
            if ctx % 7 == 0 or ctx > n - 3:
                torch.testing.assert_close(out[0].double(), streaming_reference(queries[ctx - 1], keys, values, ctx,
                                                                                True), atol=2e-5, rtol=0)
        self.assertLessEqual(worst, bound)
        self.assertEqual(cache.seq_len(0), n)

    def test_eviction_is_atomic_and_fork_skips_evicted(self):
        cache = self.make(num_blocks=12)
        k = torch.randn(150, H_KV, D)
        step = cache.prepare({0: 150})
        cache.write(0, k, k, step)
        cache.prepare({0: 1})  # evicts blocks [1, (150 - 63) // 16) = [1, 5)
        self.assertEqual(cache.block_ids(0)[1:5], [-1] * 4)
        before = (cache.block_ids(0), cache.num_free_blocks)
        with self.assertRaises(OutOfBlocksError):
            cache.prepare({0: 400})
        self.assertEqual((cache.block_ids(0), cache.num_free_blocks), before)
        cache.fork(0, 1, 144)
        cache.free(0)
        cache.free(1)
        self.assertEqual(cache.num_free_blocks, 12)


if __name__ == "__main__":
    unittest.main()
