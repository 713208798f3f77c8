"""kv_layout of kvops.paged_cache_write: HND caches ``[P, H_kv, block_size, D]`` (FlashInfer's name) next to NHD.

Bit-exact against the per-token reference of ``tests/paged/test_paged_write.py`` applied to the NHD view
``cache.transpose(1, 2)``; the ambiguous ``H_kv == block_size == 16`` geometry (no shape check can tell the layouts
apart, so only the explicit ``kv_layout`` decides); layout errors through ``raises_everywhere``.
"""

import expecttest
import torch

import kvops
from tests.contract import raises_everywhere
from tests.paged.test_paged_write import FP8, SENTINEL, random_slots, ref_write


def hnd_caches(p, bs, h, d, dtype=torch.float32, joint=False, head_pad=0):
    """Sentinel-filled HND caches ``[P, H, block_size, D]``: separate, K/V views of one ``[P, 2, H, bs, D]``
    allocation (FlashInfer's paged layout), or heads ``[1, 1 + H)`` of ``[P, H + head_pad, bs, D]`` caches."""
    fill = lambda shape: torch.full(shape, SENTINEL).to(dtype)  # noqa: E731
    if joint:
        return fill((p, 2, h, bs, d)).unbind(1)
    if head_pad:
        return tuple(fill((p, h + head_pad, bs, d))[:, 1 : 1 + h] for _ in range(2))
    return fill((p, h, bs, d)), fill((p, h, bs, d))


class TestHNDWrite(expecttest.TestCase):
    def test_matches_reference(self):
        cases = [  # (P, block_size, H_kv, H_in, D, N, pad, cache_head_start, joint, head_pad)
            (4, 16, 4, 4, 64, 20, 3, None, False, 0),
            (9, 1, 2, 2, 80, 7, 0, None, True, 0),  # block_size 1, head_dim 80, FlashInfer's joint allocation
            (6, 4, 5, 1, 16, 9, 2, 4, False, 0),  # GQA 5:1 writer of the last head
            (3, 8, 3, 2, 32, 10, 4, 1, False, 2),  # head-sliced view of a wider HND cache
        ]
        for p, bs, h_kv, h_in, d, n, pad, h0, joint, head_pad in cases:
            for dtype in (torch.float32, torch.bfloat16):
                k_cache, v_cache = hnd_caches(p, bs, h_kv, d, dtype, joint, head_pad)
                key, value = torch.randn(n, h_in, d).to(dtype), torch.randn(n, h_in, d).to(dtype)
                slots = random_slots(p, bs, n, pad)
                k_ref, v_ref = ref_write(k_cache.transpose(1, 2), v_cache.transpose(1, 2), key, value, slots, h0 or 0)
                kvops.paged_cache_write(key, value, k_cache, v_cache, slots, h0, kv_layout="HND")
                self.assertTrue(torch.equal(k_cache.transpose(1, 2), k_ref), (p, bs, h_kv, dtype))
                self.assertTrue(torch.equal(v_cache.transpose(1, 2), v_ref), (p, bs, h_kv, dtype))

    def test_fp8_per_head_scales(self):
        p, bs, h, d, n = 5, 4, 2, 16, 8
        k_cache, v_cache = hnd_caches(p, bs, h, d, FP8)
        key, value = torch.randn(n, h, d) * 300, torch.randn(n, h, d)
        k_scale, v_scale = torch.tensor([0.5, 2.0]), torch.tensor([0.25])
        slots = random_slots(p, bs, n, 2)
        k_ref, v_ref = ref_write(k_cache.transpose(1, 2), v_cache.transpose(1, 2), key, value, slots, 0, k_scale,
                                 v_scale)
        kvops.paged_cache_write(key, value, k_cache, v_cache, slots, None, k_scale, v_scale, kv_layout="HND")
        self.assertTrue(torch.equal(k_cache.transpose(1, 2).view(torch.uint8), k_ref.view(torch.uint8)))
        self.assertTrue(torch.equal(v_cache.transpose(1, 2).view(torch.uint8), v_ref.view(torch.uint8)))

    def test_ambiguous_heads_equal_block_size(self):
        """H_kv == block_size == 16: both layouts accept the cache; only kv_layout says where a slot lives."""
        p, bs, h, d, n = 3, 16, 16, 8, 5
        key, value = torch.randn(n, h, d), torch.randn(n, h, d)
        slots = torch.tensor([0, 17, 33, -1, 46])
        hnd = hnd_caches(p, bs, h, d)
        kvops.paged_cache_write(key, value, *hnd, slots, kv_layout="HND")
        nhd = tuple(torch.full((p, bs, h, d), SENTINEL) for _ in range(2))
        kvops.paged_cache_write(key, value, *nhd, slots)  # default "NHD"
        for cache_hnd, cache_nhd, x in zip(hnd, nhd, (key, value)):
            self.assertTrue(torch.equal(cache_hnd.transpose(1, 2), cache_nhd))  # the same logical write
            self.assertTrue(torch.equal(cache_hnd[1, :, 1], x[1]))  # slot 17: block 1, row 1, all 16 heads
            self.assertFalse(torch.equal(cache_hnd, cache_nhd))  # ... at different addresses


class TestLayoutErrors(expecttest.TestCase):
    def check(self, fn, *args):
        return raises_everywhere(self, ValueError, fn, args)

    def test_hnd_cache_passed_as_nhd_says_so(self):
        k_cache, v_cache = hnd_caches(5, 16, 4, 8)
        key, slots = torch.randn(3, 4, 8), torch.arange(3)
        msg = self.check(lambda k, kc, vc, s: kvops.paged_cache_write(k, k, kc, vc, s), key, k_cache, v_cache, slots)
        self.assertExpectedInline(msg, """kvops.paged_cache_write requires cache_head_start when cache heads (16) differ from input heads (4). If the model has 4 KV heads, allocate the cache with 4 KV heads (num_kv_heads=4). A head slice is for several writers filling one cache (tensor-parallel writers): then pass cache_head_start (0 <= cache_head_start <= 12) to write the input heads as heads [cache_head_start, cache_head_start + 4), and have the other writers fill the other heads before attention. Or pass key/value with all 16 heads. The cache of shape (5, 4, 16, 8) read as kv_layout="NHD" has 16 heads, but its dim of size 4 fits the 4 input heads: it may be an HND cache [num_blocks, num_kv_heads, block_size, head_dim]; if so, pass kv_layout="HND".""")

    def test_nhd_cache_passed_as_hnd_says_so(self):
        k_cache, v_cache = torch.zeros(5, 16, 4, 8), torch.zeros(5, 16, 4, 8)
        key, slots = torch.randn(3, 4, 8), torch.arange(3)
        fn = lambda k, kc, vc, s: kvops.paged_cache_write(k, k, kc, vc, s, kv_layout="HND")  # noqa: E731
        msg = self.check(fn, key, k_cache, v_cache, slots)
        self.assertExpectedInline(msg, """kvops.paged_cache_write requires cache_head_start when cache heads (16) differ from input heads (4). If the model has 4 KV heads, allocate the cache with 4 KV heads (num_kv_heads=4). A head slice is for several writers filling one cache (tensor-parallel writers): then pass cache_head_start (0 <= cache_head_start <= 12) to write the input heads as heads [cache_head_start, cache_head_start + 4), and have the other writers fill the other heads before attention. Or pass key/value with all 16 heads. The cache of shape (5, 16, 4, 8) read as kv_layout="HND" has 16 heads, but its dim of size 4 fits the 4 input heads: it may be an NHD cache [num_blocks, block_size, num_kv_heads, head_dim]; if so, pass kv_layout="NHD".""")

    def test_layout_error_goes_before_the_slot_check(self):
        """Read as HND, this NHD cache holds 5 * 4 = 20 slots, so slot 70 also fails the eager value check; the
        layout error, which explains it, is the one raised (and nothing is written)."""
        k_cache, v_cache = torch.zeros(5, 16, 4, 8), torch.zeros(5, 16, 4, 8)
        key, slots = torch.randn(3, 4, 8), torch.tensor([0, 40, 70])
        with self.assertRaises(ValueError) as cm:
            kvops.paged_cache_write(key, key, k_cache, v_cache, slots, kv_layout="HND")
        self.assertIn('it may be an NHD cache [num_blocks, block_size, num_kv_heads, head_dim]', str(cm.exception))
        self.assertFalse(k_cache.any() or v_cache.any())

    def test_unknown_layout_and_hnd_rank(self):
        k_cache, v_cache = hnd_caches(5, 16, 4, 8)
        key, slots = torch.randn(3, 4, 8), torch.arange(3)
        fn = lambda k, kc, vc, s: kvops.paged_cache_write(k, k, kc, vc, s, kv_layout="HDN")  # noqa: E731
        self.assertExpectedInline(self.check(fn, key, k_cache, v_cache, slots), """kvops.paged_cache_write: kv_layout must be "NHD" (caches [num_blocks, block_size, num_kv_heads, head_dim]) or "HND" (caches [num_blocks, num_kv_heads, block_size, head_dim]), got 'HDN'.""")
        fn = lambda k, kc, vc, s: kvops.paged_cache_write(k, k, kc, vc, s, kv_layout="HND")  # noqa: E731
        self.assertExpectedInline(self.check(fn, key, k_cache[0], v_cache[0], slots), """kvops.paged_cache_write: k_cache must be 4-D [num_blocks, num_kv_heads, block_size, head_dim], got shape (4, 16, 8). Reshape k_cache to [num_blocks, num_kv_heads, block_size, head_dim].""")


if __name__ == "__main__":
    expecttest.run_tests() if hasattr(expecttest, "run_tests") else __import__("unittest").main()
