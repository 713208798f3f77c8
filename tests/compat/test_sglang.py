"""sglang's causal caches and disaggregation planner through kvops' API.

- The planner: the cases of sglang's ``test_staging_buffer`` unit tests for ``compute_head_slice_params`` (gather
  (4, 2, 8), scatter (2, 4, 8), GQA replication (1, 4, 2), equal TP, the count contract, and
  ``test_rank_is_taken_modulo_the_tp_group``) through ``kvops.transfer`` (sglang's per-pair function is kvops'
  ``routes_for_writer``/``compute_head_slice_params`` pair; docs/transfer.md).
- The dense causal cache: ``CausalKVCache(window_mode="tail")`` against a plain model of sglang's
  ``CausalSelfAttentionKVCache.update_and_get_attention_kv`` written here from its documented behaviour (append,
  evict after the sink, rewrite of chunks still in the cache, growth, the tail window ``max(0, L - W)``), over seeded
  streams of chunk appends and denoising rewrites; called as sglang's call sites do (keyword arguments,
  ``debug_name``), with sglang's ``attention_window_size=0`` meaning the cache size.
- The QVG packed cache's argument forms (``PackedCausalKVCache``, modelled on sglang's ``QVGPackedCausalKVCache``):
  keyword calls with ``cache_head_start``, ``recent_window_tokens`` and ``debug_name``, ``attention_window_size`` 0.
"""

from __future__ import annotations

import random
import unittest

import torch

import kvops
from kvops.packed import PackedCausalKVCache
from kvops.transfer import HeadSlice, compute_head_slice_params, routes_for_writer


class TestHeadSliceParams(unittest.TestCase):
    def test_gather_each_prefill_rank_sends_its_own_two_heads(self):  # (src 4, dst 2, H 8)
        sends = [routes_for_writer(4, 2, r, 8) for r in range(4)]
        for r, pairs in enumerate(sends):
            ((decode, s),) = pairs
            self.assertEqual((decode, s.writer, s.src_head_start, s.num_heads), (r // 2, r, 0, 2))
        self.assertEqual([p[0][1].cache_head_start for p in sends], [0, 2, 0, 2])  # tiling the decode head range

    def test_rank_is_taken_modulo_the_tp_group(self):
        for r in range(4):
            self.assertEqual(routes_for_writer(4, 2, r + 4, 8), routes_for_writer(4, 2, r, 8))
        for d in range(2):
            self.assertEqual(compute_head_slice_params(4, 2, d + 2, 8), compute_head_slice_params(4, 2, d, 8))

    def test_scatter_each_decode_rank_takes_two_heads_at_its_own_base(self):  # (2, 4, 8)
        slices = [compute_head_slice_params(2, 4, d, 8) for d in range(4)]
        for (s,) in slices:
            self.assertEqual((s.num_heads, s.cache_head_start), (2, 0))
        self.assertEqual([s.src_head_start for (s,) in slices], [0, 2, 0, 2])  # walking the prefill head range

    def test_gqa_replication_consecutive_decode_ranks_share_a_head(self):  # (1, 4, 2)
        slices = [compute_head_slice_params(1, 4, d, 2) for d in range(4)]
        self.assertEqual([s.src_head_start for (s,) in slices], [0, 0, 1, 1])  # not the modulo map 0, 1, 0, 1
        for (s,) in slices:
            self.assertEqual((s.num_heads, s.cache_head_start), (1, 0))

    def test_equal_tp_copies_the_whole_rank_slice(self):
        for r in range(4):
            self.assertEqual(compute_head_slice_params(4, 4, r, 8), (HeadSlice(r, 0, 2, 0),))

    def test_counts(self):
        for p_tp, d_tp, heads in ((4, 2, 8), (2, 4, 8), (1, 4, 2), (8, 8, 8)):
            for s in compute_head_slice_params(p_tp, d_tp, 1, heads):
                self.assertEqual(s.num_heads, min(max(1, heads // p_tp), max(1, heads // d_tp)))


class SglangDenseModel:
    """sglang's dense causal cache, as its docstrings and code comments describe it (rows are Python lists)."""

    def __init__(self, k, v, sink_tokens, attention_window_size, allow_growth):
        self.k, self.v = k.clone(), v.clone()
        self.size = k.shape[1]
        self.sink, self.growth = sink_tokens, allow_growth
        self.window = attention_window_size or self.size  # 0: the cache size
        self.g = self.l = 0

    def update(self, key, value, s):
        n, e = key.shape[1], s + key.shape[1]
        if e <= self.g:  # a rewrite: the chunk's rows, cursors unchanged
            ls = s - (self.g - self.l)
            new_l, new_g = self.l, self.g
        else:
            added = e - self.g
            if self.growth and self.l + added > self.size:
                grown = max(self.l + added, 2 * self.size)
                pad = grown - self.size
                self.k = torch.cat([self.k, self.k.new_zeros(self.k.shape[0], pad, *self.k.shape[2:])], dim=1)
                self.v = torch.cat([self.v, self.v.new_zeros(self.v.shape[0], pad, *self.v.shape[2:])], dim=1)
                self.window = grown if self.window == self.size else self.window
                self.size = grown
            if self.l + added > self.size:  # evict the oldest rows after the sink, move the rest down
                evicted = self.l + added - self.size
                kept = max(0, self.l - evicted - self.sink)
                src = slice(self.sink + evicted, self.sink + evicted + kept)
                dst = slice(self.sink, self.sink + kept)
                self.k[:, dst], self.v[:, dst] = self.k[:, src].clone(), self.v[:, src].clone()
                le = self.size
            else:
                le = self.l + added
            ls, new_l, new_g = le - n, le, e
        assert 0 <= ls and ls + n <= self.size
        self.k[:, ls:ls + n], self.v[:, ls:ls + n] = key, value
        self.g, self.l = new_g, new_l
        start = max(0, new_l - self.window)
        return self.k[:, start:new_l], self.v[:, start:new_l], ls, ls + n, new_l, new_g


class TestCausalSelfAttentionKVCache(unittest.TestCase):
    def test_streams_match_sglangs_cache(self):
        grid = [(size, sink, window, growth) for size in (8, 12) for sink in (0, 2) for window in (0, 5, 8)
                for growth in (False, True)]
        for seed, (size, sink, window, growth) in enumerate(grid):
            with self.subTest(size=size, sink=sink, window=window, growth=growth):
                rng = random.Random(seed)
                k0, v0 = torch.randn(1, size, 2, 4), torch.randn(1, size, 2, 4)
                model = SglangDenseModel(k0, v0, sink, window, growth)
                cache = kvops.CausalKVCache(k0.clone(), v0.clone(), sink_tokens=sink, attention_window_size=window,
                                            allow_growth=growth, window_mode="tail")
                g = 0
                for chunk in range(8):
                    n = rng.randint(1, 3)
                    for step in range(rng.randint(1, 3)):  # an append, then denoising rewrites of the chunk
                        key, value = torch.randn(1, n, 2, 4), torch.randn(1, n, 2, 4)
                        got = cache.update_and_get_attention_kv(key=key, value=value, current_chunk_start=g,
                                                                debug_name="LingBot KV cache")
                        want = model.update(key, value, g)
                        self.assertTrue(torch.equal(got.k, want[0]) and torch.equal(got.v, want[1]), (chunk, step))
                        self.assertEqual((got.local_start_index, got.local_end_index, got.visible_local_end,
                                          got.visible_global_end), want[2:])
                    g += n

    def test_debug_name_names_the_cache_in_errors(self):
        cache = kvops.CausalKVCache(torch.zeros(1, 4, 1, 2), torch.zeros(1, 4, 1, 2))
        chunk = torch.ones(1, 2, 1, 2)
        cache.update_and_get_attention_kv(key=chunk, value=chunk, current_chunk_start=0)
        with self.assertRaisesRegex(RuntimeError, r"^Invalid LingBot KV cache write range: local="):
            cache.update_and_get_attention_kv(key=chunk, value=chunk, current_chunk_start=5,
                                              debug_name="LingBot KV cache")
        ring = kvops.cache.RingCausalKVCache(torch.zeros(1, 4, 1, 2), torch.zeros(1, 4, 1, 2))
        with self.assertRaisesRegex(RuntimeError, r"^Invalid ring cache write range"):
            ring.update_and_get_attention_kv(key=chunk, value=chunk, current_chunk_start=3, debug_name="ring cache")


class TestQVGPackedCacheForms(unittest.TestCase):
    def test_keyword_calls_and_default_window(self):
        cache = PackedCausalKVCache(batch_size=1, cache_size=8, num_kv_heads=2, head_dim=4, chunk_tokens=2,
                                    quant="int8", sink_tokens=2, attention_window_size=0, dtype=torch.float32)
        self.assertEqual(cache.attention_window_size, 8)  # sglang's QVG: attention_window_size or cache_size
        for s in (0, 2, 4):
            chunk = torch.randn(1, 2, 1, 4)
            view = cache.update_and_get_attention_kv(key=chunk, value=chunk, current_chunk_start=s,
                                                     cache_head_start=1, recent_window_tokens=None,
                                                     debug_name="QVG packed KV cache")
            self.assertEqual(view.visible_global_end, s + 2)
        with self.assertRaisesRegex(NotImplementedError, r"^QVG packed KV cache: non-sequential write"):
            cache.update_and_get_attention_kv(key=chunk, value=chunk, current_chunk_start=9, cache_head_start=1,
                                              debug_name="QVG packed KV cache")


if __name__ == "__main__":
    unittest.main()
