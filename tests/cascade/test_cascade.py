"""``kvops.plan_cascade`` / ``kvops.cascade_attention`` (docs/cascade.md): against fp64 attention over each sequence's
keys (``kvops/reference/merge.py``) and against ``kvops.paged_attention`` at odd shapes (head_dim 80, GQA 5:1 / 7:1,
MQA, block_size 1 and 16, empty sequences, prefill chunks, sequences outside any group, HND caches), through both
level-1 kernels; the planner's groups and errors; the checks of a plan against a step in eager, compile and export;
one compile across decode steps."""

from __future__ import annotations

import unittest

import expecttest
import torch
import torch._dynamo
import torch._dynamo.testing

import kvops
import kvops.ops.cascade as cascade_mod
from kvops.reference.merge import partial_attention
from tests.contract import raises_everywhere

I32 = torch.int32
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def batch(h_q, h_kv, d, block_size, prefix, suffixes, q_lens, dtype=torch.float32, seed=0, extra=None):
    """A paged batch whose sequences share ``prefix`` tokens (their first ``prefix // block_size`` blocks), then own
    ``suffixes[b]`` tokens in their own blocks; ``extra``: (seq_len, q_len) of sequences after them that share
    nothing. Blocks are permuted and unused slots hold NaN."""
    g = torch.Generator().manual_seed(seed)
    nb_prefix = prefix // block_size
    lens = [prefix + s for s in suffixes] + [e[0] for e in (extra or [])]
    q_lens = list(q_lens) + [e[1] for e in (extra or [])]
    own = [-(-n // block_size) - (nb_prefix if i < len(suffixes) else 0) for i, n in enumerate(lens)]
    pages = nb_prefix + sum(own) + 3
    perm = torch.randperm(pages, generator=g).tolist()
    width = max(-(-n // block_size) for n in lens) + 1
    table = torch.full((len(lens), width), -1, dtype=I32)
    nxt = nb_prefix
    for i, n in enumerate(lens):
        first = nb_prefix if i < len(suffixes) else 0
        table[i, :first] = torch.tensor(perm[:first], dtype=I32)
        table[i, first:first + own[i]] = torch.tensor(perm[nxt:nxt + own[i]], dtype=I32)
        nxt += own[i]
    k = torch.full((pages, block_size, h_kv, d), float("nan"), dtype=dtype)
    v = torch.full((pages, block_size, h_kv, d), float("nan"), dtype=dtype)
    for i, n in enumerate(lens):
        for j in range(n):
            blk, row = table[i, j // block_size], j % block_size
            if torch.isnan(k[blk, row]).all():
                k[blk, row] = torch.randn(h_kv, d, generator=g).to(dtype)
                v[blk, row] = torch.randn(h_kv, d, generator=g).to(dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=I32)
    q = torch.randn(int(cu[-1]), h_q, d, generator=g).to(dtype)
    return dict(q=q, k_cache=k, v_cache=v, cu_seqlens_q=cu, seq_lens=torch.tensor(lens, dtype=I32),
                block_table=table, max_seqlen_q=max(q_lens + [1]))


def oracle(a, causal=True):
    """fp64 ``(out [T, H_q, D], lse [H_q, T])`` of every sequence over its own keys (bottom-right causal)."""
    outs, lses = [], []
    bs = a["k_cache"].shape[1]
    for b in range(a["seq_lens"].shape[0]):
        n, r0, r1 = int(a["seq_lens"][b]), int(a["cu_seqlens_q"][b]), int(a["cu_seqlens_q"][b + 1])
        idx = [int(a["block_table"][b, j // bs]) * bs + j % bs for j in range(n)]
        k = a["k_cache"].flatten(0, 1)[idx]
        v = a["v_cache"].flatten(0, 1)[idx]
        pos = n - (r1 - r0) + torch.arange(r1 - r0)[:, None]
        visible = torch.arange(n)[None, :] <= pos if causal else torch.ones(r1 - r0, n, dtype=torch.bool)
        o, lse = partial_attention(a["q"][r0:r1], k, v, visible, a["q"].shape[-1] ** -0.5)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


def run(a, plan, **kw):
    return kvops.cascade_attention(a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens_q"], a["seq_lens"],
                                   a["block_table"], a["max_seqlen_q"], plan, return_lse=True, **kw)


def make_plan(a, **kw):
    return kvops.plan_cascade(a["block_table"], a["seq_lens"], a["cu_seqlens_q"], a["k_cache"].shape[1], **kw)


CASES = [  # (H_q, H_kv, D, block_size, prefix, suffixes, q_lens, extra sequences)
    (10, 2, 80, 16, 48, [5, 17, 0, 30], [1, 1, 1, 1], None),  # head_dim 80, GQA 5:1, an empty suffix
    (7, 1, 64, 1, 9, [3, 1, 4], [1, 1, 1], [(6, 1), (0, 0)]),  # GQA 7:1, block_size 1, an empty sequence
    (4, 4, 32, 16, 32, [20, 9], [4, 3], [(11, 2)]),  # MHA, prefill chunks (causal inside the suffix)
    (6, 1, 16, 4, 12, [1, 1, 2, 1, 5], [1, 1, 2, 1, 3], None),  # MQA, a query right after the prefix
]


class TestCascadeOracle(expecttest.TestCase):
    def check(self, dtype, gemm: bool, layout="NHD"):
        for i, (h_q, h_kv, d, bs, prefix, suffixes, q_lens, extra) in enumerate(CASES):
            with self.subTest(case=i, dtype=dtype, gemm=gemm, layout=layout):
                a = batch(h_q, h_kv, d, bs, prefix, suffixes, q_lens, dtype=dtype, seed=i, extra=extra)
                plan = make_plan(a)
                self.assertEqual([g[4] * bs for g in plan.groups], [prefix])
                want_out, want_lse = oracle(a)
                kw = {}
                if layout == "HND":
                    a = dict(a, k_cache=a["k_cache"].transpose(1, 2).contiguous(),
                             v_cache=a["v_cache"].transpose(1, 2).contiguous())
                    kw = dict(kv_layout="HND")
                saved = cascade_mod._GEMM
                cascade_mod._GEMM = saved if gemm else None
                try:
                    out, lse = run(a, plan, **kw)
                finally:
                    cascade_mod._GEMM = saved
                self.assertEqual((out.dtype, out.shape), (dtype, a["q"].shape))
                torch.testing.assert_close(out.double(), want_out, **TOL[dtype])
                torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-4)
                plain = kvops.paged_attention(a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens_q"], a["seq_lens"],
                                              a["block_table"], a["max_seqlen_q"], return_lse=True, **kw)
                torch.testing.assert_close(out, plain[0], **TOL[dtype])
                self.assertFalse(bool(out.isnan().any()))

    def test_gemm_prefix_fp32(self):
        self.check(torch.float32, True)

    def test_gemm_prefix_bf16(self):
        self.check(torch.bfloat16, True)

    def test_paged_prefix_fp32(self):
        self.check(torch.float32, False)

    def test_paged_prefix_bf16_hnd(self):
        self.check(torch.bfloat16, False, "HND")

    def test_gemm_prefix_hnd(self):
        self.check(torch.float32, True, "HND")

    def test_two_groups_with_different_prefixes_around_a_sequence_that_shares_nothing(self):
        # sequences 0-1 share 2 blocks, 2 shares nothing, 3-5 share 1 block (a prefill chunk among them): the level-1
        # parts are concatenated around the gap and the suffix tables are shifted per sequence (a gather)
        a = batch(6, 2, 24, 4, 8, [5, 3], [1, 1], seed=7, extra=[(9, 1)])
        b = batch(6, 2, 24, 4, 4, [6, 2, 7], [1, 3, 1], seed=8)
        pages = a["k_cache"].shape[0]
        k = torch.cat((a["k_cache"], b["k_cache"]))
        v = torch.cat((a["v_cache"], b["v_cache"]))
        width = max(a["block_table"].shape[1], b["block_table"].shape[1])
        pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1)  # noqa: E731
        table = torch.cat((pad(a["block_table"]), torch.where(pad(b["block_table"]) >= 0,
                                                              pad(b["block_table"]) + pages, -1)))
        cu_b = b["cu_seqlens_q"][1:] + a["cu_seqlens_q"][-1]
        m = dict(q=torch.cat((a["q"], b["q"])), k_cache=k, v_cache=v,
                 cu_seqlens_q=torch.cat((a["cu_seqlens_q"], cu_b)),
                 seq_lens=torch.cat((a["seq_lens"], b["seq_lens"])), block_table=table, max_seqlen_q=3)
        plan = make_plan(m)
        self.assertEqual(plan.groups, ((0, 2, 0, 2, 2), (3, 6, 3, 8, 1)))
        want_out, want_lse = oracle(m)
        for gemm in (True, False):
            saved = cascade_mod._GEMM
            cascade_mod._GEMM = saved if gemm else None
            try:
                out, lse = run(m, plan)
            finally:
                cascade_mod._GEMM = saved
            torch.testing.assert_close(out.double(), want_out, **TOL[torch.float32])
            torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-4)

    def test_softcap_takes_the_paged_prefix(self):
        a = batch(4, 2, 16, 4, 8, [3, 5], [1, 1], seed=3)
        plan = make_plan(a)
        out, lse = run(a, plan, softcap=5.0)
        want = kvops.paged_attention(a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens_q"], a["seq_lens"],
                                     a["block_table"], 1, softcap=5.0, return_lse=True)
        torch.testing.assert_close(out, want[0], **TOL[torch.float32])
        torch.testing.assert_close(lse, want[1], **TOL[torch.float32])

    def test_fp8_caches_take_the_paged_prefix(self):
        a = batch(8, 2, 32, 16, 32, [9, 20, 3], [1, 2, 1], seed=9)
        fp8 = dict(a, k_cache=a["k_cache"].nan_to_num().to(torch.float8_e4m3fn),
                   v_cache=a["v_cache"].nan_to_num().to(torch.float8_e4m3fn))
        scales = dict(k_scale=torch.full((2,), 0.5), v_scale=torch.ones(1))
        out, lse = run(fp8, make_plan(fp8), **scales)
        want = kvops.paged_attention(fp8["q"], fp8["k_cache"], fp8["v_cache"], fp8["cu_seqlens_q"], fp8["seq_lens"],
                                     fp8["block_table"], fp8["max_seqlen_q"], return_lse=True, **scales)
        torch.testing.assert_close(out, want[0], **TOL[torch.float32])
        torch.testing.assert_close(lse, want[1], **TOL[torch.float32])

    def test_no_shared_prefix_is_one_pass(self):
        a = batch(4, 2, 16, 4, 0, [3, 5], [1, 1], seed=4)
        plan = make_plan(a)
        self.assertEqual(plan.groups, ())
        out, _ = run(a, plan)
        torch.testing.assert_close(out.double(), oracle(a)[0], **TOL[torch.float32])


class TestPlanCascade(expecttest.TestCase):
    def table(self, rows):
        return torch.tensor(rows, dtype=I32)

    def test_groups_of_consecutive_sequences(self):
        t = self.table([[0, 1, 2, 9], [0, 1, 2, 8], [0, 1, 7, 6], [3, 4, 5, 5], [3, 4, 11, 12], [13, 14, 15, 16]])
        lens = torch.tensor([15, 15, 15, 13, 13, 16], dtype=I32)
        plan = kvops.plan_cascade(t, lens, torch.arange(7, dtype=I32), 4)
        self.assertEqual(plan.groups, ((0, 3, 0, 3, 2), (3, 5, 3, 5, 2)))
        self.assertEqual(plan.prefix_lens.tolist(), [8, 8, 8, 8, 8, 0])
        self.assertEqual(plan.segment_cu.tolist(), [0, 3, 5, 6])
        self.assertEqual(plan.shared_tokens, 2 * 8 + 8)

    def test_prefix_cut_to_blocks_every_query_sees(self):
        t = self.table([[0, 1, 2], [0, 1, 2]])
        # causal: 3 queries of a sequence of 10 tokens: the first sits at 7, sees 8 keys = 2 blocks of 4
        plan = kvops.plan_cascade(t, torch.tensor([10, 12], dtype=I32), torch.tensor([0, 3, 4], dtype=I32), 4)
        self.assertEqual(plan.groups, ((0, 2, 0, 4, 2),))
        plan = kvops.plan_cascade(t, torch.tensor([10, 12], dtype=I32), torch.tensor([0, 4, 5], dtype=I32), 4)
        self.assertEqual(plan.groups, ((0, 2, 0, 5, 1),))
        plan = kvops.plan_cascade(t, torch.tensor([10, 12], dtype=I32), torch.tensor([0, 4, 5], dtype=I32), 4,
                                  causal=False)
        self.assertEqual(plan.groups, ((0, 2, 0, 5, 2),))

    def test_prefix_blocks_taken(self):
        t = self.table([[0, 1, 2], [0, 1, 3]])
        lens, cu = torch.tensor([12, 12], dtype=I32), torch.tensor([0, 1, 2], dtype=I32)
        self.assertEqual(kvops.plan_cascade(t, lens, cu, 4, prefix_blocks=1).groups, ((0, 2, 0, 2, 1),))
        with self.assertRaises(ValueError) as cm:
            kvops.plan_cascade(t, lens, cu, 4, prefix_blocks=3)
        self.assertExpectedInline(str(cm.exception), """kvops.plan_cascade: prefix_blocks=3 but block_table[1, 2] = 3 differs from block_table[0, 2] = 2: the rows do not share that prefix. Pass a smaller prefix_blocks, or let plan_cascade find the prefix (prefix_blocks=None).""")  # noqa: B950
        with self.assertRaises(ValueError) as cm:
            kvops.plan_cascade(t, torch.tensor([12, 5], dtype=I32), cu, 4, prefix_blocks=2)
        self.assertExpectedInline(str(cm.exception), """kvops.plan_cascade: prefix_blocks=2 but every query of sequence 1 sees only its first 1 whole blocks: pass prefix_blocks <= 1, or let plan_cascade find the prefix (prefix_blocks=None).""")  # noqa: B950

    def test_bad_arguments(self):
        t, lens, cu = self.table([[0, 1]]), torch.tensor([5], dtype=I32), torch.tensor([0, 1], dtype=I32)
        for args, want in (
            ((t.long(), lens, cu, 4), """kvops.plan_cascade: block_table must be a 2-D int32 tensor [B, max_blocks] (the step's kvops.paged_attention argument), got shape (1, 2) and dtype torch.int64. Pass the tensor you pass to kvops.paged_attention."""),  # noqa: B950
            ((t, lens, cu[:1], 4), """kvops.plan_cascade: inconsistent batch size: block_table has 1 rows, seq_lens 1 entries and cu_seqlens_q 1 (want B + 1 = 2). Pass the three tensors of one step."""),  # noqa: B950
            ((t, lens, cu, 0), """kvops.plan_cascade: block_size must be a positive int (the cache's tokens per block, k_cache.shape[1] for an NHD cache), got 0."""),  # noqa: B950
        ):
            with self.assertRaises(ValueError) as cm:
                kvops.plan_cascade(*args)
            self.assertEqual(str(cm.exception), want)


class TestCascadeContracts(expecttest.TestCase):
    def setUp(self):
        self.a = batch(4, 2, 16, 4, 8, [3, 5, 2], [1, 1, 1], seed=5)
        self.plan = make_plan(self.a)

    def check(self, plan, **change):
        a = dict(self.a, **change)

        def fn(q, k, v, cu, lens, table):
            return kvops.cascade_attention(q, k, v, cu, lens, table, 1, plan)

        return raises_everywhere(self, ValueError, fn, (a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens_q"],
                                                        a["seq_lens"], a["block_table"]),
                                 compile_exc=torch._dynamo.exc.Unsupported)

    def test_plan_of_another_batch(self):
        other = make_plan(batch(4, 2, 16, 4, 8, [3, 5], [1, 1], seed=5))
        self.assertExpectedInline(self.check(other), """kvops.cascade_attention: the plan was made for 2 sequences but block_table has shape (3, 5) and seq_lens (3,). Replan (kvops.plan_cascade) when the batch changes.""")  # noqa: B950

    def test_plan_of_other_query_rows(self):
        a = self.a
        self.assertExpectedInline(self.check(self.plan, q=torch.cat((a["q"], a["q"]))), """kvops.cascade_attention: the plan was made for 3 query rows but q has shape (6, 4, 16). Replan (kvops.plan_cascade) when the query lengths change (e.g. between prefill and decode).""")  # noqa: B950

    def test_plan_of_another_block_size(self):
        a = self.a
        k = a["k_cache"].reshape(-1, 2, 2, 16)
        self.assertExpectedInline(self.check(self.plan, k_cache=k, v_cache=k), """kvops.cascade_attention: the plan was made for block_size 4 but k_cache (NHD, shape (18, 2, 2, 16)) has block_size 2. Plan with this cache's block_size.""")  # noqa: B950

    def test_table_narrower_than_the_prefix(self):
        self.assertExpectedInline(self.check(self.plan, block_table=self.a["block_table"][:, :1]), """kvops.cascade_attention: the plan's shared prefix spans 2 blocks but block_table has only 1 columns. Pass the block_table the plan was made from (or a wider one).""")  # noqa: B950

    def test_rows_that_no_longer_share_the_prefix(self):
        """A value contract (docs/semantics.md §7): a block-table row replaced after planning (another sequence, same
        lengths) would make the group's other rows read its prefix. eager: RuntimeError before any attention;
        async: torch._assert_async, also in a compiled step; off: unchecked."""
        a = self.a
        table = a["block_table"].clone()
        table[0, :2] = table[0, :2].flip(0)  # row 0 now holds another sequence (same lengths, other prefix blocks)
        args = (a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens_q"], a["seq_lens"])

        def fn(q, k, v, cu, lens, t):
            return kvops.cascade_attention(q, k, v, cu, lens, t, 1, self.plan)

        with self.assertRaises(RuntimeError) as cm:
            fn(*args, table)
        self.assertExpectedInline(str(cm.exception), """kvops.cascade_attention: the plan's group 0 (sequences [0, 3), a shared prefix of 2 blocks read from row 0) does not hold for this block_table: block_table[1, 0] = 8 but block_table[0, 0] = 7, so sequence 1 would read another sequence's prefix. The block tables changed after planning (e.g. a sequence replaced in the batch); replan with kvops.plan_cascade when the batch's block tables change.""")  # noqa: B950
        fn(*args, a["block_table"])  # the table the plan was made from passes
        with kvops.value_checks("async"):
            with self.assertRaisesRegex(RuntimeError, "does not share its plan group's prefix blocks"):
                fn(*args, table)
            torch._dynamo.reset()
            compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
            torch.testing.assert_close(compiled(*args, a["block_table"]), fn(*args, a["block_table"]))
            with self.assertRaisesRegex(RuntimeError, "does not share its plan group's prefix blocks"):
                compiled(*args, table)
        with kvops.value_checks("off"):
            fn(*args, table)  # unchecked: wrong numbers, no error

    def test_not_a_plan(self):
        with self.assertRaises(ValueError) as cm:
            a = self.a
            kvops.cascade_attention(a["q"], a["k_cache"], a["v_cache"], a["cu_seqlens_q"], a["seq_lens"],
                                    a["block_table"], 1, None)
        self.assertExpectedInline(str(cm.exception), """kvops.cascade_attention: plan must be a kvops.CascadePlan (from kvops.plan_cascade), got NoneType. Make one with kvops.plan_cascade(block_table, seq_lens, cu_seqlens_q, block_size).""")  # noqa: B950


class TestCascadeCompiled(unittest.TestCase):
    def test_decode_steps_compile_once(self):
        a = batch(6, 2, 16, 4, 16, [3, 6, 1], [1, 1, 1], seed=6)
        plan = make_plan(a)
        torch._dynamo.reset()
        counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")

        def step(q, k, v, cu, lens, table):
            return kvops.cascade_attention(q, k, v, cu, lens, table, 1, plan)

        fn = torch.compile(step, fullgraph=True, backend=counter)
        for s in range(3):  # each step: one more token per sequence (written into spare slots of the caches)
            lens = a["seq_lens"] + s
            table = a["block_table"].clone()
            for b in range(3):
                n = int(lens[b])
                col = (n - 1) // 4
                if table[b, col] < 0:
                    table[b, col] = a["k_cache"].shape[0] - 1 - b
                blk, row = int(table[b, col]), (n - 1) % 4
                a["k_cache"][blk, row] = torch.randn(2, 16)
                a["v_cache"][blk, row] = torch.randn(2, 16)
            q = torch.randn_like(a["q"])
            got = fn(q, a["k_cache"], a["v_cache"], a["cu_seqlens_q"], lens, table)
            want = kvops.paged_attention(q, a["k_cache"], a["v_cache"], a["cu_seqlens_q"], lens, table, 1)
            torch.testing.assert_close(got, want, **TOL[torch.float32])
        self.assertEqual(counter.frame_count, 1)


if __name__ == "__main__":
    unittest.main()
