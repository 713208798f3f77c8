"""``kvops.cache.PagedMLACache``: PagedKVCache's block manager over latent caches; writes and attention through the
MLA ops, checked against the fp64 oracle over the same blocks (prefill then decode, a fork sharing full blocks)."""

import unittest

import expecttest
import torch

from kvops.cache import PagedMLACache
from kvops.reference import mla as ref
from tests.mla._cases import FP8, tables


class TestPagedMLACache(expecttest.TestCase):
    def run_steps(self, cache, steps, heads=4, rank=32, rope=16, layer=1, rotary=False):
        g = torch.Generator().manual_seed(3)
        cos, sin = tables(64, rope)
        for new_tokens in steps:
            step = cache.prepare(new_tokens)
            n = step.slot_mapping.shape[0]
            src = torch.float32
            kv_c, k_pe = torch.randn(n, rank, generator=g).to(src), torch.randn(n, rope, generator=g).to(src)
            before = cache.kv_caches[layer].clone()
            kw = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=True) if rotary else {}
            cache.write(layer, kv_c, k_pe, step, **kw)
            want_cache = ref.mla_cache_write(kv_c, k_pe, before, step.slot_mapping, cache.kv_scale,
                                             step.positions if rotary else None, cos if rotary else None,
                                             sin if rotary else None, True)
            torch.testing.assert_close(cache.kv_caches[layer].float(), want_cache.float(), rtol=1e-6, atol=1e-6)
            q = torch.randn(n, heads, rank + rope, generator=g)
            out, lse = cache.attention(layer, q, step, scale=0.2)
            want, want_lse = ref.mla_attention(q, cache.kv_caches[layer], step.cu_seqlens_q, step.seq_lens,
                                               step.block_table, rank, scale=0.2, kv_scale=cache.kv_scale)
            torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)
            torch.testing.assert_close(lse.double(), want_lse, rtol=2e-5, atol=2e-5)
        self.assertTrue((cache.kv_caches[0] == 0).all())  # another layer: untouched

    def test_prefill_decode_and_fork(self):
        cache = PagedMLACache(16, 4, 32, 16, num_layers=2)
        cache.add_sequence("a")
        cache.add_sequence("b")
        self.run_steps(cache, [{"a": 9, "b": 3}, {"a": 1, "b": 1}, {"a": 1, "b": 1}], rotary=True)
        cache.fork("a", "c", 8)  # two full blocks shared
        self.assertEqual(cache.block_ids("c"), cache.block_ids("a")[:2])
        self.run_steps(cache, [{"c": 2, "a": 1}, {"c": 1, "b": 1}])
        cache.free("b")
        self.assertEqual(cache.seq_ids, ["a", "c"])

    def test_fp8(self):
        cache = PagedMLACache(8, 16, 32, 16, num_layers=2, dtype=FP8, kv_scale=torch.tensor(0.05))
        cache.add_sequence(0)
        g = torch.Generator().manual_seed(0)
        step = cache.prepare({0: 20})
        cache.write(1, torch.randn(20, 32, generator=g), torch.randn(20, 16, generator=g), step)
        q = torch.randn(20, 4, 48, generator=g)
        out, _ = cache.attention(1, q, step)
        want, _ = ref.mla_attention(q, cache.kv_caches[1], step.cu_seqlens_q, step.seq_lens, step.block_table, 32,
                                    kv_scale=cache.kv_scale)
        torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)

    def test_errors(self):
        with self.assertRaises(ValueError) as cm:
            PagedMLACache(0, 4, 32, 16)
        self.assertEqual(str(cm.exception), "PagedMLACache: num_blocks must be a positive int, got 0.")
        cache = PagedMLACache(4, 4, 32, 16)
        cache.add_sequence(0)
        step = cache.prepare({0: 2})
        with self.assertRaises(ValueError) as cm:
            cache.write(1, torch.randn(2, 32), torch.randn(2, 16), step)
        self.assertIn("PagedMLACache.write: layer must be an int in [0, 1)", str(cm.exception))
        with self.assertRaises(ValueError) as cm:
            cache.write(0, torch.randn(2, 32), torch.randn(2, 8), step)
        self.assertIn("kvops.mla_cache_write: kv_c has kv_lora_rank 32 and k_pe has rope_dim 8", str(cm.exception))
        self.assertTrue((cache.kv_caches[0] == 0).all())

    def ctor_error(self, **kw):
        with self.assertRaises(ValueError) as cm:
            PagedMLACache(8, 16, 32, 16, **kw)
        return str(cm.exception)

    def test_fp8_scale_errors_at_construction(self):
        """A missing or Python-float kv_scale is refused by the constructor, not at the first write."""
        self.assertExpectedInline(self.ctor_error(dtype=FP8), """PagedMLACache: dtype=torch.float8_e4m3fn needs kv_scale (the float32 per-tensor scale: the cache holds x / kv_scale), got kv_scale=None. Pass kv_scale=torch.tensor(s, dtype=torch.float32) to PagedMLACache (it is passed to every write and attention).""")
        self.assertExpectedInline(self.ctor_error(dtype=FP8, kv_scale=0.05), """PagedMLACache: kv_scale must be a float32 scalar tensor (or None), got float 0.05. Pass kv_scale=torch.tensor(0.05, dtype=torch.float32) on the cache's device.""")
        self.assertExpectedInline(self.ctor_error(dtype=FP8, kv_scale=torch.ones(2)), """PagedMLACache: kv_scale must be a float32 scalar tensor (shape [] or [1], one scale per tensor), got shape (2,) and dtype torch.float32. Pass one scale, torch.tensor(s, dtype=torch.float32) (the latent cache is one head: no per-head scales).""")
        self.assertExpectedInline(self.ctor_error(kv_scale=torch.tensor(0.05)), """PagedMLACache: kv_scale was given but kv_cache dtype is torch.float32; a scale applies only to a torch.float8_e4m3fn cache. Drop kv_scale or allocate the cache as torch.float8_e4m3fn.""")


if __name__ == "__main__":
    unittest.main()
