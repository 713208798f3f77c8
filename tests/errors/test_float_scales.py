"""A Python float where an op takes a scale tensor (``k_scale``/``v_scale``; vLLM layers keep a float next to the
tensor, so it is an easy slip): a ``ValueError`` naming the argument, the value and the fix, before anything is written,
in eager, compile and export (the dispatcher's own error names the schema type; ``.dim()`` on a float was an
AttributeError); the same when the float is an argument of the compiled function that changes between calls (the
recompile makes it a SymFloat). A 0-d scale of another dtype than float32 is reported with the shape and dtype it was
passed with."""

import ast
import re

import expecttest
import torch

import kvops
from tests.contract import raises_everywhere, raises_for_each

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

    def test_paged_attention_compiled_without_fullgraph(self):
        """docs/semantics.md "Where errors fire": a check of the public wrapper, before dispatch, raises while Dynamo
        traces it (``Unsupported`` under ``fullgraph=True``, above); without ``fullgraph=True`` Dynamo runs the call
        eagerly, and it raises the ``ValueError`` itself."""
        kc, vc = self.fp8_caches()
        cu, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
        table = torch.zeros(1, 1, dtype=torch.int32)
        torch._dynamo.reset()
        with self.assertRaises(ValueError) as cm:
            torch.compile(lambda q, kc, vc: kvops.paged_attention(q, kc, vc, cu, lens, table, 1, k_scale=0.5,
                                                                  v_scale=self.one), backend="eager")(
                torch.randn(1, 2, 8), kc, vc)
        self.assertIs(type(cm.exception), ValueError)
        self.assertExpectedInline(str(cm.exception), """kvops.paged_attention: k_scale must be a float32 tensor of shape [1] or [H_kv] (or None), got float 0.5. Pass k_scale=torch.tensor(0.5, dtype=torch.float32) on the cache's device.""")

    def test_flash_attn_with_kvcache(self):
        kc, vc = self.fp8_caches()
        table = torch.zeros(1, 1, dtype=torch.int32)
        msg = raises_everywhere(self, ValueError, lambda q, kc, vc: kvops.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=torch.tensor([3], dtype=torch.int32), block_table=table, k_scale=0.25,
            v_scale=self.one), (torch.randn(1, 1, 2, 8), kc, vc), compile_exc=torch._dynamo.exc.Unsupported)
        self.assertExpectedInline(msg, """flash_attn_with_kvcache: k_scale must be a float32 tensor of shape [1] or [H_kv] (or None), got float 0.25. Pass k_scale=torch.tensor(0.25, dtype=torch.float32) on the cache's device.""")


class TestFloatScalesRecompiled(expecttest.TestCase):
    """A float scale passed as an argument of the compiled function, a different one at each call: the second call
    recompiles with the float symbolic (a SymFloat), and the message still names its value."""

    def setUp(self):
        self.one = torch.ones(1)
        self.kc = torch.zeros(4, 4, 2, 8, dtype=FP8)
        self.vc = torch.zeros(4, 4, 2, 8, dtype=FP8)

    def messages(self, fn, args, values=(0.05, 0.25)):
        return "\n".join(raises_for_each(self, ValueError, fn, args, values,
                                         compile_exc=torch._dynamo.exc.Unsupported))

    def test_paged_cache_write(self):
        slots = torch.arange(3)
        msg = self.messages(lambda k, kc, vc, s: kvops.paged_cache_write(
            k, k, kc, vc, slots, k_scale=s, v_scale=self.one), (torch.randn(3, 2, 8), self.kc, self.vc))
        self.assertExpectedInline(msg, """\
kvops.paged_cache_write: k_scale must be a float32 tensor of shape [1] or [H_kv] (or None), got float 0.05. Pass k_scale=torch.tensor(0.05, dtype=torch.float32) on the cache's device.
kvops.paged_cache_write: k_scale must be a float32 tensor of shape [1] or [H_kv] (or None), got float 0.25. Pass k_scale=torch.tensor(0.25, dtype=torch.float32) on the cache's device.""")
        self.assertTrue((self.kc.view(torch.uint8) == 0).all() and (self.vc.view(torch.uint8) == 0).all())

    def test_paged_attention(self):
        cu, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
        table = torch.zeros(1, 1, dtype=torch.int32)
        msg = self.messages(lambda q, kc, vc, s: kvops.paged_attention(
            q, kc, vc, cu, lens, table, 1, k_scale=self.one, v_scale=s), (torch.randn(1, 2, 8), self.kc, self.vc))
        self.assertExpectedInline(msg, """\
kvops.paged_attention: v_scale must be a float32 tensor of shape [1] or [H_kv] (or None), got float 0.05. Pass v_scale=torch.tensor(0.05, dtype=torch.float32) on the cache's device.
kvops.paged_attention: v_scale must be a float32 tensor of shape [1] or [H_kv] (or None), got float 0.25. Pass v_scale=torch.tensor(0.25, dtype=torch.float32) on the cache's device.""")

    def test_flash_attn_with_kvcache(self):
        lens, table = torch.tensor([3], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32)
        msg = self.messages(lambda q, kc, vc, s: kvops.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=lens, block_table=table, k_scale=s, v_scale=self.one),
            (torch.randn(1, 1, 2, 8), self.kc, self.vc))
        self.assertExpectedInline(msg, """\
flash_attn_with_kvcache: k_scale must be a float32 tensor of shape [1] or [H_kv] (or None), got float 0.05. Pass k_scale=torch.tensor(0.05, dtype=torch.float32) on the cache's device.
flash_attn_with_kvcache: k_scale must be a float32 tensor of shape [1] or [H_kv] (or None), got float 0.25. Pass k_scale=torch.tensor(0.25, dtype=torch.float32) on the cache's device.""")

    def test_int_scale(self):  # an int scale becomes a SymInt the same way
        slots = torch.arange(3)
        msg = self.messages(lambda k, kc, vc, s: kvops.paged_cache_write(
            k, k, kc, vc, slots, k_scale=self.one, v_scale=s), (torch.randn(3, 2, 8), self.kc, self.vc), values=(2, 3))
        self.assertExpectedInline(msg, """\
kvops.paged_cache_write: v_scale must be a float32 tensor of shape [1] or [H_kv] (or None), got int 2. Pass v_scale=torch.tensor(2, dtype=torch.float32) on the cache's device.
kvops.paged_cache_write: v_scale must be a float32 tensor of shape [1] or [H_kv] (or None), got int 3. Pass v_scale=torch.tensor(3, dtype=torch.float32) on the cache's device.""")


    def test_unbacked_scale(self):
        """A float read from a tensor while tracing (``.item()``, Dynamo's ``capture_scalar_outputs``) has no value
        at trace time: the compiled message says so rather than failing to guard on it."""
        slots = torch.arange(3)

        def write(k, kc, vc, t):
            return kvops.paged_cache_write(k, k, kc, vc, slots, k_scale=t.item(), v_scale=self.one)

        args = (torch.randn(3, 2, 8), self.kc, self.vc, torch.tensor(0.5))
        with self.assertRaises(ValueError) as cm:
            write(*args)
        self.assertExpectedInline(str(cm.exception), """kvops.paged_cache_write: k_scale must be a float32 tensor of shape [1] or [H_kv] (or None), got float 0.5. Pass k_scale=torch.tensor(0.5, dtype=torch.float32) on the cache's device.""")
        torch._dynamo.reset()
        with torch._dynamo.config.patch(capture_scalar_outputs=True), \
                self.assertRaises(torch._dynamo.exc.Unsupported) as cm:
            torch.compile(write, fullgraph=True, backend="eager")(*args)
        # the string literal in Dynamo's text, either form of tests.contract.dynamo_exception_forms
        found = re.search(r"""ValueError\((?:\[ConstantVariable\(str: )?((['"])(?:\\.|(?!\2).)*\2)""", str(cm.exception))
        self.assertExpectedInline(ast.literal_eval(found.group(1)), """kvops.paged_cache_write: k_scale must be a float32 tensor of shape [1] or [H_kv] (or None), got a traced float. Pass k_scale=torch.tensor(s, dtype=torch.float32) on the cache's device.""")


class TestZeroDimScales(expecttest.TestCase):
    """A 0-d scale (vLLM's per-tensor form) counts as ``[1]``; one of another dtype is reported with the shape and
    dtype it was passed with (it was reshaped to ``[1]`` before the check, and reported as shape ``(1,)``)."""

    def setUp(self):
        self.one = torch.ones(1)
        self.kc = torch.zeros(4, 4, 2, 8, dtype=FP8)
        self.vc = torch.zeros(4, 4, 2, 8, dtype=FP8)

    def test_paged_cache_write(self):
        slots = torch.arange(3)
        msg = raises_everywhere(self, ValueError, lambda k, kc, vc, s: kvops.paged_cache_write(
            k, k, kc, vc, slots, k_scale=s, v_scale=self.one),
            (torch.randn(3, 2, 8), self.kc, self.vc, torch.tensor(0.5, dtype=torch.float64)))
        self.assertExpectedInline(msg, """kvops.paged_cache_write: k_scale must be a float32 tensor of shape [1] (per tensor) or [2] (per KV head of the cache), got shape () and dtype torch.float64.""")
        self.assertTrue((self.kc.view(torch.uint8) == 0).all() and (self.vc.view(torch.uint8) == 0).all())

    def test_paged_attention(self):
        cu, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
        table = torch.zeros(1, 1, dtype=torch.int32)
        msg = raises_everywhere(self, ValueError, lambda q, kc, vc, s: kvops.paged_attention(
            q, kc, vc, cu, lens, table, 1, k_scale=self.one, v_scale=s),
            (torch.randn(1, 2, 8), self.kc, self.vc, torch.tensor(0.5, dtype=torch.float64)))
        self.assertExpectedInline(msg, """kvops.paged_attention: v_scale must be a float32 tensor of shape [1] (per tensor) or [2] (per KV head of the cache), got shape () and dtype torch.float64.""")

    def test_flash_attn_with_kvcache(self):
        lens, table = torch.tensor([3], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32)
        msg = raises_everywhere(self, ValueError, lambda q, kc, vc, s: kvops.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=lens, block_table=table, k_scale=s, v_scale=self.one),
            (torch.randn(1, 1, 2, 8), self.kc, self.vc, torch.tensor(2, dtype=torch.int32)),
            compile_exc=torch._dynamo.exc.Unsupported)
        self.assertExpectedInline(msg, """kvops.paged_attention: k_scale must be a float32 tensor of shape [1] (per tensor) or [2] (per KV head of the cache), got shape () and dtype torch.int32.""")

    def test_float32_zero_dim_scale_is_accepted(self):
        slots, key = torch.arange(3), torch.randn(3, 2, 8)
        kvops.paged_cache_write(key, key, self.kc, self.vc, slots, k_scale=torch.tensor(0.5), v_scale=self.one)
        self.assertTrue(torch.equal(self.kc[0, :3].view(torch.uint8), (key / 0.5).to(FP8).view(torch.uint8)))


if __name__ == "__main__":
    import unittest

    unittest.main()
