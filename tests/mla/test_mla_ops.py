"""``kvops.mla_cache_write`` and ``kvops.mla_attention`` against the fp64 oracle (``kvops/reference/mla.py``).

Odd shapes: kv_lora_rank 32 and 512, rope_dim 16 and 64, block_size 1 and 16, one latent head for 4 and 128 query
heads (MQA), empty sequences and sequences whose causal positions start below 0, decode and chunked prefill in one
batch, strided caches, fp32/bf16/fp16 and fp8 e4m3 with a per-tensor scale. Writes are bit-exact.
"""

import unittest

import torch

import kvops
from kvops.reference import mla as ref
from tests.mla._cases import FP8, filled_cache, slots_of, tables, batch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# test_schema is left out for fp8 caches: it multiplies the arguments, and torch has no fp8 mul on CPU.
UTILS_FP8 = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
ALL_UTILS = UTILS_FP8 + ("test_schema",)
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


class TestWrite(unittest.TestCase):
    def check(self, rank, rope, block_size, dtype, *, fp8=False, rotary=None, strided=False, n=11):
        g = torch.Generator().manual_seed(rank + rope + block_size)
        num_blocks = -(-n // block_size) + 2
        width = rank + rope
        if strided:  # the latent rows inside a wider per-block allocation: not mergeable, written in place
            base = torch.zeros(num_blocks, block_size, width + 5, dtype=FP8 if fp8 else dtype)
            kv_cache = base[:, :, 3 : 3 + width]
        else:
            kv_cache = torch.zeros(num_blocks, block_size, width, dtype=FP8 if fp8 else dtype)
        slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
        slots[2] = -1
        kv_c = torch.randn(n + 2, rank, generator=g).to(dtype)  # rows past N are ignored
        k_pe = torch.randn(n + 2, rope, generator=g).to(dtype)
        scale = torch.tensor(0.05) if fp8 else None
        kw = {}
        if rotary is not None:
            cos, sin = tables(40, rope if rotary == "full" else rope // 2, dtype)
            kw = dict(positions=torch.randint(0, 40, (n,), generator=g), rotary_cos=cos, rotary_sin=sin,
                      rotary_interleaved=True)
        want = ref.mla_cache_write(kv_c, k_pe, kv_cache, slots, scale, **kw)
        kvops.mla_cache_write(kv_c, k_pe, kv_cache, slots, kv_scale=scale, **kw)
        if kw:
            # RoPE in fp32 rounded once: within a unit in the last place of the fp64 oracle's (the fp8 one's)
            tol = (0.13, 1e-2) if fp8 else (1e-6, 1e-6) if dtype == torch.float32 else (1e-2, 1e-3)
            torch.testing.assert_close(kv_cache.float(), want.float(), rtol=tol[0], atol=tol[1])
            self.assertTrue(torch.equal(kv_cache[..., :rank].view(torch.uint8), want[..., :rank].view(torch.uint8)))
        else:
            self.assertTrue(torch.equal(kv_cache.view(torch.uint8), want.view(torch.uint8)))  # bit-exact
        if strided:
            self.assertTrue((base[:, :, :3] == 0).all() and (base[:, :, 3 + width :] == 0).all())

    def test_dtypes_and_shapes(self):
        for dtype in DTYPES:
            for rank, rope, block_size in ((32, 16, 1), (512, 64, 16), (32, 16, 16)):
                with self.subTest(dtype=dtype, rank=rank, rope=rope, block_size=block_size):
                    self.check(rank, rope, block_size, dtype)

    def test_fp8_per_tensor_scale(self):
        for dtype in DTYPES:
            with self.subTest(dtype=dtype):
                self.check(32, 16, 16, dtype, fp8=True)
        self.check(512, 64, 1, torch.bfloat16, fp8=True, strided=True)

    def test_strided_cache(self):
        self.check(32, 16, 16, torch.float32, strided=True)

    def test_rotary_fused(self):
        self.check(32, 16, 16, torch.float32, rotary="full")
        self.check(32, 16, 1, torch.float32, rotary="partial")
        self.check(512, 64, 16, torch.bfloat16, rotary="full")
        self.check(32, 16, 16, torch.float16, rotary="full", fp8=True)

    def test_rotary_matches_the_rotary_write(self):
        """The fused RoPE is ``kvops.apply_rotary``'s (so mla-fused and separate rotations agree bit for bit)."""
        cos, sin = tables(30, 16)
        k_pe, kv_c = torch.randn(5, 16), torch.randn(5, 32)
        pos = torch.tensor([0, 3, 29, 7, 7])
        kv_cache = torch.zeros(2, 4, 48)
        kvops.mla_cache_write(kv_c, k_pe, kv_cache, torch.arange(5), positions=pos, rotary_cos=cos, rotary_sin=sin)
        want = kvops.apply_rotary(k_pe[:, None], cos, sin, pos)[:, 0]
        self.assertTrue(torch.equal(kv_cache.view(-1, 48)[:5, 32:], want))

    def test_bad_slot_changes_nothing(self):
        kv_cache = torch.zeros(2, 4, 48)
        for mode in ("eager", "off"):
            with kvops.value_checks(mode), self.subTest(mode=mode):
                with self.assertRaises(RuntimeError if mode == "eager" else IndexError) as cm:
                    kvops.mla_cache_write(torch.ones(3, 32), torch.ones(3, 16), kv_cache, torch.tensor([0, 8, 1]))
                self.assertIn("slot", str(cm.exception))
                self.assertTrue((kv_cache == 0).all())

    def test_bad_position_changes_nothing(self):
        kv_cache = torch.zeros(2, 4, 48)
        cos, sin = tables(8, 16)
        for mode in ("eager", "off"):
            with kvops.value_checks(mode), self.subTest(mode=mode):
                with self.assertRaises(RuntimeError if mode == "eager" else IndexError) as cm:
                    kvops.mla_cache_write(torch.ones(2, 32), torch.ones(2, 16), kv_cache, torch.tensor([0, 1]),
                                          positions=torch.tensor([3, 8]), rotary_cos=cos, rotary_sin=sin)
                self.assertIn("positions[1] = 8 is outside [0, 8)", str(cm.exception))
                self.assertTrue((kv_cache == 0).all())

    def test_empty_and_all_skipped(self):
        kv_cache = torch.zeros(2, 4, 48)
        kvops.mla_cache_write(torch.ones(0, 32), torch.ones(0, 16), kv_cache, torch.zeros(0, dtype=torch.int64))
        kvops.mla_cache_write(torch.ones(2, 32), torch.ones(2, 16), kv_cache, torch.tensor([-1, -5]))
        self.assertTrue((kv_cache == 0).all())

    def test_source_aliasing_the_cache(self):
        """kv_c a view of the cache's own rows, rewritten to other slots: read before anything is written."""
        kv_cache = torch.randn(2, 4, 48)
        flat = kv_cache.view(8, 48)
        kv_c, k_pe = flat[0:3, :32], flat[0:3, 32:]
        want = ref.mla_cache_write(kv_c.clone(), k_pe.clone(), kv_cache, torch.tensor([1, 2, 3]))
        kvops.mla_cache_write(kv_c, k_pe, kv_cache, torch.tensor([1, 2, 3]))
        self.assertTrue(torch.equal(kv_cache, want))

    def test_opcheck(self):
        cos, sin = tables(20, 16)
        for fp8 in (False, True):
            kv_cache = torch.zeros(3, 4, 48, dtype=FP8 if fp8 else torch.float32)
            args = (torch.randn(5, 32), torch.randn(5, 16), kv_cache, torch.tensor([0, 5, -1, 11, 2]),
                    torch.tensor(0.1) if fp8 else None, torch.tensor([1, 2, 3, 4, 19]), cos, sin, False)
            torch.library.opcheck(torch.ops.kvops.mla_cache_write.default, args, test_utils=UTILS_FP8 if fp8 else
                                  ALL_UTILS)


class TestAttention(unittest.TestCase):
    def check(self, seq_lens, q_lens, rank, rope, block_size, heads, dtype, *, causal=True, fp8=False, scale=None,
              strided=False):
        scale_t = torch.tensor(0.04) if fp8 else None
        kv_cache, cu, lens, table = filled_cache(seq_lens, q_lens, block_size, rank, rope, dtype, kv_scale=scale_t)
        if strided:  # the same rows inside a wider allocation
            wide = torch.full((*kv_cache.shape[:2], rank + rope + 7), float("nan")).to(kv_cache.dtype)
            wide[:, :, 2 : 2 + rank + rope] = kv_cache
            kv_cache = wide[:, :, 2 : 2 + rank + rope]
        g = torch.Generator().manual_seed(7)
        q = torch.randn(int(cu[-1]), heads, rank + rope, generator=g).to(dtype)
        max_q = max(q_lens + [1])
        out, lse = kvops.mla_attention(q, kv_cache, cu, lens, table, max_q, rank, scale=scale, causal=causal,
                                       kv_scale=scale_t)
        self.assertEqual(out.dtype, dtype)
        self.assertEqual(tuple(out.shape), (q.shape[0], heads, rank))
        self.assertEqual(tuple(lse.shape), (heads, q.shape[0]))
        want, want_lse = ref.mla_attention(q, kv_cache, cu, lens, table, rank, scale=scale, causal=causal,
                                           kv_scale=scale_t)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(out.double(), want, atol=atol, rtol=rtol)
        torch.testing.assert_close(lse.double(), want_lse, atol=atol, rtol=rtol)
        return out, lse

    def test_tiny_mixed_batch(self):
        """Decode rows, chunked prefill, an empty sequence, and a sequence with more queries than keys."""
        for dtype in DTYPES:
            for block_size in (1, 16):
                with self.subTest(dtype=dtype, block_size=block_size):
                    out, lse = self.check([5, 0, 17, 3, 1], [1, 0, 6, 3, 3], 32, 16, block_size, 4, dtype)
                    # the last sequence's first two queries sit at positions -2, -1: no key, out 0, lse -inf
                    self.assertTrue((out[-3:-1] == 0).all() and (lse[:, -3:-1] == float("-inf")).all())

    def test_decode_batch(self):
        """Decode batches (one query per sequence, lengths alike: the batched path; skewed: per sequence), NaN in
        every unused slot, an empty sequence among them."""
        for dtype in DTYPES:
            for block_size in (1, 16):
                with self.subTest(dtype=dtype, block_size=block_size):
                    self.check([9, 12, 0, 11, 10], [1, 1, 1, 1, 1], 32, 16, block_size, 4, dtype)
                    self.check([9, 40, 3], [1, 1, 1], 32, 16, block_size, 4, dtype, causal=False)
        self.check([30, 33], [1, 1], 32, 16, 16, 4, torch.bfloat16, fp8=True)
        self.check([30, 33, 31], [1, 1, 1], 512, 64, 16, 128, torch.float32, scale=192 ** -0.5)

    def test_not_causal(self):
        self.check([9, 4], [3, 4], 32, 16, 4, 4, torch.float32, causal=False, scale=0.3)

    def test_deepseek_geometry(self):
        """128 query heads, kv_lora_rank 512, rope 64 (DeepSeek-V3), scale (128 + 64) ** -0.5."""
        self.check([33, 70], [1, 5], 512, 64, 16, 128, torch.float32, scale=192 ** -0.5)
        self.check([20], [1], 512, 64, 1, 128, torch.bfloat16, scale=192 ** -0.5)

    def test_fp8(self):
        for dtype in DTYPES:
            with self.subTest(dtype=dtype):
                self.check([7, 12], [2, 1], 32, 16, 4, 4, dtype, fp8=True)
        self.check([40], [3], 512, 64, 16, 16, torch.bfloat16, fp8=True)

    def test_strided_cache(self):
        self.check([7, 12], [2, 12], 32, 16, 4, 4, torch.float32, strided=True)

    def test_empty_batch_and_padding_rows(self):
        kv_cache = torch.zeros(2, 4, 48)
        cu = torch.tensor([0, 2], dtype=torch.int32)
        lens = torch.tensor([3], dtype=torch.int32)
        table = torch.tensor([[1]], dtype=torch.int32)
        kv_cache[1, :3] = torch.randn(3, 48)
        q = torch.randn(5, 4, 48)  # rows 2..4 belong to no sequence: 0 and -inf
        out, lse = kvops.mla_attention(q, kv_cache, cu, lens, table, 2, 32)
        self.assertTrue((out[2:] == 0).all() and (lse[:, 2:] == float("-inf")).all())
        want, want_lse = ref.mla_attention(q, kv_cache, cu, lens, table, 32)
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)
        empty = torch.zeros(0, 4, 48)
        out, lse = kvops.mla_attention(empty, kv_cache, torch.zeros(1, dtype=torch.int32),
                                       torch.zeros(0, dtype=torch.int32), torch.zeros(0, 1, dtype=torch.int32), 0, 32)
        self.assertEqual((tuple(out.shape), tuple(lse.shape)), ((0, 4, 32), (4, 0)))

    def test_long_prefill_is_tiled(self):
        """A prefill whose scores exceed one tile (query tiles, causal key cut) matches the oracle."""
        from kvops.cpu import mla as cpu

        old = cpu._SCORE_BUDGET
        cpu._SCORE_BUDGET = 4 * 4 * 24  # 4 heads x 24 keys: 4-query tiles
        try:
            self.check([24, 10], [24, 3], 32, 16, 4, 4, torch.float32)
        finally:
            cpu._SCORE_BUDGET = old

    def test_bad_block_id_is_refused(self):
        kv_cache, cu, lens, table = filled_cache([5], [1], 4, 32, 16, torch.float32)
        table[0, 1] = 99
        with self.assertRaises(RuntimeError) as cm:
            kvops.mla_attention(torch.randn(1, 4, 48), kv_cache, cu, lens, table, 1, 32)
        self.assertIn("kvops.mla_attention", str(cm.exception))
        self.assertIn("block_table[0, 1]", str(cm.exception))

    def test_opcheck(self):
        for dtype, fp8 in ((torch.float32, False), (torch.bfloat16, False), (torch.float16, True)):
            scale_t = torch.tensor(0.04) if fp8 else None
            kv_cache, cu, lens, table = filled_cache([5, 0, 9], [1, 0, 4], 4, 32, 16, dtype, kv_scale=scale_t,
                                                     garbage=0.0)
            q = torch.randn(int(cu[-1]), 4, 48).to(dtype)
            torch.library.opcheck(torch.ops.kvops.mla_attention.default,
                                  (q, kv_cache, cu, lens, table, 4, 32, 0.2, True, scale_t),
                                  test_utils=UTILS_FP8 if fp8 else ALL_UTILS)

    def test_export_write_then_attend(self):
        """``torch.export`` of a step that writes the new rows and attends: the exported program gives eager's
        output and cache."""
        class Step(torch.nn.Module):
            def forward(self, kv_c, k_pe, kv_cache, slots, q, cu, lens, table):
                kvops.mla_cache_write(kv_c, k_pe, kv_cache, slots)
                return kvops.mla_attention(q, kv_cache, cu, lens, table, 1, 32, scale=0.3)[0]

        kv_cache, cu, lens, table = filled_cache([5, 9], [1, 1], 4, 32, 16, torch.float32)
        slots = torch.stack([table[0, 1].long() * 4 + 1, table[1, 2].long() * 4 + 1])  # rows 5 and 9
        args = (torch.randn(2, 32), torch.randn(2, 16), kv_cache, slots, torch.randn(2, 4, 48), cu, lens + 1, table)
        ep = torch.export.export(Step(), tuple(a.clone() for a in args))
        mine = [a.clone() for a in args]
        out = ep.module()(*mine)
        want = Step()(*args)
        self.assertTrue(torch.equal(out, want))
        self.assertTrue(torch.equal(mine[2].view(torch.int32), args[2].view(torch.int32)))  # (NaN in unused slots)

    def test_compiled_matches_eager_without_recompiling(self):
        kv_cache, cu, lens, table = filled_cache([5, 9], [1, 1], 4, 32, 16, torch.float32)
        q = torch.randn(2, 4, 48)
        torch._dynamo.reset()
        counts = []

        def backend(gm, example_inputs):
            counts.append(1)
            return gm

        f = torch.compile(lambda q, c, cu, s, t: kvops.mla_attention(q, c, cu, s, t, 1, 32), backend=backend,
                          fullgraph=True)
        for step in range(3):
            lens2 = lens - step  # rows [0, lens) hold written values
            out, _ = f(q, kv_cache, cu, lens2, table)
            want, _ = kvops.mla_attention(q, kv_cache, cu, lens2, table, 1, 32)
            self.assertTrue(torch.equal(out, want))
        self.assertEqual(len(counts), 1)


if __name__ == "__main__":
    unittest.main()
