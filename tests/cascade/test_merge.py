"""``kvops.merge_attention_states`` / ``kvops.merge_attention_states_many`` (docs/semantics.md §12): parts of fp64
attention over disjoint key subsets, rounded to each dtype, merged by kvops, against fp64 attention over the union
(``kvops/reference/merge.py``); empty parts; FlashInfer's LSE layout as a view; every documented error in eager,
compile and export; opcheck; the Inductor decomposition fusing into one loop."""

from __future__ import annotations

import math
import unittest

import expecttest
import torch

import kvops
from kvops.reference import merge as ref
from tests.contract import raises_everywhere
from tests.inductor_utils import FreshInductorCache, code_facts, compiled

TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}
INF = float("inf")


def parts(t, h_q, h_kv, d, length, n_parts, seed=0, empty_rows=()):
    """fp64 queries/keys, a random partition of each query's keys into ``n_parts`` disjoint subsets (query rows in
    ``empty_rows`` see no key at all), the parts' fp64 ``(out, lse)`` and the fp64 attention over the union."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h_q, d, generator=g, dtype=torch.float64)
    k = torch.randn(length, h_kv, d, generator=g, dtype=torch.float64)
    v = torch.randn(length, h_kv, d, generator=g, dtype=torch.float64)
    owner = torch.randint(0, n_parts, (t, length), generator=g)
    visible = torch.ones(t, length, dtype=torch.bool)
    for r in empty_rows:
        visible[r] = False
    scale = d ** -0.5
    outs, lses = zip(*(ref.partial_attention(q, k, v, visible & (owner == i), scale) for i in range(n_parts)))
    return torch.stack(outs), torch.stack(lses), ref.partial_attention(q, k, v, visible, scale)


class TestMergeOracle(expecttest.TestCase):
    SHAPES = [  # (T, H_q, H_kv, D, keys): head_dim 80, GQA 5:1 / 7:1, MQA, a single query, no query
        (7, 10, 2, 80, 37), (5, 7, 1, 64, 19), (3, 14, 2, 128, 50), (1, 4, 4, 16, 3), (0, 4, 1, 8, 5),
    ]

    def test_two_parts_equal_attention_over_the_union(self):
        for (t, h_q, h_kv, d, length), dtype in zip(self.SHAPES * 3, [torch.float32] * 5 + [torch.bfloat16] * 5
                                                    + [torch.float16] * 5):
            with self.subTest(t=t, h_q=h_q, d=d, dtype=dtype):
                outs, lses, (want_out, want_lse) = parts(t, h_q, h_kv, d, length, 2, seed=t + d)
                o, lse = kvops.merge_attention_states(outs[0].to(dtype), lses[0].float(), outs[1].to(dtype),
                                                      lses[1].float())
                self.assertEqual((o.dtype, o.shape, lse.dtype, lse.shape),
                                 (dtype, (t, h_q, d), torch.float32, (h_q, t)))
                torch.testing.assert_close(o.double(), want_out, **TOL[dtype])
                torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)

    def test_many_parts_equal_attention_over_the_union(self):
        for n, (t, h_q, h_kv, d, length) in zip((1, 3, 5, 8, 2), self.SHAPES):
            for dtype in TOL:
                with self.subTest(n=n, t=t, dtype=dtype):
                    outs, lses, (want_out, want_lse) = parts(t, h_q, h_kv, d, length, n, seed=n)
                    o, lse = kvops.merge_attention_states_many(outs.to(dtype), lses.float())
                    torch.testing.assert_close(o.double(), want_out, **TOL[dtype])
                    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
                    o2, lse2 = kvops.merge_attention_states_many(list(outs.to(dtype)), list(lses.float()))
                    self.assertTrue(torch.equal(o2, o) and torch.equal(lse2, lse))

    def test_empty_parts_contribute_nothing_and_two_empty_parts_give_zero(self):
        # rows 0 and 3 see no key at all (every part empty there); 2 keys over 3 parts: every row has an empty part
        outs, lses, (want_out, want_lse) = parts(5, 4, 2, 16, 2, 3, seed=3, empty_rows=(0, 3))
        self.assertTrue(bool((lses[:, :, [0, 3]] == -INF).all()))
        self.assertTrue(bool((lses == -INF).any(0).all()))
        o, lse = kvops.merge_attention_states_many(outs.float(), lses.float())
        self.assertFalse(bool(o.isnan().any()) or bool(lse.isnan().any()))
        self.assertEqual(o[[0, 3]].abs().max().item(), 0.0)
        self.assertTrue(bool((lse[:, [0, 3]] == -INF).all()))
        torch.testing.assert_close(o.double(), want_out, **TOL[torch.float32])
        torch.testing.assert_close(lse.double(), want_lse)
        o2, lse2 = kvops.merge_attention_states(outs[0].float(), lses[0].float(), outs[1].float(), lses[1].float())
        want2 = ref.merge_states(outs[:2], lses[:2])
        self.assertFalse(bool(o2.isnan().any()) or bool(lse2.isnan().any()))
        torch.testing.assert_close(o2.double(), want2[0], **TOL[torch.float32])
        torch.testing.assert_close(lse2.double(), want2[1])
        # FlashAttention-2 reports an empty part's LSE as +inf: read as -inf (vLLM's merge_attn_states)
        fa2 = torch.where(lses == -INF, INF, lses).float()
        o3, lse3 = kvops.merge_attention_states(outs[0].float(), fa2[0], outs[1].float(), fa2[1])
        self.assertTrue(torch.equal(o3, o2) and torch.equal(lse3, lse2))
        o4, lse4 = kvops.merge_attention_states_many(outs.float(), fa2)
        self.assertTrue(torch.equal(o4, o) and torch.equal(lse4, lse))

    def test_a_part_merged_with_an_empty_part_is_itself(self):
        o_a, lse_a = torch.randn(3, 2, 8, dtype=torch.bfloat16), torch.randn(2, 3)
        o, lse = kvops.merge_attention_states(o_a, lse_a, torch.zeros_like(o_a), torch.full((2, 3), -INF))
        self.assertTrue(torch.equal(o, o_a) and torch.equal(lse, lse_a))

    def test_nan_lse_propagates(self):
        o_a, lse_a = torch.randn(2, 2, 4), torch.randn(2, 2)
        lse_a[1, 0] = float("nan")
        o, lse = kvops.merge_attention_states(o_a, lse_a, torch.randn(2, 2, 4), torch.randn(2, 2))
        self.assertTrue(bool(o[0, 1].isnan().all()) and bool(lse[1, 0].isnan()))
        self.assertFalse(bool(o[1].isnan().any()) or bool(o[0, 0].isnan().any()))

    def test_flashinfer_lse_layout_as_a_transposed_view_and_strided_parts(self):
        outs, lses, (want_out, want_lse) = parts(6, 3, 1, 24, 30, 2, seed=9)
        t_h = [lse.t().contiguous().float() for lse in lses]  # FlashInfer's [T, H]
        big = torch.randn(6, 5, 2, 24)  # parts as strided views of one buffer [T, H, 2, D]
        big[:, :3, 0], big[:, :3, 1] = outs[0].float(), outs[1].float()
        o, lse = kvops.merge_attention_states(big[:, :3, 0], t_h[0].t(), big[:, :3, 1], t_h[1].t())
        torch.testing.assert_close(o.double(), want_out, **TOL[torch.float32])
        torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
        # FlashInfer's merge_states layout: v [T, N, H, D], s [T, N, H]
        v, s = outs.permute(1, 0, 2, 3).float(), lses.permute(2, 0, 1).float()
        o2, lse2 = kvops.merge_attention_states_many(v.permute(1, 0, 2, 3), s.permute(1, 2, 0))
        torch.testing.assert_close(o2.double(), want_out, **TOL[torch.float32])

    def test_cpu_kernel_matches_the_oracle_merge_formula(self):
        outs, lses, _ = parts(4, 6, 3, 40, 12, 3, seed=1)
        want_out, want_lse = ref.merge_states(outs, lses)
        o, lse = kvops.merge_attention_states_many(outs.float(), lses.float())
        torch.testing.assert_close(o.double(), want_out, **TOL[torch.float32])
        torch.testing.assert_close(lse.double(), want_lse)


class TestMergeOpcheck(unittest.TestCase):
    def test_opcheck(self):
        for dtype in TOL:
            outs = torch.randn(3, 5, 4, 16, dtype=dtype)
            lses = torch.randn(3, 4, 5)
            lses[1, 2, 3] = -INF
            strided = torch.randn(5, 4, 2, 16, dtype=dtype)[:, :, 1]
            for args in ((outs[0], lses[0], outs[1], lses[1]), (strided, lses[0].t().contiguous().t(), outs[2],
                                                                  lses[2])):
                torch.library.opcheck(torch.ops.kvops.merge_attention_states.default, args)
            torch.library.opcheck(torch.ops.kvops.merge_attention_states_many.default, (outs, lses))
            torch.library.opcheck(torch.ops.kvops.merge_attention_states_many.default,
                                  (outs[:1].transpose(1, 2).contiguous().transpose(1, 2), lses[:1]))


class TestMergeCompiled(FreshInductorCache):
    def test_merge_fuses_into_one_loop_with_its_consumer(self):
        o_a, o_b = torch.randn(4, 6, 32, dtype=torch.bfloat16), torch.randn(4, 6, 32, dtype=torch.bfloat16)
        lse_a, lse_b = torch.randn(6, 4), torch.randn(6, 4)
        lse_b[2, 1] = -INF

        def step(o_a, lse_a, o_b, lse_b):
            o, lse = kvops.merge_attention_states(o_a, lse_a, o_b, lse_b)
            return o * 2, lse

        (o, lse), code = compiled(step, o_a, lse_a, o_b, lse_b)
        want_o, want_lse = kvops.merge_attention_states(o_a, lse_a, o_b, lse_b)
        torch.testing.assert_close(o, want_o * 2, **TOL[torch.bfloat16])
        torch.testing.assert_close(lse, want_lse)
        self.assertExpectedInline(code_facts(code), """cpp kernels: 1, kvops calls: 0""")

    def test_many_compiles_once_across_values(self):
        calls = []

        def backend(gm, example_inputs):
            calls.append(gm)
            return gm.forward

        torch._dynamo.reset()
        fn = torch.compile(kvops.merge_attention_states_many, fullgraph=True, backend=backend)
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            outs, lses = torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 4, 3, generator=g)
            o, lse = fn(outs, lses)
            torch.testing.assert_close(o, kvops.merge_attention_states_many(outs, lses)[0])
        self.assertEqual(len(calls), 1)


class TestMergeContracts(expecttest.TestCase):
    def setUp(self):
        self.o = torch.randn(3, 4, 8)
        self.lse = torch.randn(4, 3)

    def two(self, *args):
        return raises_everywhere(self, ValueError, lambda *a: kvops.merge_attention_states(*a), args)

    def many(self, *args):
        return raises_everywhere(self, ValueError, lambda *a: kvops.merge_attention_states_many(*a), args)

    def test_out_rank(self):
        self.assertExpectedInline(self.two(self.o[0], self.lse, self.o, self.lse), """kvops.merge_attention_states: o_a must be 3-D [T, H, D_v] (kvops.paged_attention's out), got shape (4, 8). Pass the attention output of each part with shape [T, H, D_v].""")  # noqa: B950

    def test_out_dtype(self):
        o = self.o.double()
        self.assertExpectedInline(self.two(o, self.lse, o, self.lse), """kvops.merge_attention_states: o_a must be float32, bfloat16 or float16, got torch.float64. Pass the attention output in the model's floating dtype.""")  # noqa: B950

    def test_out_shapes_differ(self):
        self.assertExpectedInline(self.two(self.o, self.lse, self.o[:, :, :4], self.lse), """kvops.merge_attention_states: o_b shape (3, 4, 4) does not match o_a shape (3, 4, 8). Both parts must be attention outputs of the same queries [T, H, D_v] (over disjoint key sets).""")  # noqa: B950

    def test_out_dtypes_differ(self):
        self.assertExpectedInline(self.two(self.o, self.lse, self.o.bfloat16(), self.lse), """kvops.merge_attention_states: o_b dtype torch.bfloat16 does not match o_a dtype torch.float32. Cast o_b to torch.float32.""")  # noqa: B950

    def test_lse_dtype(self):
        self.assertExpectedInline(self.two(self.o, self.lse, self.o, self.lse.bfloat16()), """kvops.merge_attention_states: lse_b must be float32 (the log-sum-exp in natural log, as kvops.paged_attention returns it), got torch.bfloat16. Pass lse_b.float().""")  # noqa: B950

    def test_lse_in_flashinfer_layout(self):
        self.assertExpectedInline(self.two(self.o, self.lse.t().contiguous(), self.o, self.lse), """kvops.merge_attention_states: lse_a must have shape [H, T] = (4, 3) to match o_a of shape (3, 4, 8), got (3, 4). This is FlashInfer's [T, H] layout: pass its transposed view lse_a.t() (no copy).""")  # noqa: B950

    def test_lse_of_another_shape(self):
        self.assertExpectedInline(self.two(self.o, self.lse, self.o, self.lse[:, :2]), """kvops.merge_attention_states: lse_b must have shape [H, T] = (4, 3) to match o_a of shape (3, 4, 8), got (4, 2). Pass the LSE that came with o_a (kvops.paged_attention(..., return_lse=True) returns it as [H, T]).""")  # noqa: B950

    def test_many_rank_and_count(self):
        self.assertExpectedInline(self.many(self.o, self.lse), """kvops.merge_attention_states_many: outs must be 4-D [N, T, H, D_v] (kvops.paged_attention's out), got shape (3, 4, 8). Pass the attention output of each part with shape [N, T, H, D_v].""")  # noqa: B950
        self.assertExpectedInline(self.many(torch.empty(0, 3, 4, 8), torch.empty(0, 4, 3)), """kvops.merge_attention_states_many: outs holds no parts (shape (0, 3, 4, 8)); pass at least one part (N >= 1).""")  # noqa: B950

    def test_many_parts_of_different_shapes(self):
        with self.assertRaises(ValueError) as cm:
            kvops.merge_attention_states_many([self.o, self.o[:2]], [self.lse, self.lse])
        self.assertExpectedInline(str(cm.exception), """kvops.merge_attention_states_many: outs[1] has shape (2, 4, 8) and dtype torch.float32 but outs[0] has shape (3, 4, 8) and dtype torch.float32. Pass parts of one shape and dtype (or a stacked tensor).""")  # noqa: B950

    def test_a_dispatch_mode_still_sees_the_op(self):
        # the eager fast path (no dispatcher) steps aside when a mode watches
        from tests.contract import OpLog

        with OpLog() as log:
            kvops.merge_attention_states(self.o, self.lse, self.o, self.lse)
            kvops.merge_attention_states_many(self.o[None], self.lse[None])
        self.assertIn("kvops.merge_attention_states.default", log.ops)
        self.assertIn("kvops.merge_attention_states_many.default", log.ops)

    def test_many_lse_layout(self):
        outs, lses = self.o.expand(2, 3, 4, 8), self.lse.expand(2, 4, 3)
        self.assertExpectedInline(self.many(outs, lses.transpose(1, 2)), """kvops.merge_attention_states_many: lses must have shape [N, H, T] = (2, 4, 3) to match outs of shape (2, 3, 4, 8), got (2, 3, 4). This is FlashInfer's [T, H] layout: pass its transposed view lses.transpose(-1, -2) (no copy).""")  # noqa: B950
        self.assertExpectedInline(self.many(outs, lses.double()), """kvops.merge_attention_states_many: lses must be float32 (the log-sum-exp in natural log, as kvops.paged_attention returns it), got torch.float64. Pass lses.float().""")  # noqa: B950


if __name__ == "__main__":
    unittest.main()
