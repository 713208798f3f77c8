"""Inductor lowering of kvops.paged_cache_write (lowering/inductor_paged.py), on CPU.

Checked against eager (the kvops CPU kernel) bit for bit on the whole cache allocation, so rows that no token
targets (negative slots, padding) are checked to stay bit-identical, and by reading the generated code: the producer
(RoPE, fp8 quantization) and the store are one C++ kernel, with no extern call to kvops. Each class compiles in a
fresh Inductor cache (the FX graph cache does not key on custom lowerings).
"""


import re

import expecttest
import torch
import torch._dynamo
import torch._inductor.config
from torch._dynamo.testing import CompileCounterWithBackend

import kvops
from tests.inductor_utils import FreshInductorCache, code_facts, compiled, rope, rope_tables

FP8 = torch.float8_e4m3fn


def rope_write(key, value, cos, sin, k_cache, v_cache, slot_mapping, cache_head_start=None, k_scale=None,
               v_scale=None):
    kvops.paged_cache_write(rope(key, cos, sin), value * 2, k_cache, v_cache, slot_mapping, cache_head_start,
                            k_scale, v_scale)


def random_bits(shape, dtype, seed):
    """A cache full of arbitrary bit patterns (NaN payloads, infinities, subnormals included)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 256, (*shape, dtype.itemsize), dtype=torch.uint8, generator=g)
    return bits.view(dtype).view(shape)


def same_bits(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


class TestPagedWriteLowering(FreshInductorCache):
    def test_rope_and_padded_write_fuse_into_one_kernel(self):
        """Padding (-1) before and between real slots, key with more rows than slot_mapping, K/V views of one
        [P, block_size, 2, H, D] allocation; float32 with int32 slots, bfloat16 with int64 slots."""
        num_blocks, block_size, h, d, rows = 4, 4, 2, 8, 7
        slots = [-1, 3, -1, 8, 6, 15]  # first real slot at token 1; row 6 of key is never read
        cos, sin = rope_tables(rows, d)
        for dtype, index_dtype in ((torch.float32, torch.int32), (torch.bfloat16, torch.int64)):
            torch.manual_seed(0)
            key, value = torch.randn(rows, h, d, dtype=dtype), torch.randn(rows, h, d, dtype=dtype)
            kv = random_bits((num_blocks, block_size, 2, h, d), dtype, seed=1)
            expected = kv.clone()
            slot_mapping = torch.tensor(slots, dtype=index_dtype)
            _, code = compiled(rope_write, key, value, cos, sin, kv[:, :, 0], kv[:, :, 1], slot_mapping)
            rope_write(key, value, cos, sin, expected[:, :, 0], expected[:, :, 1], slot_mapping)
            self.assertExpectedInline(code_facts(code), """cpp kernels: 1, kvops calls: 0""")
            self.assertTrue(same_bits(kv, expected), dtype)

    def test_all_padding_leaves_the_cache_bit_identical(self):
        num_blocks, block_size, h, d = 3, 2, 2, 4
        cos, sin = rope_tables(4, d)
        key, value = torch.randn(4, h, d, dtype=torch.bfloat16), torch.randn(4, h, d, dtype=torch.bfloat16)
        k_cache = random_bits((num_blocks, block_size, h, d), torch.bfloat16, seed=2)
        v_cache = random_bits((num_blocks, block_size, h, d), torch.bfloat16, seed=3)
        k_before, v_before = k_cache.clone(), v_cache.clone()
        _, code = compiled(rope_write, key, value, cos, sin, k_cache, v_cache, torch.full((4,), -1))
        self.assertExpectedInline(code_facts(code), """cpp kernels: 1, kvops calls: 0""")
        self.assertTrue(same_bits(k_cache, k_before) and same_bits(v_cache, v_before))

    def test_fp8_cache_head_slice_and_scales(self):
        """bfloat16 RoPE'd key quantized into a float8_e4m3fn cache: k_scale [1], v_scale [H_kv], values beyond
        ±448·scale (saturation), H_in=2 written at cache_head_start=1 of H_kv=4, block_size 1, caches as views of
        a [P, 2, block_size, H_kv, D] allocation (K/V not adjacent per token)."""
        num_blocks, block_size, h_kv, h_in, d, rows = 12, 1, 4, 2, 16, 6
        torch.manual_seed(0)
        key = torch.randn(rows, h_in, d, dtype=torch.bfloat16) * 300
        value = torch.randn(rows, h_in, d, dtype=torch.bfloat16) * 300
        cos, sin = rope_tables(rows, d)
        k_scale, v_scale = torch.tensor([0.75]), torch.tensor([0.5, 0.25, 2.0, 1.0])
        kv = random_bits((num_blocks, 2, block_size, h_kv, d), FP8, seed=4)
        expected = kv.clone()
        slot_mapping = torch.tensor([5, -1, 0, 11, -1], dtype=torch.int32)
        args = (cos, sin, kv[:, 0], kv[:, 1], slot_mapping, 1, k_scale, v_scale)
        # eager rounds the bf16 RoPE result before quantizing; Inductor does so under emulate_precision_casts (by
        # default it keeps the producer's fp32 value, as in its own fusion of ``x.float() / scale``)
        with torch._inductor.config.patch(emulate_precision_casts=True):
            _, code = compiled(rope_write, key, value, *args)
        rope_write(key, value, cos, sin, expected[:, 0], expected[:, 1], slot_mapping, 1, k_scale, v_scale)
        self.assertExpectedInline(code_facts(code), """cpp kernels: 1, kvops calls: 0""")
        self.assertTrue(same_bits(kv, expected))
        self.assertEqual(kv[5, 0, 0, 1:3].float().abs().max().item(), 448.0)  # saturated, not inf/NaN

    def test_token_count_is_dynamic(self):
        """Steps with 3, 5, 8, 4 tokens (key padded by 2 rows, some slots -1) compile at most twice."""

        def write(key, value, k_cache, v_cache, slot_mapping):
            kvops.paged_cache_write(key * 2, value, k_cache, v_cache, slot_mapping)

        num_blocks, block_size, h, d = 8, 4, 2, 8
        k_cache, v_cache = torch.zeros(num_blocks, block_size, h, d), torch.zeros(num_blocks, block_size, h, d)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("inductor")
        step = torch.compile(write, backend=counter, fullgraph=True)
        g = torch.Generator().manual_seed(0)
        for n in (3, 5, 8, 4):
            slot_mapping = torch.randperm(num_blocks * block_size, generator=g)[:n]
            slot_mapping[::3] = -1
            key, value = torch.randn(n + 2, h, d, generator=g), torch.randn(n + 2, h, d, generator=g)
            step(key, value, k_cache, v_cache, slot_mapping)
            write(key, value, k_ref, v_ref, slot_mapping)
            self.assertTrue(torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), n)
        self.assertLessEqual(counter.frame_count, 2)



def geometry_caches(layout, p, bs, h, d):
    """K/V caches ``[P, block_size, H, D]`` of one geometry, random bits; returns (caches, allocation to compare).

    joint_rows: ``unbind(2)`` of ``[P, bs, 2, H, D]``; joint_blocks: ``unbind(1)`` of ``[P, 2, bs, H, D]`` (FlashInfer);
    head_view: heads ``[1, 1 + H)`` of ``[P, bs, H + 2, D]`` caches; plain: two contiguous caches.
    """
    seed = p * 1000 + bs * 10 + h
    if layout == "joint_rows":
        kv = random_bits((p, bs, 2, h, d), torch.float32, seed)
        return kv.unbind(2), (kv,)
    if layout == "joint_blocks":
        kv = random_bits((p, 2, bs, h, d), torch.float32, seed)
        return kv.unbind(1), (kv,)
    if layout == "head_view":
        k, v = random_bits((p, bs, h + 2, d), torch.float32, seed), random_bits((p, bs, h + 2, d), torch.float32, seed + 1)
        return (k[:, :, 1 : 1 + h], v[:, :, 1 : 1 + h]), (k, v)
    k, v = random_bits((p, bs, h, d), torch.float32, seed), random_bits((p, bs, h, d), torch.float32, seed + 1)
    return (k, v), (k, v)


def scaled_write(key, value, k_cache, v_cache, slot_mapping):
    kvops.paged_cache_write(key * 0.5, value, k_cache, v_cache, slot_mapping)


class TestGeometryChanges(FreshInductorCache):
    """Recompiles after the cache geometry changes (blocks, then heads, then block_size) must run and
    write what eager writes, for K/V views of one allocation (the case that raised ``NameError: name 's20' is not
    defined`` from the generated wrapper), head-sliced and plain caches; with automatic dynamic shapes and with
    ``torch._dynamo.mark_dynamic``."""

    GEOMETRIES = ((4, 16, 2, 8), (64, 16, 2, 8), (64, 16, 4, 8), (12, 4, 4, 8))  # (P, block_size, H_kv, D)

    def run_geometries(self, layout, geometries, mark_dynamic=False):
        torch._dynamo.reset()
        step = torch.compile(scaled_write, fullgraph=True)
        for p, bs, h, d in geometries:
            n = min(40, p * bs - 3)
            (k_cache, v_cache), alloc = geometry_caches(layout, p, bs, h, d)
            (k_ref, v_ref), expected = geometry_caches(layout, p, bs, h, d)
            g = torch.Generator().manual_seed(p + h)
            slot_mapping = torch.randperm(p * bs, generator=g)[:n]
            slot_mapping[1::4] = -1
            key, value = torch.randn(n, h, d, generator=g), torch.randn(n, h, d, generator=g)
            if mark_dynamic:
                for t in (*alloc, key, value, slot_mapping):
                    torch._dynamo.mark_dynamic(t, 0)
            step(key, value, k_cache, v_cache, slot_mapping)
            scaled_write(key, value, k_ref, v_ref, slot_mapping)
            for got, want in zip(alloc, expected):
                self.assertTrue(same_bits(got, want), (layout, p, bs, h))

    def test_joint_rows_automatic_dynamic(self):
        self.run_geometries("joint_rows", self.GEOMETRIES)

    def test_joint_blocks_automatic_dynamic(self):
        self.run_geometries("joint_blocks", self.GEOMETRIES)

    def test_head_sliced_and_plain_automatic_dynamic(self):
        self.run_geometries("head_view", self.GEOMETRIES[:3])
        self.run_geometries("plain", self.GEOMETRIES[1:])

    def test_mark_dynamic(self):
        self.run_geometries("joint_blocks", ((6, 16, 2, 8), (64, 16, 2, 8)), mark_dynamic=True)
        self.run_geometries("joint_rows", ((6, 16, 2, 8), (64, 16, 2, 8)), mark_dynamic=True)


class TestHNDLowering(FreshInductorCache):
    def test_compiled_hnd_write(self):
        """The Inductor lowering indexes an HND cache (and a joint [P, 2, H, bs, D] allocation) like eager."""

        def write(key, value, k_cache, v_cache, slots):
            kvops.paged_cache_write(key * 0.5, value, k_cache, v_cache, slots, kv_layout="HND")

        p, bs, h, d, n = 4, 4, 2, 8, 7
        kv = torch.randn(p, 2, h, bs, d)
        expected = kv.clone()
        key, value = torch.randn(n, h, d), torch.randn(n, h, d)
        slots = torch.tensor([5, -1, 0, 13, 7, -1, 2])
        _, code = compiled(write, key, value, *kv.unbind(1), slots)
        write(key, value, *expected.unbind(1), slots)
        self.assertTrue(torch.equal(kv, expected))
        self.assertExpectedInline(code_facts(code), """cpp kernels: 1, kvops calls: 0""")



class TestGeneratedCode(FreshInductorCache):
    def test_store_loop_is_vectorized_over_heads_and_head_dim(self):
        """8 KV heads x 128 in bf16: one kernel, no kvops extern call; every store is a vector store but
        the batch reduction's (the routing is per token: no route table); no select in the store loops (a bf16 select
        runs in fp32, two conversions per element) and no bounds check (every destination is in bounds by
        construction); the V store (no producer) is a plain vector copy."""

        def write(key, value, k_cache, v_cache, slots):
            kvops.paged_cache_write(key * 0.5, value, k_cache, v_cache, slots)

        h, d = 8, 128
        key, value = torch.randn(6, h, d, dtype=torch.bfloat16), torch.randn(6, h, d, dtype=torch.bfloat16)
        k_cache, v_cache = torch.zeros(4, 16, h, d, dtype=torch.bfloat16), torch.zeros(4, 16, h, d, dtype=torch.bfloat16)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        slots = torch.tensor([3, -1, 40, 17, -1, 63])
        _, code = compiled(write, key, value, k_cache, v_cache, slots)
        write(key, value, k_ref, v_ref, slots)
        self.assertTrue(torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref))
        self.assertExpectedInline(code_facts(code), """cpp kernels: 1, kvops calls: 0""")
        scalar_stores = re.findall(r"^\s*out_ptr\d+\[[^\]]*\] = ", code, re.M)
        self.assertEqual(len(scalar_stores), 1)  # the batch reduction
        self.assertNotIn("VecMask<float", code)  # no select on values
        self.assertNotIn("index out of bounds", code)
        # the V store: its value is the loaded vector itself
        v_copy = re.search(r"auto (tmp\d+) = at::vec::Vectorized<at::BFloat16>::loadu\((in_ptr\d+) \+ "
                           r"static_cast<int64_t>\(x1 \+ 1024L\*x0\).*\n(?:.*\n)*?\s*auto (tmp\d+) = \(\1\);\n"
                           r"(?:.*\n)*?\s*\3\.store\(", code)
        self.assertIsNotNone(v_copy)

    def test_all_padding_keeps_special_values(self):
        """All-padding batch over a row (block 0, row 0) holding NaN payloads, infinities and the values around them:
        fp8 (all 256 patterns) and bf16 rows stay bit-identical (the row is restored from a bit copy)."""

        def write(key, value, k_cache, v_cache, slots, k_scale=None, v_scale=None):
            kvops.paged_cache_write(key * 2, value, k_cache, v_cache, slots, None, k_scale, v_scale)

        for dtype, bits, first in ((FP8, torch.uint8, 0), (torch.bfloat16, torch.int16, 0x7F80 - 1024)):
            n, d = (256, 32) if dtype == FP8 else (2048, 64)
            k_cache = torch.zeros(2, 2, n // d, d, dtype=bits)
            k_cache[0, 0] = (torch.arange(n) + first).view(n // d, d).to(bits)
            k_cache = k_cache.view(dtype)
            v_cache, before = k_cache.clone(), k_cache.clone()
            key = torch.randn(3, n // d, d).to(torch.float32 if dtype == FP8 else dtype)
            scales = (torch.tensor([1.0]), torch.tensor([1.0])) if dtype == FP8 else ()
            compiled(write, key, key, k_cache, v_cache, torch.tensor([-1, -1, -1]), *scales)
            for cache in (k_cache, v_cache):
                self.assertTrue(same_bits(cache, before), dtype)

    def test_row0_written_with_padding_and_skipped_batches(self):
        """The row every skipped token stores into (block 0, row 0) and is restored: written by a token of a padded
        batch (its value lands, in both layouts), and untouched by a batch skipped for a slot past the cache."""

        def write(key, value, k_cache, v_cache, slots, kv_layout):
            kvops.paged_cache_write(key * 2, value, k_cache, v_cache, slots, kv_layout=kv_layout)

        for kv_layout in ("NHD", "HND"):
            torch._dynamo.reset()
            step = torch.compile(write, fullgraph=True)
            shape = (3, 4, 2, 8) if kv_layout == "NHD" else (3, 2, 4, 8)  # 3 blocks x block_size 4 x 2 heads
            k_cache, v_cache = random_bits(shape, torch.bfloat16, seed=5), random_bits(shape, torch.bfloat16, seed=6)
            key, value = torch.randn(5, 2, 8, dtype=torch.bfloat16), torch.randn(5, 2, 8, dtype=torch.bfloat16)
            for slots in ([-1, 7, 0, -1, 5], [-1, 7, 0, 12, 5]):  # padding + slot 0; a slot past the cache (12)
                expect_k, expect_v = k_cache.clone(), v_cache.clone()
                slot_mapping = torch.tensor(slots)
                if 12 not in slots:
                    write(key, value, expect_k, expect_v, slot_mapping, kv_layout)
                with kvops.value_checks("off"):
                    step(key, value, k_cache, v_cache, slot_mapping, kv_layout)
                self.assertTrue(same_bits(k_cache, expect_k) and same_bits(v_cache, expect_v), (kv_layout, slots))


if __name__ == "__main__":
    expecttest.run_tests() if hasattr(expecttest, "run_tests") else __import__("unittest").main()
