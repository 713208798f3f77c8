"""The ops without ``kv_layout`` (``flash_attn_with_kvcache``, ``rotary_paged_cache_write``, ``paged_kv_gather`` /
``paged_kv_scatter``) and ``PagedKVCache``: NHD caches only (README "kv_layout").

- An HND cache ``[P, H_kv, block_size, D]`` whose misread head count contradicts the call but whose ``block_size`` dim
  fits gets the layout hint of ``kvops._checks.paged_write.layout_hint``, saying the op takes NHD only and how to get
  an NHD view (eager, compile, export).
- ``PagedKVCache`` allocates its NHD caches itself: a wrong head count names ``num_kv_heads``, with no layout hint.
- The ambiguous ``H_kv == block_size``: shapes cannot tell the layouts apart, so no hint is possible; the documented
  fix, the NHD view ``cache.transpose(1, 2)``, gives the NHD results (checked against an NHD copy) and writes the
  HND storage in place.
"""

from __future__ import annotations

import expecttest
import torch

import kvops
from kvops.ops.transfer import staging_shape
from tests.contract import raises_everywhere

PY_ERROR = torch._dynamo.exc.Unsupported  # flash_attn_with_kvcache / PagedKVCache: Python checks Dynamo traces


def hnd(num_blocks, heads, block_size, head_dim, seed=0):
    """A random HND cache ``[P, H_kv, block_size, D]`` (synthetic K/V: standard normal)."""
    return torch.randn(num_blocks, heads, block_size, head_dim, generator=torch.Generator().manual_seed(seed))


class TestLayoutHint(expecttest.TestCase):
    def test_flash_attn_with_kvcache(self):
        f = kvops.flash_attn_with_kvcache
        kc, vc = hnd(4, 2, 8, 16), hnd(4, 2, 8, 16, 1)  # read as NHD: block_size 2, 8 KV heads
        table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
        msg = raises_everywhere(self, ValueError, lambda q, kc, vc, bt: f(q, kc, vc, cache_seqlens=1, block_table=bt),
                                (torch.randn(2, 1, 4, 16), kc, vc, table), compile_exc=PY_ERROR)
        self.assertExpectedInline(msg, """flash_attn_with_kvcache: num_heads (4) must be a multiple of num_kv_heads (8) (GQA); got q shape (2, 1, 4, 16) and k_cache shape (4, 2, 8, 16). The cache of shape (4, 2, 8, 16) read as kv_layout="NHD" has 8 heads, but its dim of size 2 fits the 4 query heads: it may be an HND cache [num_blocks, num_kv_heads, block_size, head_dim]; if so, flash_attn_with_kvcache takes NHD caches only: pass its NHD view cache.transpose(1, 2) (no copy), or use kvops.paged_cache_write / kvops.paged_attention with kv_layout="HND".""")  # noqa: B950
        k = torch.randn(2, 1, 2, 16)
        msg = raises_everywhere(
            self, ValueError, lambda q, kc, vc, k, bt: f(q, kc, vc, k, k, cache_seqlens=1, block_table=bt),
            (torch.randn(2, 1, 8, 16), kc, vc, k, table), compile_exc=PY_ERROR)
        self.assertExpectedInline(msg, """flash_attn_with_kvcache: k must be [batch=2, seqlen_new, num_kv_heads=8, head_dim=16] (k and v with the same seqlen_new), got shape (2, 1, 2, 16). The cache of shape (4, 2, 8, 16) read as kv_layout="NHD" has 8 heads, but its dim of size 2 fits the 2 heads of k: it may be an HND cache [num_blocks, num_kv_heads, block_size, head_dim]; if so, flash_attn_with_kvcache takes NHD caches only: pass its NHD view cache.transpose(1, 2) (no copy), or use kvops.paged_cache_write / kvops.paged_attention with kv_layout="HND".""")  # noqa: B950

    def test_rotary_paged_cache_write(self):
        """Before: the hint said ``pass kv_layout="HND"``, an argument this op does not take."""
        kc, vc = hnd(2, 2, 4, 16), hnd(2, 2, 4, 16, 1)
        key = torch.randn(3, 2, 16)
        cos, sin = torch.randn(8, 8), torch.randn(8, 8)
        pos = slots = torch.tensor([0, 1, 2])
        msg = raises_everywhere(self, ValueError, lambda *a: kvops.rotary_paged_cache_write(*a),
                                (key, key, kc, vc, slots, pos, cos, sin))
        self.assertExpectedInline(msg, """kvops.rotary_paged_cache_write requires cache_head_start when cache heads (4) differ from input heads (2). If the model has 2 KV heads, allocate the cache with 2 KV heads (num_kv_heads=2). A head slice is for several writers filling one cache (tensor-parallel writers): then pass cache_head_start (0 <= cache_head_start <= 2) to write the input heads as heads [cache_head_start, cache_head_start + 2), and have the other writers fill the other heads before attention. Or pass key/value with all 4 heads. The cache of shape (2, 2, 4, 16) read as kv_layout="NHD" has 4 heads, but its dim of size 2 fits the 2 input heads: it may be an HND cache [num_blocks, num_kv_heads, block_size, head_dim]; if so, kvops.rotary_paged_cache_write takes NHD caches only: pass its NHD view cache.transpose(1, 2) (no copy), or use kvops.paged_cache_write / kvops.paged_attention with kv_layout="HND".""")  # noqa: B950

    def test_transfer(self):
        ks, vs = [hnd(6, 4, 2, 8)], [hnd(6, 4, 2, 8, 1)]  # read as NHD: block_size 4, 2 KV heads
        table, staging = torch.tensor([3, 1], dtype=torch.int32), torch.empty(staging_shape(1, 3, 4, 8))
        msg = raises_everywhere(self, ValueError, lambda k, v, t, s: kvops.paged_kv_gather(k, v, t, s),
                                (ks, vs, table, staging))
        self.assertExpectedInline(msg, """kvops.paged_kv_gather: head slice [0, 4) is outside the caches' heads [0, 2). Pass staging with at most 2 heads (it carries 4). The cache of shape (6, 4, 2, 8) read as kv_layout="NHD" has 2 heads, but its dim of size 4 fits the 4 staged heads from cache_head_start=0: it may be an HND cache [num_blocks, num_kv_heads, block_size, head_dim]; if so, kvops.paged_kv_gather takes NHD caches only: pass its NHD view cache.transpose(1, 2) (no copy), or use kvops.paged_cache_write / kvops.paged_attention with kv_layout="HND".""")  # noqa: B950
        msg = raises_everywhere(self, ValueError, lambda s, k, v, t: kvops.paged_kv_scatter(s, k, v, t, 0, 1),
                                (torch.empty(staging_shape(1, 3, 2, 8)), ks, vs, table))
        self.assertExpectedInline(msg, """kvops.paged_kv_scatter: head slice [1, 3) is outside the caches' heads [0, 2). Pass 0 <= cache_head_start <= 0 for 2 staged heads. The cache of shape (6, 4, 2, 8) read as kv_layout="NHD" has 2 heads, but its dim of size 4 fits the 2 staged heads from cache_head_start=1: it may be an HND cache [num_blocks, num_kv_heads, block_size, head_dim]; if so, kvops.paged_kv_scatter takes NHD caches only: pass its NHD view cache.transpose(1, 2) (no copy), or use kvops.paged_cache_write / kvops.paged_attention with kv_layout="HND".""")  # noqa: B950

    def test_transfer_more_staged_heads_than_the_cache(self):
        """Before: ``Pass 0 <= head_start <= -1``. Not HND-shaped (no dim fits 5 heads): no hint."""
        ks, vs = [torch.zeros(6, 4, 4, 8)], [torch.zeros(6, 4, 4, 8)]
        msg = raises_everywhere(self, ValueError, lambda k, v, t, s: kvops.paged_kv_gather(k, v, t, s),
                                (ks, vs, torch.tensor([3, 1]), torch.empty(staging_shape(1, 3, 5, 8))))
        self.assertExpectedInline(msg, """kvops.paged_kv_gather: head slice [0, 5) is outside the caches' heads [0, 4). Pass staging with at most 4 heads (it carries 5).""")  # noqa: B950


class TestPagedKVCacheHeads(expecttest.TestCase):
    """The cache allocated its NHD caches: before, the ops' hint said ``pass kv_layout="HND"`` (block_size 16
    fits 16 heads), an argument ``PagedKVCache`` does not take."""

    def setUp(self):
        self.cache = kvops.PagedKVCache(4, 16, 8, 32, dtype=torch.float32)
        self.cache.add_sequence("a")
        self.step = self.cache.prepare({"a": 3})

    def test_write(self):
        write = lambda k: self.cache.write(0, k, k, self.step)  # noqa: E731
        msg = raises_everywhere(self, ValueError, write, (torch.randn(3, 16, 32),), compile_exc=PY_ERROR)
        self.assertExpectedInline(msg, """PagedKVCache.write: key of shape (3, 16, 32) has 16 heads, which exceed the cache's num_kv_heads=8. Pass key with 8 heads, or build PagedKVCache with num_kv_heads=16.""")  # noqa: B950
        msg = raises_everywhere(self, ValueError, write, (torch.randn(3, 2, 32),), compile_exc=PY_ERROR)
        self.assertExpectedInline(msg, """PagedKVCache.write: key of shape (3, 2, 32) has 2 heads, which differ from the cache's num_kv_heads=8. If the model has 2 KV heads, build PagedKVCache with num_kv_heads=2. A head slice is for several writers filling one cache (tensor-parallel writers): then pass cache_head_start (0 <= cache_head_start <= 6), and have the other writers fill the other heads before attention.""")  # noqa: B950
        self.assertFalse(self.cache.k_caches[0].any())

    def test_attention(self):
        msg = raises_everywhere(self, ValueError, lambda q: self.cache.attention(0, q, self.step),
                                (torch.randn(3, 12, 32),), compile_exc=PY_ERROR)
        self.assertExpectedInline(msg, """PagedKVCache.attention: q of shape (3, 12, 32) has 12 heads, which must be a multiple of the cache's num_kv_heads=8 (GQA). If the model has another KV head count, build PagedKVCache with it (a divisor of 12); else pass q with a multiple of 8 heads.""")  # noqa: B950


class TestAmbiguousShapeNHDView(expecttest.TestCase):
    """``H_kv == block_size == 4``: an HND cache reads as a valid NHD one, so no error or hint can say otherwise;
    its NHD view ``transpose(1, 2)`` is the fix and must equal an NHD copy, with the writes landing in the HND
    storage (bit-exact for data movement, fp32 attention within rounding)."""

    P, H, BS, D = 5, 4, 4, 16

    def caches(self):
        k, v = hnd(self.P, self.H, self.BS, self.D), hnd(self.P, self.H, self.BS, self.D, 1)
        return (k, v), (k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous())

    def test_flash_attn_with_kvcache(self):
        (k_hnd, v_hnd), (k_nhd, v_nhd) = self.caches()
        q, k = torch.randn(2, 2, 8, self.D), torch.randn(2, 2, self.H, self.D)
        table, lens = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32), torch.tensor([5, 2], dtype=torch.int32)
        kw = dict(cache_seqlens=lens, block_table=table, causal=True)
        got = kvops.flash_attn_with_kvcache(q, k_hnd.transpose(1, 2), v_hnd.transpose(1, 2), k, k, **kw)
        expected = kvops.flash_attn_with_kvcache(q, k_nhd, v_nhd, k, k, **kw)
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
        self.assertTrue(torch.equal(k_hnd.transpose(1, 2), k_nhd) and torch.equal(v_hnd.transpose(1, 2), v_nhd))

    def test_rotary_write_and_transfer(self):
        (k_hnd, v_hnd), (k_nhd, v_nhd) = self.caches()
        key, value = torch.randn(3, self.H, self.D), torch.randn(3, self.H, self.D)
        cos, sin = torch.randn(16, 4), torch.randn(16, 4)
        slots, pos = torch.tensor([9, 0, 19]), torch.tensor([2, 7, 11])
        for kc, vc in ((k_hnd.transpose(1, 2), v_hnd.transpose(1, 2)), (k_nhd, v_nhd)):
            kvops.rotary_paged_cache_write(key, value, kc, vc, slots, pos, cos, sin)
        self.assertTrue(torch.equal(k_hnd.transpose(1, 2), k_nhd) and torch.equal(v_hnd.transpose(1, 2), v_nhd))

        table = torch.tensor([2, 4, 0], dtype=torch.int32)
        got, expected = torch.empty(staging_shape(1, 6, 2, self.D)), torch.empty(staging_shape(1, 6, 2, self.D))
        kvops.paged_kv_gather([k_hnd.transpose(1, 2)], [v_hnd.transpose(1, 2)], table, got, 3, 1)
        kvops.paged_kv_gather([k_nhd], [v_nhd], table, expected, 3, 1)
        self.assertTrue(torch.equal(got, expected))
        kvops.paged_kv_scatter(got + 1, [k_hnd.transpose(1, 2)], [v_hnd.transpose(1, 2)], table, 5, 2)
        kvops.paged_kv_scatter(expected + 1, [k_nhd], [v_nhd], table, 5, 2)
        self.assertTrue(torch.equal(k_hnd.transpose(1, 2), k_nhd) and torch.equal(v_hnd.transpose(1, 2), v_nhd))


if __name__ == "__main__":
    import unittest

    unittest.main()
