"""A Python float where an op takes a scale tensor (``k_scale``/``v_scale``; vLLM layers keep a float next to the
tensor, so it is an easy slip): a ``ValueError`` naming the argument, the value and the fix, before anything is written,
in eager, compile and export (the dispatcher's own error names the schema type; ``.dim()`` on a float was an
AttributeError)."""

import expecttest
import torch

import kvops
from tests.contract import raises_everywhere

FP8 = torch.float8_e4m3fn


class TestFloatScales(expecttest.TestCase):
    def setUp(self):
        self.key = torch.randn(3, 2, 8)
        self.slots = torch.arange(3)
        self.one = torch.ones(1)

    def fp8_caches(self):
        return torch.zeros(4, 4, 2, 8, dtype=FP8), torch.zeros(4, 4, 2, 8, dtype=FP8)

    def assert_untouched(self, *caches):
        for c in caches:
            self.assertTrue((c.view(torch.uint8) == 0).all())

    def test_paged_cache_write(self):
        kc, vc = self.fp8_caches()
        msg = raises_everywhere(self, ValueError, lambda k, kc, vc: kvops.paged_cache_write(
            k, k, kc, vc, self.slots, k_scale=0.05, v_scale=self.one), (self.key, kc, vc),
            compile_exc=torch._dynamo.exc.Unsupported)
        self.assertExpectedInline(msg, """kvops.paged_cache_write: k_scale must be a float32 tensor of shape [1] or [H_kv] (or None), got float 0.05. Pass k_scale=torch.tensor(0.05, dtype=torch.float32) on the cache's device.""")
        self.assert_untouched(kc, vc)

    def test_rotary_paged_cache_write(self):
        kc, vc = self.fp8_caches()
        cos, sin = torch.ones(8, 4), torch.zeros(8, 4)
        msg = raises_everywhere(self, ValueError, lambda k, kc, vc: kvops.rotary_paged_cache_write(
            k, k, kc, vc, self.slots, self.slots, cos, sin, k_scale=self.one, v_scale=2), (self.key, kc, vc),
            compile_exc=torch._dynamo.exc.Unsupported)
        self.assertExpectedInline(msg, """kvops.rotary_paged_cache_write: v_scale must be a float32 tensor of shape [1] or [H_kv] (or None), got int 2. Pass v_scale=torch.tensor(2, dtype=torch.float32) on the cache's device.""")
        self.assert_untouched(kc, vc)

    def test_paged_attention(self):
        kc, vc = self.fp8_caches()
        cu, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
        table = torch.zeros(1, 1, dtype=torch.int32)
        msg = raises_everywhere(self, ValueError, lambda q, kc, vc: kvops.paged_attention(
            q, kc, vc, cu, lens, table, 1, k_scale=self.one, v_scale=0.5), (torch.randn(1, 2, 8), kc, vc),
            compile_exc=torch._dynamo.exc.Unsupported)
        self.assertExpectedInline(msg, """kvops.paged_attention: v_scale must be a float32 tensor of shape [1] or [H_kv] (or None), got float 0.5. Pass v_scale=torch.tensor(0.5, dtype=torch.float32) on the cache's device.""")

    def test_flash_attn_with_kvcache(self):
        kc, vc = self.fp8_caches()
        table = torch.zeros(1, 1, dtype=torch.int32)
        msg = raises_everywhere(self, ValueError, lambda q, kc, vc: kvops.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=torch.tensor([3], dtype=torch.int32), block_table=table, k_scale=0.25,
            v_scale=self.one), (torch.randn(1, 1, 2, 8), kc, vc), compile_exc=torch._dynamo.exc.Unsupported)
        self.assertExpectedInline(msg, """flash_attn_with_kvcache: k_scale must be a float32 tensor of shape [1] or [H_kv] (or None), got float 0.25. Pass k_scale=torch.tensor(0.25, dtype=torch.float32) on the cache's device.""")


if __name__ == "__main__":
    import unittest

    unittest.main()
