"""kvops.packed_attention: the fused op over dense + packed segments against a plain fp64 reference over the
dequantized window (native CPU kernel and composite), odd shapes, contracts in every mode, opcheck, compile."""

from __future__ import annotations

import unittest
import warnings

import expecttest
import torch

from kvops import native
from kvops.cache import PackedCausalKVCache
from kvops.packed import FORMATS, materialize, packed_attention, quantize_kv
from kvops.cpu import packed as composite
from kvops.reference import packed as oracle
from kvops.ops.packed_attention import _split
from tests.contract import raises_everywhere
from tests.packed.test_packed_ops import kv_like


reference = oracle.attention  # fp64 softmax attention, GQA: (out, LSE [B, H_q, T])
dense_window = oracle.window  # the window in fp64 (packed segments dequantized by the oracle)


def streamed_view(quant, heads, dim, dtype, chunks=6, **kwargs):
    c = PackedCausalKVCache.allocate(2, 16, heads, dim, chunk_tokens=3, quant=quant, keep_recent_chunks=1,
                                     sink_tokens=2, dtype=dtype, **kwargs)
    g = torch.Generator().manual_seed(0)
    for i in range(chunks):
        x = torch.randn(2, 3, heads, dim, generator=g).to(dtype)
        view = c.update(x, x * 0.5 + 1, 3 * i)
    return view


def window(quant, b, hkv, d, lengths, d_v=None, seed=0, dtype=torch.float32, **fmt):
    """K/V segments: dense ones of ``dtype`` for the first two lengths, packed ``quant`` ones for the rest (each
    quantized separately, like a cache's chunks); K with outlier channels and clusters (``kv_like``, x0.1: logits of a
    few units, so fp32 rounding stays near 1e-6)."""
    d_v = d if d_v is None else d_v
    ks, vs = [], []
    for i, n in enumerate(lengths):
        k, v = kv_like(b, n, hkv, d, seed=seed + i) * 0.1, kv_like(b, n, hkv, d_v, seed=seed + 50 + i) * 0.3
        if i < 2 or quant is None:
            ks.append(k.to(dtype))
            vs.append(v.to(dtype))
        else:
            ks.append(quantize_kv(k, quant, **fmt))
            vs.append(quantize_kv(v, quant, **fmt))
    return ks, vs


class TestFusedAgainstReference(unittest.TestCase):
    def check(self, q, ks, vs, scale=None, tol=1e-5):
        out, lse = packed_attention(q, ks, vs, scale=scale, return_lse=True)
        want, want_lse = reference(q, dense_window(ks), dense_window(vs), scale)
        self.assertEqual(out.dtype, q.dtype)
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(lse.double(), want_lse, rtol=tol, atol=tol)
        kd, kp = _split(ks)
        vd, vp = _split(vs)
        quant = next((s.quant for s in ks if not isinstance(s, torch.Tensor)), None)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        c_out, c_lse = composite.packed_attention(q.float(), [k.float() for k in kd], [v.float() for v in vd], kp,
                                                  vp, quant, scale)
        torch.testing.assert_close(c_out.double(), want, rtol=tol, atol=tol)  # the fallback agrees
        return out

    def test_every_format_gqa_and_head_dims(self):
        # GQA 5:1, 7:1, 1:1; head_dim 80 (int4: one group per head), 64, 128; segments of 0, 1, 17, 33 tokens
        cases = [("int8", 2, 10, 80, {}), ("fp8", 1, 7, 64, {}), ("int4", 2, 2, 80, dict(group_size=80)),
                 ("int4", 1, 5, 128, dict(group_size=32)), ("int2", 1, 5, 64, dict(stages=2, num_clusters=4)),
                 ("int2", 2, 2, 128, {}), (None, 2, 14, 64, {})]
        for quant, hkv, hq, d, fmt in cases:
            with self.subTest(quant=quant, hq=hq, hkv=hkv, d=d):
                ks, vs = window(quant, 2, hkv, d, [5, 0, 17, 1, 33], seed=d, **fmt)
                self.check(torch.randn(2, 3, hq, d), ks, vs, scale=0.1)

    def test_decode_row_blocks(self):
        """Decode (T = 1): the native kernel's row blocks of 1, 2, 3, 4 rows (GQA ratio <= 4) and of 8 (ratio 5: 5
        rows padded to 8), each format and bf16 dense segments, head_dim 128 / 64 / 80; row_counts with weights 0-2,
        the zero-weight rows holding NaN, and tiles cut short by a segment's end (lengths 21, 7, 35)."""
        cases = [(1, "int8", 128, {}), (2, "int4", 128, dict(group_size=32)), (3, "fp8", 64, {}),
                 (4, "int2", 64, dict(stages=2, num_clusters=4)), (5, "int4", 80, dict(group_size=80)),
                 (4, None, 80, {})]
        for g, quant, d, fmt in cases:
            with self.subTest(group=g, quant=quant, d=d):
                ks, vs = window(quant, 2, 2, d, [21, 7, 35], seed=g, dtype=torch.bfloat16, **fmt)
                q = torch.randn(2, 1, 2 * g, d, generator=torch.Generator().manual_seed(g))
                self.check(q, ks, vs, scale=0.15, tol=2e-5)
                counts = torch.randint(0, 3, (63,), generator=torch.Generator().manual_seed(g), dtype=torch.int32)
                counts[[2, 30, 40]] = 0
                ks[0], vs[0] = ks[0].clone(), vs[0].clone()
                ks[0][:, 2] = vs[0][:, 2] = float("nan")  # not visible: never reaches the result
                rows = torch.arange(63).repeat_interleave(counts.long())
                want, want_lse = reference(q, dense_window(ks)[:, rows], dense_window(vs)[:, rows], 0.15)
                out, lse = packed_attention(q, ks, vs, scale=0.15, row_counts=counts, return_lse=True)
                torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)
                torch.testing.assert_close(lse.double(), want_lse, rtol=2e-5, atol=2e-5)

    def test_strided_codes_and_odd_head_dims(self):
        """Rows the native kernel reads one value at a time (packed_tile.h's Seg::scalar): codes, centroids and dense
        rows with a last-dim stride of 2, and head_dim 40 (not a multiple of the 16-value vectors; int4 / int2
        groups of 40 values); against the vectorized reads of the same values (unit stride, head_dim 64)."""
        def spread(t):  # the same values, last-dim stride 2
            out = torch.empty(*t.shape, 2, dtype=t.dtype)[..., 0]
            out.copy_(t)
            return out

        cases = [("int8", 64, {}), ("fp8", 64, {}), ("int4", 64, dict(group_size=32)),
                 ("int2", 64, dict(stages=2, num_clusters=4)), ("int8", 40, {}), ("fp8", 40, {}),
                 ("int4", 40, dict(group_size=40)), ("int2", 40, dict(stages=2, num_clusters=4))]
        for quant, d, fmt in cases:
            with self.subTest(quant=quant, d=d):
                ks, vs = window(quant, 1, 2, d, [5, 18, 20, 3], seed=d, **fmt)
                q = torch.randn(1, 2, 6, d)
                want = self.check(q, ks, vs)
                strided = [[spread(s) if isinstance(s, torch.Tensor) else
                            s._replace(codes=spread(s.codes),
                                       centroids=None if s.centroids is None else spread(s.centroids))
                            for s in segs] for segs in (ks, vs)]
                self.assertNotEqual(strided[0][2].codes.stride(-1), 1)
                torch.testing.assert_close(self.check(q, *strided), want, rtol=1e-6, atol=1e-6)

    def test_half_precision_queries_and_segments(self):
        for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
            ks, vs = window("int4", 1, 2, 64, [9, 4, 20], dtype=dtype, group_size=32)
            self.check(torch.randn(1, 4, 4, 64).to(dtype), ks, vs, tol=tol)

    def test_strided_views_and_value_head_dim(self):
        # q and dense segments strided (every other head / token), packed segments head slices of a pool; D_v != D
        ks, vs = window("int8", 2, 4, 64, [6, 3, 11], d_v=32)
        ks = [k[:, ::2] if isinstance(k, torch.Tensor) else k for k in ks]
        vs = [v[:, ::2] if isinstance(v, torch.Tensor) else v for v in vs]
        ks, vs = [k[:, :, 1:3] if isinstance(k, torch.Tensor) else k.heads(1, 3) for k in ks], \
            [v[:, :, 1:3] if isinstance(v, torch.Tensor) else v.heads(1, 3) for v in vs]
        q = torch.randn(2, 5, 8, 64)[:, :, ::2]
        self.assertEqual(self.check(q, ks, vs).shape, (2, 5, 4, 32))

    def test_joint_kv_allocation(self):
        # dense K and V as views of one [B, n, 2, H_kv, D] allocation (never copied), with a packed int2 segment
        kv = torch.randn(1, 9, 2, 2, 64)
        ks, vs = window("int2", 1, 2, 64, [1, 1, 30])
        ks[0], vs[0] = kv[:, :, 0], kv[:, :, 1]
        self.check(torch.randn(1, 2, 6, 64), ks, vs)

    def test_cache_view(self):
        for quant in FORMATS:
            view = streamed_view(quant, 2, 64, torch.float32)
            self.assertGreater(len(view.k.segments), 2)  # sink, packed chunks, dense chunks
            q = torch.randn(2, 3, 6, 64)
            out = packed_attention(q, view.k, view.v)
            k, v = materialize(view.k, torch.float32), materialize(view.v, torch.float32)  # the visible rows
            self.assertEqual(k.shape[1], 16)  # S rows (6 chunks of 3 written: 2 evicted)
            want, _ = reference(q, k, v)
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)

    def test_row_counts_mask_and_repeat_rows(self):
        """row_counts[j] = how often row j is attended (0: skipped, even when it holds NaN; 2: twice): equal to
        plain attention over the rows repeated that often, for the native kernel and the composite; segments in any
        order (the wrapper maps the counts to the op's dense-then-packed order); a tile with no visible row."""
        for quant in FORMATS:
            ks, vs = window(quant, 1, 2, 64, [20, 3, 5, 17])
            ks, vs = [ks[2], ks[0], ks[3], ks[1]], [vs[2], vs[0], vs[3], vs[1]]  # packed, dense, packed, dense
            g = torch.Generator().manual_seed(1)
            counts = torch.randint(0, 3, (45,), generator=g, dtype=torch.int32)
            counts[5:21] = 0  # the 20-row dense segment's first tile (16 rows) is skipped, ...
            counts[23] = 0  # ... its second one partly visible
            ks[1], vs[1] = ks[1].clone(), vs[1].clone()
            ks[1][:, 3] = vs[1][:, 4] = float("nan")  # rows not visible may hold anything (stale ring rows)
            ks[1][:, 18] = vs[1][:, 18] = float("nan")
            counts[21] = 2
            q = torch.randn(1, 3, 4, 64, generator=g)
            rows = torch.arange(45).repeat_interleave(counts.long())
            want, want_lse = reference(q, dense_window(ks)[:, rows], dense_window(vs)[:, rows])
            out, lse = packed_attention(q, ks, vs, row_counts=counts, return_lse=True)
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
            saved = native._state
            try:
                native._state = False  # the composite
                out = packed_attention(q, ks, vs, row_counts=counts)
            finally:
                native._state = saved
            torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
            zero = packed_attention(q, ks, vs, row_counts=torch.zeros(45, dtype=torch.int32))
            self.assertTrue(torch.equal(zero, torch.zeros_like(zero)))

    def test_row_counts_in_the_triton_kernel(self):
        """The Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1, as tests/conftest.py sets) masks rows
        with count 0 (NaN rows included), weights the others, and a segment with no visible row leaves the state."""
        import os

        self.assertTrue(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
        from kvops.triton import packed_attention as ta

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        for quant in ("int4", "int2"):
            ks, vs = window(quant, 1, 2, 64, [18, 3, 5, 17])  # dense 18, 3; packed 5, 17 (the op's order)
            ks[0], vs[0] = ks[0].clone(), vs[0].clone()
            ks[0][:, 17] = vs[0][:, 17] = float("nan")
            counts = torch.randint(0, 3, (43,), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
            counts[17] = 0
            counts[21:26] = 0  # the first packed segment: nothing visible
            q = torch.randn(1, 2, 4, 64)
            rows = torch.arange(43).repeat_interleave(counts.long())
            want, want_lse = reference(q, dense_window(ks)[:, rows], dense_window(vs)[:, rows], 0.15)
            (kd, kp), (vd, vp) = _split(ks), _split(vs)
            move = lambda ts: [t.to(dev) for t in ts]  # noqa: E731
            out, lse = ta.packed_attention(q.to(dev), move(kd), move(vd), move(kp), move(vp), quant, 0.15,
                                           counts.to(dev))
            torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse.cpu().double(), want_lse, rtol=1e-5, atol=1e-5)

    def test_empty_window(self):
        ks, vs = window(None, 1, 2, 32, [0, 0])
        out, lse = packed_attention(torch.randn(1, 3, 2, 32), ks, vs, return_lse=True)
        self.assertTrue(torch.equal(out, torch.zeros(1, 3, 2, 32)))
        self.assertTrue(bool((lse == float("-inf")).all()))

    def test_composite_fallback_is_used_without_the_native_build(self):
        ks, vs = window("int2", 1, 2, 64, [4, 4, 12])
        q = torch.randn(1, 2, 2, 64)
        want = packed_attention(q, ks, vs)
        saved = native._state
        try:
            native._state = False  # as after a failed build
            got = packed_attention(q, ks, vs)
        finally:
            native._state = saved
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    def test_compiled_with_inductor(self):
        torch._dynamo.reset()
        ks, vs = window("int4", 1, 2, 64, [4, 3, 12, 12], group_size=32)
        q = torch.randn(1, 3, 4, 64)
        fn = torch.compile(lambda q, ks, vs: packed_attention(q, ks, vs) * 2, fullgraph=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = fn(q, ks, vs)
        torch.testing.assert_close(got, packed_attention(q, ks, vs) * 2)


class TestContracts(expecttest.TestCase):
    def test_errors(self):
        ks, vs = window("int4", 1, 2, 64, [3, 3, 6])
        kd, kp = _split(ks)
        vd, vp = _split(vs)
        q = torch.randn(1, 2, 3, 64)
        op = torch.ops.kvops.packed_attention
        msg = raises_everywhere(self, ValueError, lambda q, a, b, c, d: op(q, [a, b], [c, d], [], [], None),
                                (q, kd[0], kd[1], vd[0], vd[1]))
        self.assertExpectedInline(msg, """kvops.packed_attention: query heads (3) must be a multiple of num_kv_heads (2) (GQA).""")
        q = torch.randn(1, 2, 4, 64)
        msg = raises_everywhere(self, ValueError, lambda q, c, s, z: op(q, [], [], [c, s, z], [c, s, z], None),
                                (q, *kp))
        self.assertExpectedInline(msg, """kvops.packed_attention: packed segments given without their format; pass quant (one of ('int8', 'fp8', 'int4', 'int2')).""")
        msg = raises_everywhere(self, ValueError, lambda q, c, s: op(q, [], [], [c, s], [c, s], "int4"), (q, *kp[:2]))
        self.assertExpectedInline(msg, """kvops.packed_attention: quant='int4' stores 3 tensors per segment (see kvops.packed.packed_layout), so k_packed/v_packed need a multiple of 3; got 2.""")
        msg = raises_everywhere(self, ValueError, lambda q, c, s, z: op(q, [], [], [c, s, z.half()], [c, s, z], "int4"),
                                (q, *kp))
        self.assertExpectedInline(msg, """kvops.packed_attention (packed K segment 0): zeros must be torch.int8 of shape (1, 6, 2, 1) for quant='int4' (codes of shape (1, 6, 2, 32), group_size 64); got torch.float16 of shape (1, 6, 2, 1). Allocate it from kvops.packed.packed_layout(...).""")
        one = lambda q, k, v: op(q, [k], [v], [], [], None)  # noqa: E731
        msg = raises_everywhere(self, ValueError, one, (q, kd[0], vd[1][:, :2]))
        self.assertExpectedInline(msg, """kvops.packed_attention: dense K segment 0 has 3 tokens but dense V segment 0 has 2; K and V must match.""")
        msg = raises_everywhere(self, ValueError, one, (q[..., :32], kd[0], vd[0]))
        self.assertExpectedInline(msg, """kvops.packed_attention: dense K segment 0 has batch 1, 2 KV heads and head_dim 64; expected batch 1 (q), num_kv_heads 2 and head_dim 32 (q).""")
        msg = raises_everywhere(self, ValueError, lambda q: op(q, [], [], [], [], None), (q,))
        self.assertExpectedInline(msg, """kvops.packed_attention: need at least one K/V segment (dense or packed), got none.""")

    def test_row_counts_errors(self):
        ks, vs = window("int8", 1, 2, 64, [3, 2, 5])  # 10 rows: dense 3 + 2, packed 5
        kd, kp = _split(ks)
        vd, vp = _split(vs)
        q = torch.randn(1, 2, 4, 64)
        op = lambda q, c: torch.ops.kvops.packed_attention(q, kd, vd, kp, vp, "int8", None, c)  # noqa: E731
        msg = raises_everywhere(self, ValueError, op, (q, torch.ones(9, dtype=torch.int32)))
        self.assertExpectedInline(msg, """kvops.packed_attention: row_counts must be int32 of shape (10,) (one count per K row, dense segments first, then packed ones); got torch.int32 of shape (9,). Pass view.k of PackedCausalKVCache.update, or None to attend every row.""")
        msg = raises_everywhere(self, ValueError, op, (q, torch.ones(10, dtype=torch.int64)))
        self.assertExpectedInline(msg, """kvops.packed_attention: row_counts must be int32 of shape (10,) (one count per K row, dense segments first, then packed ones); got torch.int64 of shape (10,). Pass view.k of PackedCausalKVCache.update, or None to attend every row.""")
        msg = raises_everywhere(self, ValueError, op, (q, torch.ones(2, 5, dtype=torch.int32)))
        self.assertExpectedInline(msg, """kvops.packed_attention: row_counts must be int32 of shape (10,) (one count per K row, dense segments first, then packed ones); got torch.int32 of shape (2, 5). Pass view.k of PackedCausalKVCache.update, or None to attend every row.""")
        bad = torch.ones(10, dtype=torch.int32)
        bad[7] = -1
        with self.assertRaises(RuntimeError) as ctx:  # values: eager only (kvops/_checks/values.py)
            op(q, bad)
        self.assertExpectedInline(str(ctx.exception), """kvops.packed_attention: row_counts must be >= 0 (0 skips a row, 1 attends it); got -1 at row 7.""")

    def test_wrapper_errors(self):
        a, b = quantize_kv(torch.randn(1, 3, 2, 64), "int8"), quantize_kv(torch.randn(1, 3, 2, 64), "int4")
        with self.assertRaisesRegex(ValueError, r"one format, got \['int4', 'int8'\]"):
            packed_attention(torch.randn(1, 1, 2, 64), [a, b], [a, b])
        with self.assertRaisesRegex(ValueError, "same number of K and V segments, got 2 and 1"):
            packed_attention(torch.randn(1, 1, 2, 64), [a, a], [a])

    def test_opcheck(self):
        for quant in FORMATS:
            ks, vs = window(quant, 1, 2, 64, [3, 2, 5], dtype=torch.bfloat16, stages=2, num_clusters=4) \
                if quant == "int2" else window(quant, 1, 2, 64, [3, 2, 5], dtype=torch.bfloat16)
            kd, kp = _split(ks)
            vd, vp = _split(vs)
            q = torch.randn(1, 2, 4, 64).bfloat16()
            # opcheck's schema test compares fp8 tensors with a mul that torch has no CPU kernel for on float8_e4m3fn
            utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
            kw = {"test_utils": utils} if quant == "fp8" else {}
            torch.library.opcheck(torch.ops.kvops.packed_attention.default, (q, kd, vd, kp, vp, quant, 0.2), **kw)
            counts = torch.tensor([1, 0, 2, 1, 1, 0, 0, 1, 1, 0], dtype=torch.int32)
            torch.library.opcheck(torch.ops.kvops.packed_attention.default,
                                  (q, kd, vd, kp, vp, quant, 0.2, counts), **kw)


if __name__ == "__main__":
    unittest.main()
