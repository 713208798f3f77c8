"""``kvops.integrations.flashinfer.BatchDecodeWithPagedKVCacheWrapper`` on FlashInfer's decode test grid.

Ported from FlashInfer's ``tests/attention/test_batch_decode_kernels.py`` (``test_batch_decode_with_paged_kv_cache``:
batch sizes x kv lengths x page sizes x GQA x head_dim x kv_layout x pos_encoding_mode x logits_soft_cap x
return_lse x kv dtype x contiguous or strided caches), sampled and kept small for CPU. FlashInfer compares against its
own ``single_decode_with_kv_cache``; here the reference is a plain fp64 decode written below with FlashInfer's
semantics (q at position ``kv_len - 1``, key ``j`` at its cache row ``j``; ROPE_LLAMA = GPT-NeoX halves with
``pos / rope_scale * rope_theta ** (-2i / D)``; LSE in base 2).
"""

from __future__ import annotations

import itertools
import math
import random
import unittest

import expecttest
import torch

from kvops.integrations.flashinfer import BatchDecodeWithPagedKVCacheWrapper, alibi_slopes

TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}


def rope_llama(x: torch.Tensor, pos: torch.Tensor, theta: float, scale: float) -> torch.Tensor:
    """``x [..., N, H, D]`` rotated at ``pos [N]``: pairs ``(i, i + D/2)`` by ``pos / scale * theta ** (-2i / D)``."""
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d) / scale
    ang = pos.double()[:, None] * freq[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def reference_decode(q, k, v, mode, window_left, soft_cap, sm_scale, theta=1e4, rope_scale=1.0):
    """One sequence: ``q [H_q, D]``, ``k``/``v [kv_len, H_kv, D]`` (as stored) -> ``out [H_q, D]``, base-2 ``lse
    [H_q]``, fp64."""
    n, h_kv, d = k.shape
    h_q = q.shape[0]
    q, k, v = q.double(), k.double(), v.double()
    if mode == "ROPE_LLAMA":
        q = rope_llama(q[None], torch.tensor([n - 1]), theta, rope_scale)[0]
        k = rope_llama(k, torch.arange(n), theta, rope_scale)
    k = k.repeat_interleave(h_q // h_kv, dim=1)
    v = v.repeat_interleave(h_q // h_kv, dim=1)
    s = torch.einsum("hd,nhd->hn", q, k) * sm_scale
    if soft_cap > 0:
        s = soft_cap * torch.tanh(s / soft_cap)
    j = torch.arange(n, dtype=torch.float64)
    if mode == "ALIBI":
        s = s + alibi_slopes(h_q).double()[:, None] * (j - (n - 1))[None, :]
    if window_left >= 0:
        s = s.masked_fill(j[None, :] < n - 1 - window_left, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v) if n else torch.zeros(h_q, v.shape[-1],
                                                                                     dtype=torch.float64)
    return out, lse / math.log(2.0)


def make_case(batch, kv_lens, page_size, h_q, h_kv, d, layout, kv_dtype, q_dtype, contiguous, seed):
    """FlashInfer's setup: one [P, 2, ...] cache, pages shuffled across sequences; strided caches as FlashInfer's
    ``contiguous_kv=False`` (every other element of an interleaved allocation)."""
    g = torch.Generator().manual_seed(seed)
    pages = [(n + page_size - 1) // page_size for n in kv_lens]
    total = sum(pages) + 1  # one spare page nobody reads
    inner = [2, h_kv, page_size, d] if layout == "HND" else [2, page_size, h_kv, d]
    if contiguous:
        kv32 = torch.randn(total, *inner, generator=g)
    else:
        kv32 = torch.randn(total, *[x for n in inner for x in (2, n)], generator=g)[:, 1, :, 1, :, 1, :, 1, :]
    kv = kv32.to(kv_dtype)
    perm = torch.randperm(total, generator=g)[: sum(pages)].to(torch.int32)
    indptr = torch.tensor([0] + list(itertools.accumulate(pages)), dtype=torch.int32)
    last = torch.tensor([(n - 1) % page_size + 1 if n else 1 for n in kv_lens], dtype=torch.int32)
    q = torch.randn(batch, h_q, d, generator=g).to(q_dtype)
    return q, kv, indptr, perm, last


def gather(kv, indptr, indices, kv_len, b, layout, which):
    """Sequence ``b``'s first ``kv_len`` rows of K (``which=0``) or V as ``[kv_len, H_kv, D]`` (FlashInfer's test's
    concatenation of full pages and the last page)."""
    pages = kv[indices[indptr[b]:indptr[b + 1]].long(), which]
    if layout == "HND":
        pages = pages.transpose(1, 2)
    return pages.reshape(-1, *pages.shape[2:])[:kv_len]


class TestFlashInferDecodeGrid(unittest.TestCase):
    @classmethod
    def setUpClass(cls):  # hundreds of tiny reference ops: threads only add contention on a shared machine (7x)
        cls.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    @classmethod
    def tearDownClass(cls):
        torch.set_num_threads(cls.threads)

    def check(self, batch, kv_len, page_size, h_q, h_kv, d, layout, mode, soft_cap, return_lse, q_dtype, kv_dtype,
              contiguous, window_left=-1, tuple_cache=False, seed=0, ragged=False, rope=(None, None)):
        rng = random.Random(seed)
        kv_lens = [rng.randint(0, kv_len) if ragged else kv_len for _ in range(batch)]
        q, kv, indptr, indices, last = make_case(batch, kv_lens, page_size, h_q, h_kv, d, layout, kv_dtype, q_dtype,
                                                 contiguous, seed)
        wrapper = BatchDecodeWithPagedKVCacheWrapper(torch.empty(0, dtype=torch.int8), layout)
        theta, rope_scale = rope
        wrapper.plan(indptr, indices, last, h_q, h_kv, d, page_size, pos_encoding_mode=mode,
                     window_left=window_left, logits_soft_cap=soft_cap, q_data_type=q_dtype, kv_data_type=kv_dtype,
                     rope_theta=theta, rope_scale=rope_scale)
        cache = (kv[:, 0], kv[:, 1]) if tuple_cache else kv
        got = wrapper.run(q, cache, return_lse=return_lse)
        o, lse = got if return_lse else (got, None)
        self.assertEqual(o.shape, (batch, h_q, d))
        self.assertEqual(o.dtype, q_dtype)
        for b in range(batch):
            k = gather(kv, indptr, indices, kv_lens[b], b, layout, 0)
            v = gather(kv, indptr, indices, kv_lens[b], b, layout, 1)
            ref_o, ref_lse = reference_decode(q[b], k, v, mode, window_left, soft_cap or 0.0, d ** -0.5,
                                              theta or 1e4, rope_scale or 1.0)
            torch.testing.assert_close(o[b].double(), ref_o, atol=TOL[q_dtype], rtol=TOL[q_dtype],
                                       msg=lambda m: f"batch {b} kv_len {kv_lens[b]}: {m}")
            if return_lse:
                if kv_lens[b] == 0:
                    self.assertTrue(torch.isneginf(lse[b]).all())
                else:
                    torch.testing.assert_close(lse[b].double(), ref_lse, atol=1e-3, rtol=1e-4)
        # user-allocated outputs (FlashInfer's test's out=)
        o_buf, lse_buf = torch.empty_like(o), torch.empty(batch, h_q)
        wrapper.run(q, cache, out=o_buf, lse=lse_buf)
        self.assertTrue(torch.equal(o_buf, o))

    def test_grid(self):
        # FlashInfer: batch [12, 17, 128] x kv_len [54, 97, 512, 2048, 16384] x page_size [1, 8, 16] x heads
        # (4 KV; 4 or 32 query) x head_dim [128, 256, 512] x pos_encoding_mode [NONE, ROPE_LLAMA] x kv dtype
        # [fp16, fp8]. A deterministic sample of a smaller grid (plus head_dim 80 and GQA 5:1, HND, soft cap, bf16).
        grid = list(itertools.product(
            [1, 5, 12], [1, 17, 54, 97], [1, 8, 16], [(4, 4), (8, 2), (5, 1)], [64, 80], ["NHD", "HND"],
            ["NONE", "ROPE_LLAMA"], [0.0, 30.0], [False, True], [torch.float16, torch.bfloat16],
            ["same", "fp8"], [True, False]))
        rng = random.Random(20)
        for i, case in enumerate(rng.sample(grid, 72)):
            batch, kv_len, page_size, (h_q, h_kv), d, layout, mode, cap, ret, q_dtype, kv, contig = case
            kv_dtype = torch.float8_e4m3fn if kv == "fp8" else q_dtype
            with self.subTest(case=case):
                self.check(batch, kv_len, page_size, h_q, h_kv, d, layout, mode, cap, ret, q_dtype, kv_dtype, contig,
                           seed=i, tuple_cache=i % 2 == 0)

    def test_rope_llama_long_context_and_scales(self):
        # FlashInfer's ROPE_LLAMA cases: kv_len up to the thousands; rope_theta / rope_scale of Llama-style models
        for kv_len, theta, scale in [(512, None, None), (700, 5e5, 8.0), (97, 1e6, 2.0)]:
            with self.subTest(kv_len=kv_len, theta=theta, scale=scale):
                self.check(3, kv_len, 16, 8, 2, 64, "HND", "ROPE_LLAMA", 0.0, True, torch.float16, torch.float16,
                           True, rope=(theta, scale))

    def test_ragged_batch_window_alibi(self):
        # sequences of different lengths (some empty), a sliding window, ALiBi
        for layout, mode, window in itertools.product(["NHD", "HND"], ["NONE", "ROPE_LLAMA", "ALIBI"], [-1, 0, 9]):
            with self.subTest(layout=layout, mode=mode, window=window):
                self.check(6, 40, 8, 8, 2, 64, layout, mode, 0.0, True, torch.float32, torch.float32, True,
                           window_left=window, ragged=True, seed=3)

    def test_scales_and_compile(self):
        # q_scale/k_scale fold into sm_scale, v_scale scales the output (FlashInfer's run); run traces as one graph
        q, kv, indptr, indices, last = make_case(2, [30, 11], 8, 4, 2, 64, "NHD", torch.float32, torch.float32,
                                                 True, 7)
        w = BatchDecodeWithPagedKVCacheWrapper(None, "NHD")
        w.plan(indptr, indices, last, 4, 2, 64, 8, q_data_type=torch.float32, sm_scale=0.1)
        base = w.run(q, kv)
        scaled = w.run(q * 2, kv, q_scale=0.5, k_scale=1.0, v_scale=3.0)
        torch.testing.assert_close(scaled, 3 * base)
        torch._dynamo.reset()
        compiled = torch.compile(lambda q, kv: w.run(q, kv, return_lse=True), fullgraph=True, backend="eager")
        o, lse = compiled(q, kv)
        ref_o, ref_lse = w.run(q, kv, return_lse=True)
        torch.testing.assert_close(o, ref_o)
        torch.testing.assert_close(lse, ref_lse)


class TestFlashInferContracts(expecttest.TestCase):
    def setUp(self):
        self.q, self.kv, self.indptr, self.indices, self.last = make_case(
            2, [30, 11], 8, 4, 2, 64, "NHD", torch.float16, torch.float16, True, 1)

    def plan_error(self, **kw):
        args = dict(indptr=self.indptr, indices=self.indices, last_page_len=self.last, num_qo_heads=4,
                    num_kv_heads=2, head_dim=64, page_size=8)
        args.update(kw)
        with self.assertRaises(ValueError) as cm:
            BatchDecodeWithPagedKVCacheWrapper(None).plan(**args)
        return str(cm.exception)

    def test_plan_errors(self):
        self.assertExpectedInline(self.plan_error(pos_encoding_mode="ROPE"), """\
BatchDecodeWithPagedKVCacheWrapper.plan: pos_encoding_mode must be one of ('NONE', 'ROPE_LLAMA', 'ALIBI'), got 'ROPE'.""")
        self.assertExpectedInline(self.plan_error(last_page_len=torch.tensor([9, 3], dtype=torch.int32)), """\
BatchDecodeWithPagedKVCacheWrapper.plan: last_page_len[0] = 9 must be in [1, page_size = 8] (the keys in sequence 0's last page).""")
        self.assertExpectedInline(self.plan_error(indptr=self.indptr.long()), """BatchDecodeWithPagedKVCacheWrapper.plan: indptr must be a 1-D int32 tensor, got ((3,), torch.int64). Pass indptr.to(torch.int32).""")
        self.assertExpectedInline(self.plan_error(num_qo_heads=5), """\
BatchDecodeWithPagedKVCacheWrapper.plan: num_qo_heads (5) must be a multiple of num_kv_heads (2) (GQA).""")
        self.assertExpectedInline(self.plan_error(indptr=torch.tensor([0, 4, 99], dtype=torch.int32)), """\
BatchDecodeWithPagedKVCacheWrapper.plan: indptr = [0, 4, 99] must be non-decreasing from 0 to at most len(indices) = 6 (sequence b's pages are indices[indptr[b]:indptr[b + 1]]).""")

    def test_run_errors(self):
        w = BatchDecodeWithPagedKVCacheWrapper(None, "HND")
        with self.assertRaises(RuntimeError) as cm:
            w.run(self.q, self.kv)
        self.assertExpectedInline(str(cm.exception), """BatchDecodeWithPagedKVCacheWrapper.run: call plan() first.""")
        w.plan(self.indptr, self.indices, self.last, 4, 2, 64, 8)
        with self.assertRaises(ValueError) as cm:
            w.run(self.q, self.kv)  # an NHD cache given to an HND wrapper
        self.assertExpectedInline(str(cm.exception), """BatchDecodeWithPagedKVCacheWrapper.run: k_cache [7, 8, 2, 64] is not HND [P, H_kv, page_size, D] with page_size 8 and 2 KV heads as planned. It may be an NHD cache: construct the wrapper with kv_layout="NHD".""")
        with self.assertRaises(ValueError) as cm:
            w.run(self.q.float(), self.kv.transpose(2, 3))
        self.assertExpectedInline(str(cm.exception), """\
BatchDecodeWithPagedKVCacheWrapper.run: planned q_data_type torch.float16 and kv_data_type torch.float16, got q torch.float32, k_cache torch.float16 and v_cache torch.float16; plan with these dtypes.""")

    def test_out_and_lse_buffers_are_checked_before_the_attention(self):
        # before: a wrong lse layout gave torch's raw broadcast error after the attention ran, and a float32 out for
        # float16 q was accepted (the result silently came back in the buffer's dtype)
        w = BatchDecodeWithPagedKVCacheWrapper(None)
        w.plan(self.indptr, self.indices, self.last, 4, 2, 64, 8, q_data_type=torch.float16)
        for kw in (dict(lse=torch.empty(4, 2)), dict(out=torch.empty(2, 4, 64)), dict(out=torch.empty(2, 4, 32,
                                                                                                  dtype=torch.float16))):
            with self.subTest(list(kw)[0]), self.assertRaises(ValueError) as cm:
                w.run(self.q, self.kv, return_lse=True, **kw)
            self.assertIn("pass", str(cm.exception))
        with self.assertRaises(ValueError) as cm:
            w.run(self.q, self.kv, lse=torch.empty(4, 2), return_lse=True)
        self.assertExpectedInline(str(cm.exception), """BatchDecodeWithPagedKVCacheWrapper.run: lse must be a torch.float32 tensor of shape [2, 4] on cpu, got [4, 2] torch.float32 on cpu; pass lse=None to get a new one.""")
        out, lse = torch.empty(2, 4, 64, dtype=torch.float16), torch.empty(2, 4)
        o, l2 = w.run(self.q, self.kv, out=out, lse=lse, return_lse=True)
        self.assertTrue(o.data_ptr() == out.data_ptr() and l2.data_ptr() == lse.data_ptr())


if __name__ == "__main__":
    unittest.main()
