"""kvops.quantize_kv / kvops.dequantize_kv: every format against a plain fp32 reference, error bounds, exact round
trips of the codes, contracts in every mode, opcheck."""

from __future__ import annotations

import itertools
import unittest

import expecttest
import torch

from kvops.packed import FORMATS, default_group_size, dequantize_kv, empty_packed
from kvops.packed import packed_layout, quantize_kv
from kvops.cpu import packed as kernels
from kvops.reference import packed as oracle
from tests.contract import raises_everywhere


def kv_like(b, t, h, d, seed=0, dtype=torch.float32):
    """Synthetic K: Gaussian tokens, a few outlier channels (x20, as KIVI/QVG observe in K), clustered tokens."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(b, 4, h, d, generator=g) * 2
    ids = torch.randint(0, 4, (t,), generator=g)
    x = centers[:, ids] + 0.5 * torch.randn(b, t, h, d, generator=g)
    x[..., : max(1, d // 16)] *= 20
    return x.to(dtype)


def ref_int8(x):
    """Loop reference: per (b, t, h) scale fp16(max|x| / 127), codes round-half-even(x / scale)."""
    b, t, h, _ = x.shape
    codes, scales = torch.empty(x.shape, dtype=torch.int8), torch.empty(b, t, h, dtype=torch.float16)
    for i, j, k in itertools.product(range(b), range(t), range(h)):
        row = x[i, j, k].float()
        s = torch.tensor(max(row.abs().max().item() / 127.0, 2.0**-14), dtype=torch.float32).half().float()
        codes[i, j, k] = torch.round(row / s).clamp(-127, 127).to(torch.int8)
        scales[i, j, k] = s
    return codes, scales


def ref_int4(x, group):
    """Loop reference: per (b, t, h, group) scale = fp16(max((max - min) / 15, |min| / 15.875)), int8 zero point in
    eighths of a step zero = round(-8 · min / scale), codes = round(x / scale + zero / 8) in [0, 15]."""
    b, t, h, d = x.shape
    codes = torch.empty(b, t, h, d, dtype=torch.uint8)
    scales = torch.empty(b, t, h, d // group, dtype=torch.float16)
    zeros = torch.empty(b, t, h, d // group, dtype=torch.int8)
    for i, j, k, gi in itertools.product(range(b), range(t), range(h), range(d // group)):
        seg = x[i, j, k, gi * group : (gi + 1) * group].float()
        lo, hi = seg.min(), seg.max()
        s = torch.maximum((hi - lo) / 15, lo.abs() / 15.875).clamp(2.0**-14, 65504).half().float()
        z = torch.round(-lo / s * 8).clamp(-128, 127)
        codes[i, j, k, gi * group : (gi + 1) * group] = torch.round(seg / s + z / 8).clamp(0, 15).to(torch.uint8)
        scales[i, j, k, gi], zeros[i, j, k, gi] = s, z
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, scales, zeros


class TestQuantizeReference(unittest.TestCase):
    def test_int8_matches_loop_reference(self):
        for dtype, d in itertools.product((torch.float32, torch.bfloat16, torch.float16), (64, 80)):
            x = kv_like(2, 5, 3, d, dtype=dtype)
            p = quantize_kv(x, "int8")
            codes, scales = ref_int8(x)
            self.assertTrue(torch.equal(p.codes, codes))
            self.assertTrue(torch.equal(p.scales, scales))
            y = dequantize_kv(p, torch.float32)
            bound = scales.float()[..., None] / 2 * (1 + 1e-6)
            self.assertTrue(bool(((y - x.float()).abs() <= bound).all()))

    def test_int4_matches_loop_reference(self):
        for group, d in ((32, 64), (64, 128), (128, 128), (80, 80)):
            x = kv_like(1, 4, 2, d, seed=group)
            p = quantize_kv(x, "int4", group_size=group)
            codes, scales, zeros = ref_int4(x, group)
            self.assertTrue(torch.equal(p.codes, codes))
            self.assertTrue(torch.equal(p.scales, scales) and torch.equal(p.zeros, zeros))
            y = dequantize_kv(p, torch.float32)
            # half a step: codes are round(x / scale + zero / 8), and the range fits 15 steps up to the fp16 rounding
            # of the scale and the zero's 1/16-step rounding (at most 15 · 2^-11 + 1/16 of a step at the max side)
            bound = (scales.float() * 0.5).repeat_interleave(group, -1) + x.abs() * 2.0**-22  # + fp32 rounding
            # the group minimum is reproduced to within 1/16 of a step (the zero point's resolution)
            lo = x.unflatten(-1, (-1, group)).amin(-1)
            lo_hat = -zeros.float() / 8 * scales.float()
            self.assertTrue(bool(((lo_hat - lo).abs() <= scales.float() / 16 * (1 + 1e-5)).all()))
            self.assertTrue(bool(((y - x).abs() <= bound).all()))

    def test_fp8_per_head_scale(self):
        x = kv_like(2, 7, 3, 64)
        p = quantize_kv(x, "fp8")
        scale = x.abs().amax(dim=(1, 3)) / 448  # [B, H]
        self.assertTrue(torch.equal(p.scales, scale))
        expect = (x / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        self.assertTrue(torch.equal(p.codes.view(torch.uint8), expect.view(torch.uint8)))
        y = dequantize_kv(p, torch.float32)
        # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormals below 2^-6 (absolute step 2^-9 · scale)
        bound = x.abs() * 2.0**-4 + scale[:, None, :, None] * 2.0**-10
        self.assertTrue(bool(((y - x).abs() <= bound * (1 + 1e-6)).all()))

    def test_round_trip_of_codes_is_exact(self):
        x = kv_like(2, 6, 3, 128, seed=3)
        for quant in ("int8", "fp8", "int4"):
            p = quantize_kv(x, quant)
            again = quantize_kv(dequantize_kv(p, torch.float32), quant)
            for a, b in zip(p.tensors(), again.tensors()):
                self.assertTrue(torch.equal(a.view(torch.uint8), b.view(torch.uint8)), quant)
        for bits in (2, 4):
            c = torch.randint(0, 2**bits, (3, 5, 64), dtype=torch.uint8)
            self.assertTrue(torch.equal(kernels._unpack(kernels._pack(c, bits), bits).to(torch.uint8), c))


class TestOracle(unittest.TestCase):
    def test_kernels_dequantize_as_the_oracle(self):
        """kvops.dequantize_kv (fp32 math) against the fp64 oracle of kvops/reference/packed.py, every format, at odd
        shapes (3 tokens, 3 heads, head_dim 80 / 48)."""
        for quant, d in itertools.product(FORMATS, (80, 48)):
            with self.subTest(quant=quant, head_dim=d):
                packed = quantize_kv(kv_like(2, 3, 3, d, seed=d), quant)
                got = dequantize_kv(packed, torch.float32).double()
                torch.testing.assert_close(got, oracle.dequantize(packed), rtol=1e-6, atol=1e-6)

    def test_unpack_reads_the_low_bits_first(self):
        packed = torch.tensor([0b11100100], dtype=torch.uint8)
        self.assertEqual(oracle.unpack(packed, 2).tolist(), [0, 1, 2, 3])
        self.assertEqual(oracle.unpack(packed, 4).tolist(), [0b0100, 0b1110])


class TestInt2PRQ(unittest.TestCase):
    def test_kmeans_assigns_nearest_and_is_deterministic(self):
        x = kv_like(1, 96, 2, 64, seed=5)
        p = quantize_kv(x, "int2", num_clusters=8, kmeans_iters=5)
        q = quantize_kv(x, "int2", num_clusters=8, kmeans_iters=5)
        self.assertTrue(all(torch.equal(a, b) for a, b in zip(p.tensors(), q.tensors())))
        cent = p.centroids.float()  # [B, H, C, D]
        for h in range(2):
            dist = torch.cdist(x[0, :, h].double(), cent[0, h].double())  # [T, C]
            chosen = dist.gather(1, p.cluster_ids[0, :, h].long()[:, None])[:, 0]
            # the stored centroids are fp16-rounded after assignment: allow that rounding's effect on distances
            self.assertTrue(bool((chosen <= dist.min(1).values * (1 + 1e-3) + 1e-2).all()))
        init = kernels.kmeans(x[0].permute(1, 0, 2).float(), 8, 0)[0]
        self.assertTrue(torch.equal(init, x[0].permute(1, 0, 2)[:, torch.arange(8) * 96 // 8]))

    def test_progressive_stages_shrink_the_error(self):
        x = kv_like(1, 64, 2, 128, seed=6)
        errors = []
        for stages in (1, 2, 3):
            p = quantize_kv(x, "int2", stages=stages, group_size=32)
            y = dequantize_kv(p, torch.float32)
            # the last stage's rounding bounds the error: half its step per group (+ fp16 rounding of the scale)
            last = p.scales[:, :, :, -1].float().repeat_interleave(32, -1)
            self.assertTrue(bool(((y - x).abs() <= last * (0.5 + 3 * 2.0**-11) + 1e-5).all()))
            errors.append(((y - x) ** 2).mean().item())
        self.assertLess(errors[1], errors[0] / 4)
        self.assertLess(errors[2], errors[1] / 4)

    def test_dequantize_is_centroid_plus_stages(self):
        x = kv_like(2, 20, 3, 64, seed=7)
        p = quantize_kv(x, "int2", stages=2, num_clusters=4)
        expect = torch.empty_like(x)
        for b, t, h in itertools.product(range(2), range(20), range(3)):
            row = p.centroids[b, h, p.cluster_ids[b, t, h].long()].float()
            for s in range(2):
                byte = p.codes[b, t, h, s].long()
                codes = torch.stack([(byte >> (2 * i)) & 3 for i in range(4)], -1).flatten()
                zero = p.zeros[b, t, h, s].float().repeat_interleave(64) / 8
                row = row + (codes - zero) * p.scales[b, t, h, s].float().repeat_interleave(64)
            expect[b, t, h] = row
        torch.testing.assert_close(dequantize_kv(p, torch.float32), expect, rtol=1e-6, atol=1e-6)


class TestContracts(expecttest.TestCase):
    def test_quantize_errors(self):
        x = torch.randn(1, 4, 2, 64)
        p = empty_packed("int4", 1, 4, 2, 64)
        msg = raises_everywhere(
            self, ValueError, lambda x, c, s, z: torch.ops.kvops.quantize_kv(x, c, s, z, None, None, "int3"),
            (x, p.codes, p.scales, p.zeros),
        )
        self.assertExpectedInline(msg, """kvops.quantize_kv: quant must be one of ('int8', 'fp8', 'int4', 'int2'), got 'int3'.""")
        bad = torch.empty(1, 4, 2, 32, dtype=torch.int8)
        msg = raises_everywhere(
            self, ValueError, lambda x, c, s, z: torch.ops.kvops.quantize_kv(x, c, s, z, None, None, "int4"),
            (x, bad, p.scales, p.zeros),
        )
        self.assertExpectedInline(msg, """kvops.quantize_kv: codes must be torch.uint8 of shape (1, 4, 2, 32) for quant='int4' (x of shape (1, 4, 2, 64), group_size 64); got torch.int8 of shape (1, 4, 2, 32). Allocate it from kvops.packed.packed_layout(...).""")
        s3 = torch.empty(1, 4, 2, 3, dtype=torch.float16)
        msg = raises_everywhere(
            self, ValueError, lambda x, c, s: torch.ops.kvops.quantize_kv(x, c, s, s, None, None, "int4"),
            (x, p.codes, s3),
        )
        self.assertExpectedInline(msg, """kvops.quantize_kv: scales' last dim (3 groups) must divide head_dim 64 for quant='int4'.""")

    def test_dequantize_errors(self):
        p = empty_packed("int2", 1, 4, 2, 64, stages=2)
        msg = raises_everywhere(
            self, ValueError, lambda c, s, z, m: torch.ops.kvops.dequantize_kv(c, s, z, m, None, "int2", torch.float32),
            (p.codes, p.scales, p.zeros, p.centroids),
        )
        self.assertExpectedInline(msg, """kvops.dequantize_kv: quant='int2' needs cluster_ids (torch.uint8, shape (1, 4, 2)); got None.""")
        msg = raises_everywhere(
            self, ValueError, lambda c, s: torch.ops.kvops.dequantize_kv(c, s, None, None, None, "int8", torch.int32),
            (p.codes[:, :, :, 0], p.scales[:, :, :, 0, 0]),
        )
        self.assertExpectedInline(msg, """kvops.dequantize_kv: dtype must be one of (torch.float32, torch.bfloat16, torch.float16), got torch.int32.""")

    def test_layout_bytes(self):
        """The byte targets at Quant VideoGen's chunk (3 x 1560 tokens), head_dim 64 and 128, vs bf16, with the
        exact per-format arithmetic of packed_layout's docstring."""
        t = 3 * 1560

        def ratio(quant, d, **fmt):
            specs = packed_layout(quant, 1, t, 1, d, **fmt)
            nbytes = sum(torch.Size(s.shape).numel() * s.dtype.itemsize for s in specs.values() if s is not None)
            return nbytes / (t * d * 2)

        for d in (64, 128):
            self.assertEqual(ratio("int8", d), (d + 2) / (2 * d))
            self.assertLessEqual(ratio("fp8", d), 0.53)
            for g in (32, 64, 128):
                if g <= d:
                    self.assertEqual(ratio("int4", d, group_size=g), (d / 2 + 3 * d / g) / (2 * d))
                    self.assertLessEqual(ratio("int4", d, group_size=g), 0.30)
            default = dict(group_size=default_group_size(d), stages=1, num_clusters=16)
            self.assertAlmostEqual(ratio("int2", d, **default), (d / 4 + 3 * d / 64 + 1 + 2 * 16 * d / t) / (2 * d))
            self.assertLessEqual(ratio("int2", d, **default), 0.18)
            self.assertGreater(ratio("int2", d, **{**default, "stages": 2}), 0.25)  # 4 bits per value: never <= 0.25
        self.assertLessEqual(ratio("int8", 128), 0.53)

    def test_integer_zero_point_of_an_offset_group(self):
        # a group far from zero with a tiny range: the zero point stays in int8 (scale >= |min| / 15.875), error <=
        # half a step
        x = torch.full((1, 2, 1, 64), 100.0)
        x[0, 1, 0, :32] = -3.0 + 0.001 * torch.arange(32)
        p = quantize_kv(x, "int4", group_size=32)
        self.assertEqual(p.zeros.dtype, torch.int8)
        step = p.scales.float().repeat_interleave(32, -1)
        self.assertTrue(bool(((dequantize_kv(p, torch.float32) - x).abs() <= step * (0.5 + 2.0**-10)).all()))
        self.assertLessEqual(float(p.scales[0, 0, 0, 0]), 100 / 15.875 * (1 + 2.0**-10))
        self.assertEqual(int(p.zeros[0, 0, 0, 0]), -127)

    def test_opcheck(self):
        x = kv_like(2, 6, 3, 64, dtype=torch.bfloat16)
        for quant in FORMATS:
            p = empty_packed(quant, 2, 6, 3, 64, group_size=32, stages=2, num_clusters=4)
            # opcheck's schema test compares fp8 tensors with a mul that torch has no CPU kernel for on
            # float8_e4m3fn, so the fp8 outputs run the other checks only
            utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
            kw = {"test_utils": utils} if quant == "fp8" else {}
            torch.library.opcheck(torch.ops.kvops.quantize_kv.default, (x, *p[1:], quant, 2), **kw)
            quantize_kv(x, quant, out=p)
            torch.library.opcheck(torch.ops.kvops.dequantize_kv.default, (*p[1:], quant, torch.bfloat16), **kw)


if __name__ == "__main__":
    unittest.main()
