"""Inductor lowerings of kvops.cache_write / kvops.cache_roll (lowering/inductor_contiguous.py), on CPU.

Facts checked by reading the generated code (``run_and_get_code``): the producer of the written values and the store
are one generated C++ kernel, and no extern call to kvops is left. Results are compared bit for bit with eager (the
kvops CPU kernels) on the whole allocation, so untouched rows and heads are checked too. Every class compiles in a
fresh Inductor cache: the FX graph cache does not key on custom lowerings, so a warm cache could hide a change here.
"""

import subprocess
import sys
import unittest

import expecttest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor import lowering as inductor_lowering

import kvops
from tests.inductor_utils import FreshInductorCache, code_facts, compiled, rope, rope_tables

SENTINEL = -7.0


def project_rope_write(x, w_kv, cos, sin, k_cache, v_cache, start):
    """Fused K/V projection (one matmul), RoPE on K, write both: the pattern the lowering exists for."""
    b, t, _ = x.shape
    k, v = (x @ w_kv).view(b, t, 2, -1, cos.shape[-1]).unbind(2)
    kvops.cache_write(rope(k, cos, sin), v, k_cache, v_cache, start)


def joint_caches(b, s, h, d, dtype):
    kv = torch.full((b, s, 2, h, d), SENTINEL, dtype=dtype)
    return kv, kv[:, :, 0], kv[:, :, 1]


class TestCacheWriteLowering(FreshInductorCache):
    def test_projection_rope_and_write_fuse_into_one_kernel(self):
        b, t, s, h, d, hidden = 2, 3, 10, 2, 8, 16
        cos, sin = rope_tables(t, d)
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            x = torch.randn(b, t, hidden, dtype=dtype)
            w_kv = torch.randn(hidden, 2 * h * d, dtype=dtype)
            kv, k_cache, v_cache = joint_caches(b, s, h, d, dtype)  # K and V: strided views of one allocation
            expected, k_ref, v_ref = joint_caches(b, s, h, d, dtype)
            _, code = compiled(project_rope_write, x, w_kv, cos, sin, k_cache, v_cache, 4)
            project_rope_write(x, w_kv, cos, sin, k_ref, v_ref, 4)
            self.assertExpectedInline(code_facts(code), """cpp kernels: 1, kvops calls: 0""")
            self.assertTrue(torch.equal(kv, expected), dtype)  # the caller's tensors were written in place
            self.assertTrue(bool((kv[:, :4] == SENTINEL).all()) and bool((kv[:, 7:] == SENTINEL).all()))

    def test_rmsnorm_rope_and_write_fuse_into_one_kernel(self):
        def norm_rope_write(k, v, weight, cos, sin, k_cache, v_cache, start):
            kf = k.float()
            normed = (kf * torch.rsqrt(kf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight).to(k.dtype)
            kvops.cache_write(rope(normed, cos, sin), v, k_cache, v_cache, start)

        b, t, s, h, d = 1, 5, 8, 2, 16
        torch.manual_seed(0)
        k, v, weight = torch.randn(b, t, h, d), torch.randn(b, t, h, d), torch.randn(d)
        cos, sin = rope_tables(t, d)
        k_cache, v_cache = torch.full((b, s, h, d), SENTINEL), torch.full((b, s, h, d), SENTINEL)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        _, code = compiled(norm_rope_write, k, v, weight, cos, sin, k_cache, v_cache, 2)
        norm_rope_write(k, v, weight, cos, sin, k_ref, v_ref, 2)
        self.assertExpectedInline(code_facts(code), """cpp kernels: 1, kvops calls: 0""")
        torch.testing.assert_close(k_cache, k_ref, rtol=1e-5, atol=1e-5)  # reduction order differs from eager
        self.assertTrue(torch.equal(v_cache, v_ref))  # pure data movement: bit-exact
        self.assertTrue(bool((k_cache[:, :2] == SENTINEL).all()) and bool((k_cache[:, 7:] == SENTINEL).all()))

    def test_without_the_lowering_the_write_is_an_extern_call(self):
        """The facts above can fail: with the lowering removed, Inductor calls the kvops kernel."""
        op = torch.ops.kvops.cache_write.default
        saved = inductor_lowering.lowerings.pop(op)
        try:
            k_cache, v_cache = torch.zeros(1, 6, 1, 4), torch.zeros(1, 6, 1, 4)
            _, code = compiled(lambda k, kc, vc: kvops.cache_write(k.sin(), k, kc, vc, 1),
                               torch.randn(1, 2, 1, 4), k_cache, v_cache)
        finally:
            inductor_lowering.lowerings[op] = saved
        self.assertExpectedInline(code_facts(code), """cpp kernels: 1, kvops calls: 1""")

    def test_head_slice_of_a_wider_cache(self):
        """H_in=2 written at cache_head_start=1 of a 3-head cache that is itself heads [1, 4) of a 5-head tensor."""
        b, t, s, d = 2, 3, 6, 80
        torch.manual_seed(0)
        key, value = torch.randn(b, t, 2, d), torch.randn(b, t, 2, d)
        wide_k, wide_v = torch.full((b, s, 5, d), SENTINEL), torch.full((b, s, 5, d), SENTINEL)
        ref_k, ref_v = wide_k.clone(), wide_v.clone()

        def write(k, v, k_cache, v_cache, start):
            kvops.cache_write(k * 2, v.neg(), k_cache, v_cache, start, cache_head_start=1)

        _, code = compiled(write, key, value, wide_k[:, :, 1:4], wide_v[:, :, 1:4], 3)
        write(key, value, ref_k[:, :, 1:4], ref_v[:, :, 1:4], 3)
        self.assertExpectedInline(code_facts(code), """cpp kernels: 1, kvops calls: 0""")
        self.assertTrue(torch.equal(wide_k, ref_k) and torch.equal(wide_v, ref_v))
        self.assertTrue(bool((wide_k[:, :, [0, 1, 4]] == SENTINEL).all()))  # heads outside the slice untouched

    def test_caches_that_are_module_buffers(self):
        class Layer(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("k_cache", torch.full((1, 8, 2, 4), SENTINEL))
                self.register_buffer("v_cache", torch.full((1, 8, 2, 4), SENTINEL))

            def forward(self, k, v, start):
                kvops.cache_write(k * 3, v + 1, self.k_cache, self.v_cache, start)
                return self.k_cache[:, : start + k.shape[1]].amax()  # a reader after the write sees it

        torch.manual_seed(0)
        k, v = torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 4)
        layer, ref = Layer(), Layer()
        out, code = compiled(layer, k, v, 2)
        expected = ref(k, v, 2)
        self.assertExpectedInline(code_facts(code), """cpp kernels: 1, kvops calls: 0""")
        self.assertTrue(torch.equal(out, expected))
        self.assertTrue(torch.equal(layer.k_cache, ref.k_cache) and torch.equal(layer.v_cache, ref.v_cache))

    def test_symint_start_compiles_at_most_twice(self):
        def write(k, v, k_cache, v_cache, start):
            kvops.cache_write(k * 2, v, k_cache, v_cache, start)

        b, t, s, h, d = 1, 2, 24, 2, 4
        k_cache, v_cache = torch.full((b, s, h, d), SENTINEL), torch.full((b, s, h, d), SENTINEL)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("inductor")
        step = torch.compile(write, backend=counter, fullgraph=True)
        torch.manual_seed(0)
        for start in range(0, s - t + 1, t):  # 0, 2, 4, ..., 22: eleven steps
            k, v = torch.randn(b, t, h, d), torch.randn(b, t, h, d)
            step(k, v, k_cache, v_cache, start)
            write(k, v, k_ref, v_ref, start)
        self.assertLessEqual(counter.frame_count, 2)
        self.assertTrue(torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref))

    def test_values_read_from_the_cache_itself(self):
        """Rows [0, 4) doubled and written to rows [1, 5): overlapping source and destination in one op."""

        def shift(k, v, k_cache, v_cache):
            kvops.cache_write(k, v, k_cache, v_cache, 0)
            moved = k_cache[:, 0:4] * 2
            kvops.cache_write(moved, moved + 1, k_cache, v_cache, 1)

        torch.manual_seed(0)
        k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
        _, k_cache, v_cache = joint_caches(1, 8, 2, 8, torch.float32)
        _, k_ref, v_ref = joint_caches(1, 8, 2, 8, torch.float32)
        _, code = compiled(shift, k, v, k_cache, v_cache)
        shift(k, v, k_ref, v_ref)
        self.assertEqual(code_facts(code).split(",")[1], " kvops calls: 0")
        self.assertTrue(torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref))


class TestCacheRollLowering(FreshInductorCache):
    def test_overlapping_rolls_in_both_directions(self):
        def roll(k_cache, v_cache, src, dst, n):
            kvops.cache_roll(k_cache, v_cache, src, dst, n, cache_head_start=1, num_heads=2)

        b, s, h, d = 2, 12, 4, 3
        kv = torch.arange(b * s * 2 * h * d, dtype=torch.float32).view(b, s, 2, h, d)
        expected = kv.clone()
        torch._dynamo.reset()
        step = torch.compile(roll, fullgraph=True)
        for src, dst, n in ((1, 3, 6), (5, 2, 7), (0, 0, 4), (2, 9, 3)):  # up, down, in place, disjoint
            step(kv[:, :, 0], kv[:, :, 1], src, dst, n)
            roll(expected[:, :, 0], expected[:, :, 1], src, dst, n)
            self.assertTrue(torch.equal(kv, expected), (src, dst, n))
        _, code = compiled(roll, kv[:, :, 0], kv[:, :, 1], 1, 3, 6)
        self.assertExpectedInline(code_facts(code), """cpp kernels: 1, kvops calls: 0""")

    def test_evict_then_append_then_roll_again(self):
        """Roll rows past a 2-token sink down by 3, write 3 new tokens at the end, roll again (overlapping): the
        second roll (upwards) reads a cache that this graph already mutated twice."""

        def evict_append(k, v, k_cache, v_cache):
            kvops.cache_roll(k_cache, v_cache, 5, 2, 3)
            kvops.cache_write(rope(k, *rope_tables(3, 8)), v, k_cache, v_cache, 5)
            kvops.cache_roll(k_cache, v_cache, 2, 3, 5)
            return k_cache.amax(1)

        torch.manual_seed(0)
        k, v = torch.randn(1, 3, 2, 8, dtype=torch.bfloat16), torch.randn(1, 3, 2, 8, dtype=torch.bfloat16)
        k_cache, v_cache = torch.randn(1, 8, 2, 8, dtype=torch.bfloat16), torch.randn(1, 8, 2, 8, dtype=torch.bfloat16)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        out, code = compiled(evict_append, k, v, k_cache, v_cache)
        expected = evict_append(k, v, k_ref, v_ref)
        self.assertEqual(code_facts(code).split(",")[1], " kvops calls: 0")
        self.assertTrue(torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref) and torch.equal(out, expected))


class TestRegistration(unittest.TestCase):
    def test_import_kvops_registers_the_lowerings(self):
        """``import kvops`` alone registers the lowerings, and changes no Inductor config."""
        script = (
            "import torch, torch._inductor.config as c\n"
            "before = c.get_config_copy()\n"
            "import kvops\n"
            "from torch._inductor.lowering import lowerings\n"
            "assert c.get_config_copy() == before\n"
            "ops = torch.ops.kvops\n"
            "print(all(op in lowerings for op in (ops.cache_write.default, ops.cache_roll.default,"
            " ops.paged_cache_write.default)))\n"
        )
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), "True")



class TestGeometryChanges(FreshInductorCache):
    def test_joint_caches_after_recompiles(self):
        """Geometry changes for contiguous caches: K/V as ``unbind`` views of one ``[B, S, 2, H, D]`` / ``[B, 2, S, H, D]``
        allocation; batch and cache length, then heads change (automatic dynamic shapes). Before the fix the
        recompiled wrapper raised ``NameError`` for a size symbol it never defined."""

        def write(key, value, k_cache, v_cache, start):
            kvops.cache_write(key * 0.5, value, k_cache, v_cache, start)

        torch._dynamo.reset()
        step = torch.compile(write, fullgraph=True)
        for b, s, h in ((1, 16, 2), (2, 64, 2), (2, 64, 4)):
            key, value = torch.randn(b, 5, h, 8), torch.randn(b, 5, h, 8)
            for shape, dim in (((b, s, 2, h, 8), 2), ((b, 2, s, h, 8), 1)):
                kv = torch.randn(shape)
                ref = kv.clone()
                step(key, value, *kv.unbind(dim), 3)
                write(key, value, *ref.unbind(dim), 3)
                self.assertTrue(torch.equal(kv, ref), (shape, dim))


if __name__ == "__main__":
    expecttest.run_tests() if hasattr(expecttest, "run_tests") else unittest.main()
