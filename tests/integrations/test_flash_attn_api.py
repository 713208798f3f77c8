"""kvops.flash_attn_with_kvcache: against a gather + fp64 softmax reference (FlashAttention semantics), cache writes
bit-exact, paged and contiguous forms, bottom-right causal, window_size, softcap, LSE, compile, errors everywhere."""

import itertools
import math
import unittest

import expecttest
import torch

import kvops
from tests.contract import raises_everywhere

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}
FP8 = torch.float8_e4m3fn
PY_ERROR = torch._dynamo.exc.Unsupported  # an error raised by Python code Dynamo traces ("Observed exception")


def ref_flash(q, k_cache, v_cache, k, v, cache_seqlens, block_table, scale, causal, window, softcap,
              k_scale=None, v_scale=None):
    """Write k/v token by token, then attend per (sequence, query, head) in fp64. Returns (out, lse, k_cache, v_cache)."""
    kc, vc = k_cache.clone(), v_cache.clone()
    batch, s_q, h_q, _ = q.shape
    h_kv, d_v = k_cache.shape[2], v_cache.shape[3]
    if block_table is None:
        block_table = torch.arange(batch).view(batch, 1)
    bs = kc.shape[1]
    s_new = 0 if k is None else k.shape[1]
    lens = [cache_seqlens] * batch if isinstance(cache_seqlens, int) else cache_seqlens.tolist()

    def quant(x, scale_, h):
        return x if scale_ is None else (x.float() / scale_[h % scale_.numel()]).clamp(-448, 448).to(FP8)

    def deq(x, scale_, h):
        return x.double() if scale_ is None else x.double() * float(scale_[h % scale_.numel()])

    for b in range(batch):
        for t in range(s_new):
            pos = lens[b] + t
            blk = int(block_table[b, pos // bs])
            for h in range(h_kv):
                kc[blk, pos % bs, h] = quant(k[b, t, h], k_scale, h)
                vc[blk, pos % bs, h] = quant(v[b, t, h], v_scale, h)
    out = torch.zeros(batch, s_q, h_q, d_v, dtype=torch.float64)
    lse = torch.full((batch, h_q, s_q), -math.inf, dtype=torch.float64)
    left, right = window[0], 0 if causal else window[1]
    for b in range(batch):
        seq_len = lens[b] + s_new
        where = [(int(block_table[b, j // bs]), j % bs) for j in range(seq_len)]
        for i, h in itertools.product(range(s_q), range(h_q)):
            kvh = h // (h_q // h_kv)
            qpos = seq_len - s_q + i
            keys = [j for j in range(seq_len) if (right < 0 or j <= qpos + right) and (left < 0 or j >= qpos - left)]
            if not keys:
                continue
            kk = torch.stack([deq(kc[blk, r, kvh], k_scale, kvh) for blk, r in (where[j] for j in keys)])
            vv = torch.stack([deq(vc[blk, r, kvh], v_scale, kvh) for blk, r in (where[j] for j in keys)])
            s = scale * (kk @ q[b, i, h].double())
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            lse[b, h, i] = torch.logsumexp(s, 0)
            out[b, i, h] = torch.softmax(s, 0) @ vv
    return out, lse, kc, vc


def paged_setup(batch, num_blocks, block_size, h_kv, d, d_v, dtype, width, seed=0):
    """Random caches and a block table of distinct, shuffled blocks padded with -1 past what is used."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, block_size, h_kv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, h_kv, d_v, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[: batch * width].view(batch, width).to(torch.int32)
    return k_cache, v_cache, table


class TestFlashAttnWithKVCache(expecttest.TestCase):
    def check(self, got, want, dtype, lse=None, want_lse=None):
        tol = TOL[dtype]
        self.assertEqual(got.dtype, dtype)
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
        if lse is not None:
            self.assertEqual(lse.dtype, torch.float32)
            self.assertTrue(torch.equal(lse.isinf(), want_lse.isinf()))
            fin = ~want_lse.isinf()
            torch.testing.assert_close(lse.double()[fin], want_lse[fin], atol=1e-4, rtol=1e-4)

    def test_paged_matches_reference(self):
        cases = [  # (B, S_q, S_new, H_q, H_kv, D, D_v, block_size, width, cache_seqlens, causal, window, softcap)
            (3, 1, 1, 4, 2, 16, 16, 4, 3, [5, 0, 10], True, (-1, -1), 0.0),  # decode; an empty cache
            (2, 4, 4, 10, 2, 80, 80, 4, 4, [3, 9], True, (-1, -1), 0.0),  # GQA 5:1, head_dim 80, chunk append
            (2, 3, 3, 3, 1, 8, 24, 1, 12, [2, 7], False, (-1, -1), 0.0),  # block_size 1, D_v != D, non-causal
            (2, 5, 2, 2, 2, 16, 16, 4, 3, [1, 6], True, (2, 0), 0.0),  # S_q > S_new, sliding window
            (2, 3, 3, 4, 4, 16, 16, 2, 6, [4, 0], False, (3, -1), 5.0),  # left window, non-causal, softcap
            (1, 2, 0, 4, 2, 16, 16, 4, 2, [6], True, (-1, -1), 0.0),  # zero new tokens (k of length 0)
        ]
        for dtype, case in itertools.product((torch.float32, torch.bfloat16, torch.float16), cases):
            b, s_q, s_new, h_q, h_kv, d, dv, bs, width, lens, causal, window, softcap = case
            with self.subTest(dtype=dtype, case=case):
                k_cache, v_cache, table = paged_setup(b, b * width + 2, bs, h_kv, d, dv, dtype, width, seed=s_q)
                for row, n in enumerate(lens):  # pad past the used blocks with -1: never read
                    table[row, -(-(n + s_new) // bs):] = -1
                q = torch.randn(b, s_q, h_q, d).to(dtype)
                k, v = torch.randn(b, s_new, h_kv, d).to(dtype), torch.randn(b, s_new, h_kv, dv).to(dtype)
                seqlens = torch.tensor(lens, dtype=torch.int32)
                scale = 0.7 if softcap else d ** -0.5
                want, want_lse, want_k, want_v = ref_flash(q, k_cache, v_cache, k, v, seqlens, table, scale, causal,
                                                           window, softcap)
                out, lse = kvops.flash_attn_with_kvcache(
                    q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=table,
                    softmax_scale=scale if softcap else None, causal=causal, window_size=window, softcap=softcap,
                    return_softmax_lse=True,
                )
                self.assertTrue(torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v))
                self.assertEqual(lse.shape, (b, h_q, s_q))
                self.check(out, want, dtype, lse, want_lse)

    def test_contiguous_form(self):
        """Without block_table, k_cache [B, S, H_kv, D] (e.g. K/V views of one [B, S, 2, H, D] allocation)."""
        for dtype in (torch.float32, torch.bfloat16):
            kv = torch.randn(3, 12, 2, 2, 16).to(dtype)
            k_cache, v_cache = kv[:, :, 0], kv[:, :, 1]
            q = torch.randn(3, 2, 6, 16).to(dtype)
            k, v = torch.randn(3, 2, 2, 16).to(dtype), torch.randn(3, 2, 2, 16).to(dtype)
            for lens in (torch.tensor([0, 5, 10], dtype=torch.int32), 4):
                want, want_lse, want_k, want_v = ref_flash(q, k_cache, v_cache, k, v, lens, None, 0.25, True,
                                                           (-1, -1), 0.0)
                out, lse = kvops.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True,
                                                         return_softmax_lse=True)
                self.assertTrue(torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v))
                self.check(out, want, dtype, lse, want_lse)

    def test_no_new_tokens_and_default_seqlens(self):
        k_cache, v_cache, table = paged_setup(2, 8, 4, 2, 16, 16, torch.float32, 2)
        q = torch.randn(2, 1, 4, 16)
        for lens in (torch.tensor([0, 7], dtype=torch.int32), None):  # None: the whole addressable capacity (8)
            want, want_lse, _, _ = ref_flash(q, k_cache, v_cache, None, None, 8 if lens is None else lens, table,
                                             0.25, False, (-1, -1), 0.0)
            out, lse = kvops.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                                                     return_softmax_lse=True)
            self.check(out, want, torch.float32, lse, want_lse)

    def test_empty_sequence_gives_zeros_and_minus_inf_lse(self):
        k_cache, v_cache, table = paged_setup(2, 8, 4, 2, 16, 16, torch.float32, 2)
        k_cache[table[0]] = float("nan")  # never read: sequence 0 is empty
        out, lse = kvops.flash_attn_with_kvcache(
            torch.randn(2, 1, 2, 16), k_cache, v_cache, cache_seqlens=torch.tensor([0, 3], dtype=torch.int32),
            block_table=table, causal=True, return_softmax_lse=True,
        )
        self.assertTrue(torch.equal(out[0], torch.zeros(1, 2, 16)))
        self.assertTrue(bool(lse[0].isneginf().all()) and bool(lse[1].isfinite().all()))

    def test_fp8_cache(self):
        k_cache, v_cache, table = paged_setup(2, 8, 4, 2, 16, 16, torch.float32, 3)
        k_cache, v_cache = k_cache.to(FP8), v_cache.to(FP8)
        q, k, v = torch.randn(2, 2, 4, 16), torch.randn(2, 2, 2, 16) * 3, torch.randn(2, 2, 2, 16)
        k_scale, v_scale = torch.tensor([0.5, 0.25]), torch.tensor([0.1])
        lens = torch.tensor([3, 9], dtype=torch.int32)
        want, _, want_k, want_v = ref_flash(q, k_cache, v_cache, k, v, lens, table, 0.25, True, (-1, -1), 0.0,
                                            k_scale, v_scale)
        out = kvops.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table,
                                            causal=True, k_scale=k_scale, v_scale=v_scale)
        self.assertTrue(torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8)))
        self.assertTrue(torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8)))
        self.check(out, want, torch.float32)

    def test_content_dependent_overflow_is_contained_and_debug_check(self):
        """Unchecked (value checks off) cache_seqlens past the capacity: nothing outside the table's blocks changes;
        the eager check raises (tests/errors/test_value_checks.py: the default mode raises before writing)."""
        k_cache, v_cache, table = paged_setup(2, 8, 4, 2, 16, 16, torch.float32, 2)
        before_k = k_cache.clone()
        lens = torch.tensor([2, 7], dtype=torch.int32)  # sequence 1: positions 7, 8, 9 but capacity is 8
        k = torch.randn(2, 3, 2, 16)
        with kvops.value_checks("off"):
            out = kvops.flash_attn_with_kvcache(torch.randn(2, 3, 2, 16), k_cache, v_cache, k, k,
                                                cache_seqlens=lens, block_table=table, causal=True)
        self.assertTrue(bool(out.isfinite().all()))
        untouched = torch.ones(8, dtype=torch.bool)
        untouched[table.flatten().long()] = False
        self.assertTrue(torch.equal(k_cache[untouched], before_k[untouched]))
        self.assertTrue(torch.equal(k_cache[table[1, 1], 3], k[1, 0]))  # position 7 was written
        with self.assertRaises(RuntimeError) as cm:
            kvops.check_kvcache_capacity(k_cache, lens, table, num_new_tokens=3)
        self.assertExpectedInline(
            str(cm.exception),
            """flash_attn_with_kvcache: sequence 1 has cache_seqlens=7; with 3 new tokens it needs positions [0, 10) but block_table addresses only 8 tokens (2 blocks x block_size 4). Give block_table more blocks or write fewer tokens.""",
        )
        kvops.check_kvcache_capacity(k_cache, lens, table, num_new_tokens=1)
        with self.assertRaises(RuntimeError) as cm:  # before: "needs positions [0, 0) but block_table addresses ..."
            kvops.check_kvcache_capacity(k_cache, torch.tensor([2, -1], dtype=torch.int32), table, num_new_tokens=1)
        self.assertExpectedInline(str(cm.exception), """flash_attn_with_kvcache: sequence 1 has cache_seqlens=-1; cache_seqlens counts the tokens already in sequence 1's cache and must be >= 0. Pass 0 for an empty sequence.""")
        bad_table = table.clone()
        bad_table[0, 0] = 8
        with self.assertRaises(RuntimeError) as cm:
            kvops.check_kvcache_capacity(k_cache, lens, bad_table, num_new_tokens=1)
        self.assertExpectedInline(
            str(cm.exception), """flash_attn_with_kvcache: block_table[0, 0] = 8 is not a block of the cache: block ids must be in [0, 8) (P = 8 blocks) for the blocks sequence 0 uses."""
        )


class TestCompile(unittest.TestCase):
    def test_compiled_decode_loop_matches_eager_without_recompiles(self):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        eager_caches = paged_setup(2, 10, 4, 2, 16, 16, torch.float32, 5)
        compiled_caches = tuple(t.clone() for t in eager_caches)
        fn = torch.compile(kvops.flash_attn_with_kvcache, fullgraph=True, backend="aot_eager")
        lens = torch.tensor([0, 6], dtype=torch.int32)
        for _ in range(5):
            q, k, v = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
            want = kvops.flash_attn_with_kvcache(q, eager_caches[0], eager_caches[1], k, v, cache_seqlens=lens,
                                                 block_table=eager_caches[2], causal=True)
            got = fn(q, compiled_caches[0], compiled_caches[1], k, v, cache_seqlens=lens,
                     block_table=compiled_caches[2], causal=True)
            self.assertTrue(torch.equal(got, want))
            lens = lens + 1
        self.assertTrue(torch.equal(eager_caches[0], compiled_caches[0]))
        self.assertEqual(torch._dynamo.utils.counters["stats"]["unique_graphs"], 1)


class TestContracts(expecttest.TestCase):
    def setUp(self):
        self.k_cache, self.v_cache, self.table = paged_setup(2, 8, 4, 2, 16, 16, torch.float32, 3)
        self.q = torch.randn(2, 1, 4, 16)
        self.k = torch.randn(2, 1, 2, 16)
        self.lens = torch.tensor([1, 2], dtype=torch.int32)

    def check(self, fn, *args, exc=ValueError, compile_exc=PY_ERROR):
        return raises_everywhere(self, exc, fn, args, compile_exc=compile_exc)

    def test_missing_caches_and_kv_pairs(self):
        f = kvops.flash_attn_with_kvcache
        msg = self.check(lambda q, kc, bt: f(q, kc, None, block_table=bt), self.q, self.k_cache, self.table)
        self.assertExpectedInline(msg, """flash_attn_with_kvcache: v_cache must be provided (the V cache, with k_cache).""")
        msg = self.check(lambda q, vc, bt: f(q, None, vc, block_table=bt), self.q, self.v_cache, self.table)
        self.assertExpectedInline(
            msg,
            """flash_attn_with_kvcache: k_cache must be provided. (k_cache can only be None when only_qv=True, the MLA q-only path, which kvops does not support.)""",
        )
        msg = self.check(lambda q, kc, vc, k, s, bt: f(q, kc, vc, k, cache_seqlens=s, block_table=bt),
                         self.q, self.k_cache, self.v_cache, self.k, self.lens, self.table)
        self.assertExpectedInline(msg, """flash_attn_with_kvcache: k and v must be given together (got k only).""")
        msg = self.check(lambda q, kc, vc, k, bt: f(q, kc, vc, k, k, block_table=bt),
                         self.q, self.k_cache, self.v_cache, self.k, self.table)
        self.assertExpectedInline(
            msg, """flash_attn_with_kvcache: k/v were given without cache_seqlens; pass cache_seqlens to say where they go."""
        )

    def test_index_dtypes(self):
        f = kvops.flash_attn_with_kvcache
        msg = self.check(lambda q, kc, vc, bt: f(q, kc, vc, cache_seqlens=1, block_table=bt),
                         self.q, self.k_cache, self.v_cache, self.table.long())
        self.assertExpectedInline(
            msg,
            """flash_attn_with_kvcache: block_table must be a 2-D int32 tensor [batch, max_blocks], got shape (2, 3) and dtype torch.int64. Pass block_table.to(torch.int32).""",
        )
        msg = self.check(lambda q, kc, vc, s, bt: f(q, kc, vc, cache_seqlens=s, block_table=bt),
                         self.q, self.k_cache, self.v_cache, self.lens.long(), self.table)
        self.assertExpectedInline(
            msg,
            """flash_attn_with_kvcache: cache_seqlens must be an int or an int32 tensor of shape [2], got shape (2,) and dtype torch.int64. Pass cache_seqlens.to(torch.int32).""",
        )
        msg = self.check(lambda q, kc, vc, bt: f(q, kc, vc, cache_seqlens=1, block_table=bt),
                         self.q, self.k_cache, self.v_cache, self.table[:1])
        self.assertExpectedInline(msg, """flash_attn_with_kvcache: block_table has 1 rows but q has batch 2; pass one block_table row per sequence ([batch, max_blocks]).""")

    def test_gqa_ratio(self):
        f = kvops.flash_attn_with_kvcache
        msg = self.check(lambda q, kc, vc, bt: f(q, kc, vc, cache_seqlens=1, block_table=bt),
                         torch.randn(2, 1, 3, 16), self.k_cache, self.v_cache, self.table)
        self.assertExpectedInline(
            msg,
            """flash_attn_with_kvcache: num_heads (3) must be a multiple of num_kv_heads (2) (GQA); got q shape (2, 1, 3, 16) and k_cache shape (8, 4, 2, 16). If the cache was allocated with another head count than the model's, allocate k_cache and v_cache with the model's num_kv_heads (a divisor of 3); else pass q with a multiple of 2 heads.""",
        )

    def test_write_past_capacity_from_shapes(self):
        f = kvops.flash_attn_with_kvcache
        k = torch.randn(2, 13, 2, 16)  # capacity: 3 blocks x 4 = 12
        msg = self.check(lambda q, kc, vc, k, s, bt: f(q, kc, vc, k, k, cache_seqlens=s, block_table=bt),
                         self.q, self.k_cache, self.v_cache, k, self.lens, self.table)
        self.assertExpectedInline(
            msg,
            """flash_attn_with_kvcache: writing 13 new tokens exceeds the capacity addressable by the cache: 12 tokens (max_blocks 3 x block_size 4). Give block_table more blocks or write fewer tokens.""",
        )
        msg = self.check(lambda q, kc, vc, k, bt: f(q, kc, vc, k, k, cache_seqlens=11, block_table=bt),
                         self.q, self.k_cache, self.v_cache, torch.randn(2, 2, 2, 16), self.table)
        self.assertExpectedInline(
            msg,
            """flash_attn_with_kvcache: writing 2 new tokens at cache_seqlens=11 exceeds the capacity addressable by the cache: 12 tokens (max_blocks 3 x block_size 4). Give block_table more blocks or write fewer tokens.""",
        )
        kc = torch.zeros(2, 5, 2, 16)  # contiguous form: capacity 5
        msg = self.check(lambda q, kc, k: f(q, kc, kc, k, k, cache_seqlens=5), self.q, kc, self.k)
        self.assertExpectedInline(
            msg,
            """flash_attn_with_kvcache: writing 1 new token at cache_seqlens=5 exceeds the capacity addressable by the cache: 5 tokens (max_blocks 1 x block_size 5). Give block_table more blocks or write fewer tokens.""",
        )

    def test_negative_cache_seqlens(self):
        f = kvops.flash_attn_with_kvcache
        msg = self.check(lambda q, kc, vc, bt: f(q, kc, vc, cache_seqlens=-1, block_table=bt),
                         self.q, self.k_cache, self.v_cache, self.table)
        self.assertExpectedInline(msg, """flash_attn_with_kvcache: cache_seqlens must be >= 0 (tokens already in the cache), got -1.""")

    def test_shapes(self):
        f = kvops.flash_attn_with_kvcache
        msg = self.check(lambda q, kc, vc, k, s, bt: f(q, kc, vc, k, k, cache_seqlens=s, block_table=bt),
                         self.q, self.k_cache, self.v_cache, torch.randn(2, 1, 4, 16), self.lens, self.table)
        self.assertExpectedInline(
            msg,
            """flash_attn_with_kvcache: k must be [batch=2, seqlen_new, num_kv_heads=2, head_dim=16] (k and v with the same seqlen_new), got shape (2, 1, 4, 16). The cache of shape (8, 4, 2, 16) read as kv_layout="NHD" has 2 heads, but its dim of size 4 fits the 4 heads of k: it may be an HND cache [num_blocks, num_kv_heads, block_size, head_dim]; if so, flash_attn_with_kvcache takes NHD caches only: pass its NHD view cache.transpose(1, 2) (no copy), or use kvops.paged_cache_write / kvops.paged_attention with kv_layout="HND".""",
        )
        msg = self.check(lambda q, kc: f(q, kc, kc, cache_seqlens=1), self.q, torch.zeros(3, 8, 2, 16))
        self.assertExpectedInline(
            msg,
            """flash_attn_with_kvcache: without block_table, k_cache is [batch, seqlen_cache, num_kv_heads, head_dim] and its batch (3) must equal q's (2); pass cache_batch_idx (int32 [2]) to say which k_cache row each sequence uses.""",
        )
        msg = self.check(lambda q, kc, bt: f(q, kc, kc, cache_seqlens=1, block_table=bt), self.q[0], self.k_cache,
                         self.table)
        self.assertExpectedInline(
            msg, """flash_attn_with_kvcache: q must be 4-D [batch, seqlen_q, num_heads, head_dim], got shape (1, 4, 16)."""
        )

    def test_op_errors_propagate(self):
        """Errors found by the write op's validator (fake rule): TorchRuntimeError under compile."""
        f = kvops.flash_attn_with_kvcache
        msg = self.check(lambda q, kc, vc, k, s, bt: f(q, kc, vc, k, k, cache_seqlens=s, block_table=bt),
                         self.q, self.k_cache, self.v_cache, self.k.half(), self.lens, self.table,
                         compile_exc=torch._dynamo.exc.TorchRuntimeError)
        self.assertExpectedInline(
            msg,
            """kvops.paged_cache_write: key dtype torch.float16 does not match k_cache dtype torch.float32. Cast key to torch.float32.""",
        )
        # the attention's contract is checked in Python before the append (a failing call writes nothing):
        # under fullgraph=True an "Observed exception" (Unsupported) carrying it, as the composite's own checks
        msg = self.check(lambda q, kc, vc, bt: f(q, kc, vc, cache_seqlens=1, block_table=bt, softcap=-1.0),
                         self.q, self.k_cache, self.v_cache, self.table,
                         compile_exc=torch._dynamo.exc.Unsupported)
        self.assertExpectedInline(msg, """kvops.paged_attention: softcap must be >= 0 (0 disables it), got -1.0.""")


if __name__ == "__main__":
    unittest.main()
