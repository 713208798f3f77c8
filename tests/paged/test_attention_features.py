"""Attention features (docs/attention_features.md): ALiBi, a right window, ``cache_leftpad``, StreamingLLM sink tokens
and RoPE at read time, in ``kvops.paged_attention`` (native CPU kernel, composite, Triton in the interpreter) and
``kvops.flash_attn_with_kvcache``.

* ``TestFlashAttentionGrid``: FlashAttention's ``test_flash_attn_kvcache`` grid (ALiBi x local window x causal x
  MHA/GQA/MQA x paged x left padding x dtype), sampled, against FlashAttention's own reference construction (dense
  cache, key padding mask, ``attn_bias_from_alibi_slopes``, bottom-right local mask over the unpadded keys).
* ``TestPagedFeatures``: every feature and their combinations against the plain fp64 reference
  (``kvops/reference/attention.py``) on odd shapes (GQA 5:1, head_dim 80, block_size 1, HND, bf16).
* ``TestTritonFeatures``: the Triton kernels (decode and prefill) in the interpreter, small shapes.
* ``TestFeatureContracts``: the new arguments' errors in eager, compile and export; value contracts.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import unittest

import expecttest
import torch

import triton
import triton.language as tl

import kvops
from kvops._checks.features import AttnFeatures
from kvops.cpu.paged_attention import paged_attention as composite
from kvops.triton.paged_tiles import _sincos
from kvops.reference.attention import reference
from tests.contract import raises_everywhere

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}
PY_ERROR = torch._dynamo.exc.Unsupported


def fa_reference(q, k_cache, v_cache, cache_seqlens, seqlen_new, cache_leftpad, causal, window, alibi_slopes):
    """FlashAttention's reference for ``flash_attn_with_kvcache`` (tests/test_flash_attn.py: ``attention_ref`` with
    ``key_padding_mask``, ``key_leftpad`` and ``attn_bias_from_alibi_slopes``), in fp64, on a dense cache
    ``[B, S, H_kv, D]`` that already holds the new tokens. Causal ALiBi uses FlashAttention's per-row-constant form
    ``slope * (j - (S - 1))``: only the output is compared (LSE differs by a per-query constant, see the docs)."""
    batch, s_q, h_q, d = q.shape
    seqlen_k, h_kv = k_cache.shape[1], k_cache.shape[2]
    k = k_cache.double().repeat_interleave(h_q // h_kv, dim=2)
    v = v_cache.double().repeat_interleave(h_q // h_kv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double() * d ** -0.5, k)
    col = torch.arange(seqlen_k)[None, :]
    lens = cache_seqlens.long()[:, None] + seqlen_new
    pad = torch.zeros(batch, 1, dtype=torch.long) if cache_leftpad is None else cache_leftpad.long()[:, None]
    key_mask = (col < lens) & (col >= pad)  # [B, S]
    sk = key_mask.sum(-1)[:, None, None]  # unpadded keys per sequence
    row = torch.arange(s_q)[None, :, None]
    col_rel = (torch.arange(seqlen_k)[None, None, :] - pad[:, :, None]).double()  # key index among the unpadded
    qpos = row + sk - s_q  # bottom-right aligned query position
    if alibi_slopes is not None:
        slopes = alibi_slopes.double().expand(batch, h_q)[:, :, None, None]
        if causal:
            bias = (torch.arange(seqlen_k).double() - (seqlen_k - 1)) * slopes
        else:
            bias = -slopes * (qpos - col_rel).abs()[:, None]
        scores = scores + bias
    left, right = window
    if causal:
        right = 0
    mask = key_mask[:, None, :].expand(batch, s_q, seqlen_k).clone()
    if right >= 0:
        mask &= col_rel <= qpos + right
    if left >= 0:
        mask &= col_rel >= qpos - left
    scores = scores.masked_fill(~mask[:, None], -math.inf)
    p = torch.softmax(scores, -1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


class TestFlashAttentionGrid(unittest.TestCase):
    """Ported from FlashAttention's ``test_flash_attn_kvcache`` parameter grid (sampled, small shapes)."""

    def run_case(self, seqlen_q, seqlen_k, d, causal, local, alibi, mha_type, paged, leftpad, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        batch, nheads = 2, 6
        nheads_k = {"mha": 6, "gqa": 3, "mqa": 1}[mha_type]
        window = (-1, -1) if not local else tuple(int(x) for x in torch.randint(0, seqlen_k, (2,), generator=g))
        q = torch.randn(batch, seqlen_q, nheads, d, generator=g).to(dtype)
        seqlen_new = seqlen_q
        k = torch.randn(batch, seqlen_new, nheads_k, d, generator=g).to(dtype)
        v = torch.randn(batch, seqlen_new, nheads_k, d, generator=g).to(dtype)
        k_cache = torch.randn(batch, seqlen_k, nheads_k, d, generator=g).to(dtype)
        v_cache = torch.randn(batch, seqlen_k, nheads_k, d, generator=g).to(dtype)
        cache_seqlens = torch.randint(0, seqlen_k - seqlen_new + 1, (batch,), generator=g, dtype=torch.int32)
        cache_leftpad = None
        if leftpad:
            cache_leftpad = torch.tensor([int(torch.randint(0, max(1, int(n)), (1,), generator=g)) if n > 0 else 0
                                          for n in cache_seqlens], dtype=torch.int32)
        alibi_slopes = torch.rand(batch, nheads, generator=g) * 0.3 if alibi else None
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        for b in range(batch):
            n = int(cache_seqlens[b])
            ref_k[b, n:n + seqlen_new], ref_v[b, n:n + seqlen_new] = k[b], v[b]
        if paged is None:
            kc, vc, table = k_cache.clone(), v_cache.clone(), None
        else:  # FlashAttention's _generate_block_kvcache: a shuffled pool, sequence b's blocks in its table row
            nblocks = math.ceil(seqlen_k / paged)
            perm = torch.randperm(batch * nblocks, generator=g)
            table = perm.view(batch, nblocks).to(torch.int32)
            kc = torch.zeros(batch * nblocks, paged, nheads_k, d, dtype=dtype)
            vc = torch.zeros_like(kc)
            padded = nblocks * paged
            kfull = torch.zeros(batch, padded, nheads_k, d, dtype=dtype)
            vfull = torch.zeros_like(kfull)
            kfull[:, :seqlen_k], vfull[:, :seqlen_k] = k_cache, v_cache
            kc[table.long().flatten()] = kfull.view(batch * nblocks, paged, nheads_k, d)
            vc[table.long().flatten()] = vfull.view(batch * nblocks, paged, nheads_k, d)
        out = kvops.flash_attn_with_kvcache(
            q, kc, vc, k, v, cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad, block_table=table,
            causal=causal, window_size=window, alibi_slopes=alibi_slopes,
        )
        want = fa_reference(q, ref_k, ref_v, cache_seqlens, seqlen_new, cache_leftpad, causal, window, alibi_slopes)
        torch.testing.assert_close(out.double(), want, atol=TOL[dtype] * 2, rtol=0)

    def test_grid(self):
        rng = random.Random(0)
        grid = list(itertools.product(
            [(1, 40), (3, 57), (16, 33)],  # (seqlen_q, seqlen_k)
            [False, True],  # causal
            [False, True],  # local
            [False, True],  # alibi
            ["mha", "gqa", "mqa"],
            [None, 16],  # paged block size
            [False, True],  # leftpad
            [torch.float32, torch.bfloat16],
        ))
        cases = rng.sample(grid, 24)
        # every (alibi, local, paged, leftpad) combination at least once, in fp32
        cases += [((3, 57), c, lo, al, "gqa", pg, lp, torch.float32)
                  for c, lo, al, pg, lp in itertools.product([False, True], [False, True], [True], [None, 16],
                                                             [False, True])]
        for i, (sq_sk, causal, local, alibi, mha, paged, leftpad, dtype) in enumerate(cases):
            with self.subTest(sq_sk=sq_sk, causal=causal, local=local, alibi=alibi, mha=mha, paged=paged,
                              leftpad=leftpad, dtype=dtype):
                self.run_case(*sq_sk, 32 if i % 3 else 80, causal, local, alibi, mha, paged, leftpad, dtype, i)


def make_case(seed, batch=3, block_size=16, h_q=5, h_kv=1, d=80, dtype=torch.float32, q_lens=(1, 7, 3),
              seq_lens=(70, 40, 53), width=6, layout="NHD"):
    g = torch.Generator().manual_seed(seed)
    p = batch * width + 2
    k_cache = torch.randn(p, block_size, h_kv, d, generator=g).to(dtype)
    v_cache = torch.randn(p, block_size, h_kv, d, generator=g).to(dtype)
    table = torch.randperm(p, generator=g)[: batch * width].view(batch, width).to(torch.int32)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), h_q, d, generator=g).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    if layout == "HND":  # the same tokens, head-major blocks
        k_cache, v_cache = k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous()
    return q, k_cache, v_cache, cu, lens, table


FEATURES = [
    dict(alibi_slopes="h"),
    dict(alibi_slopes="bh", window_left=9),
    dict(causal=False, window_right=4, window_left=6),
    dict(causal=False, window_right=0),
    dict(causal=False, window_right=2, alibi_slopes="h"),
    dict(cache_leftpad=(5, 0, 17)),
    dict(cache_leftpad=(3, 1, 0), window_left=12, alibi_slopes="h"),
    dict(sink_tokens=4, window_left=15),
    dict(sink_tokens=20, window_left=5),  # sinks past some queries' windows
    dict(rope_theta=1e4),
    dict(rope_theta=500.0, rope_scale=2.0, cache_leftpad=(3, 1, 0)),
    dict(rope_theta=1e4, sink_tokens=4, window_left=15),
    dict(rope_theta=1e4, sink_tokens=3, window_left=20, alibi_slopes="h", softcap=5.0, cache_leftpad=(2, 3, 4)),
]


def resolve(kw, batch, h_q, seed=0):
    kw = dict(kw)
    g = torch.Generator().manual_seed(seed)
    if kw.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = torch.rand(h_q, generator=g) * 0.3
    elif kw.get("alibi_slopes") == "bh":
        kw["alibi_slopes"] = torch.rand(batch, h_q, generator=g) * 0.3
    if "cache_leftpad" in kw:
        kw["cache_leftpad"] = torch.tensor(kw["cache_leftpad"], dtype=torch.int32)
    return kw


def split_kernel_args(kw):
    kw = dict(kw)
    fixed = dict(causal=kw.pop("causal", True), window_left=kw.pop("window_left", -1), softcap=kw.pop("softcap", 0.0))
    return fixed, kw


class TestPagedFeatures(unittest.TestCase):
    def check(self, q, k_cache, v_cache, cu, lens, table, kw, dtype, layout="NHD"):
        nhd = (k_cache, v_cache) if layout == "NHD" else (k_cache.transpose(1, 2), v_cache.transpose(1, 2))
        want, want_lse = reference(q, *nhd, cu, lens, table, **kw)
        out, lse = kvops.paged_attention(q, k_cache, v_cache, cu, lens, table, int((cu[1:] - cu[:-1]).max()),
                                         return_lse=True, kv_layout=layout, **kw)
        torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=0)
        torch.testing.assert_close(lse.double(), want_lse, atol=TOL[dtype] * 4, rtol=0)
        fixed, feats = split_kernel_args(kw)
        out_c, _ = composite(q, *nhd, cu, lens, table, int((cu[1:] - cu[:-1]).max()), q.shape[2] ** -0.5,
                             fixed["causal"], fixed["window_left"], fixed["softcap"], None, None, None,
                             AttnFeatures(**feats))
        torch.testing.assert_close(out_c.double(), want, atol=TOL[dtype], rtol=0)

    def test_features_odd_shapes(self):
        """GQA 5:1, head_dim 80, mixed decode/prefill, against the fp64 reference (native kernel and composite)."""
        for i, kw in enumerate(FEATURES):
            with self.subTest(kw=kw):
                q, kc, vc, cu, lens, table = make_case(i)
                self.check(q, kc, vc, cu, lens, table, resolve(kw, 3, 5, i), torch.float32)

    def test_block_size_1_bf16_hnd_and_gqa_7(self):
        for i, kw in enumerate(FEATURES[::2]):
            for block_size, dtype, layout, (h_q, h_kv), d in ((1, torch.float32, "NHD", (7, 1), 16),
                                                                (16, torch.bfloat16, "HND", (4, 2), 32)):
                with self.subTest(kw=kw, block_size=block_size, dtype=dtype, layout=layout):
                    width = 80 // block_size if block_size > 1 else 72
                    q, kc, vc, cu, lens, table = make_case(i, block_size=block_size, h_q=h_q, h_kv=h_kv, d=d,
                                                           dtype=dtype, width=width, layout=layout,
                                                           seq_lens=(70, 40, 53))
                    self.check(q, kc, vc, cu, lens, table, resolve(kw, 3, h_q, i), dtype, layout)

    def test_split_kv_decode_with_sinks_and_rope(self):
        """One long decode: the native kernel splits the KV range across threads; the sink pass runs once."""
        torch.manual_seed(0)
        q, kc, vc, cu, lens, table = make_case(3, batch=1, q_lens=(1,), seq_lens=(1500,), width=100, h_q=2, h_kv=2,
                                               d=32)
        for kw in (dict(sink_tokens=4, window_left=700), dict(rope_theta=1e4, sink_tokens=4, window_left=900,
                                                              alibi_slopes="h")):
            with self.subTest(kw=kw):
                self.check(q, kc, vc, cu, lens, table, resolve(kw, 1, 2), torch.float32)

    def test_flashinfer_rope_llama_decode(self):
        """FlashInfer's batch decode with ``pos_encoding_mode="ROPE_LLAMA"``: un-rotated keys in an HND cache,
        q at position ``kv_len - 1``, key ``j`` at ``j``; the same as rotating q and the keys beforehand and
        attending without RoPE (its test's semantics, with the default ``rope_theta=1e4``, ``rope_scale=1``)."""
        from kvops.cpu.paged_attention import rope_frequencies, rotate_half

        q, kc, vc, cu, lens, table = make_case(5, q_lens=(1, 1, 1), h_q=8, h_kv=2, d=64, layout="HND")
        for theta, scale in ((1e4, 1.0), (5e5, 4.0)):
            freqs = rope_frequencies(64, theta, scale, "cpu")
            k_rot = kc.clone()
            for b in range(3):  # rotate each sequence's keys by their rows, in place of the kernel
                for j in range(int(lens[b])):
                    blk, row = int(table[b, j // 16]), j % 16
                    k_rot[blk, :, row] = rotate_half(kc[blk, :, row], torch.tensor(float(j)), freqs)
            q_rot = torch.stack([rotate_half(q[b], torch.tensor(float(lens[b] - 1)), freqs) for b in range(3)])
            want = kvops.paged_attention(q_rot, k_rot, vc, cu, lens, table, 1, kv_layout="HND")
            out = kvops.paged_attention(q, kc, vc, cu, lens, table, 1, kv_layout="HND", rope_theta=theta,
                                        rope_scale=scale)
            torch.testing.assert_close(out, want, atol=1e-5, rtol=0)

    def test_compiled_features_match_eager(self):
        q, kc, vc, cu, lens, table = make_case(1, h_q=4, h_kv=2, d=32)
        slopes = torch.rand(4)
        pad = torch.tensor([1, 2, 0], dtype=torch.int32)

        def f(q, kc, vc, cu, lens, table, slopes, pad):
            return kvops.paged_attention(q, kc, vc, cu, lens, table, 7, window_left=20, alibi_slopes=slopes,
                                         cache_leftpad=pad, sink_tokens=4, rope_theta=1e4)

        torch._dynamo.reset()
        args = (q, kc, vc, cu, lens, table, slopes, pad)
        torch.testing.assert_close(torch.compile(f, fullgraph=True)(*args), f(*args), atol=1e-5, rtol=0)


@triton.jit
def _sincos_kernel(x_ptr, sin_ptr, cos_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    sin, cos = _sincos(tl.load(x_ptr + offs))
    tl.store(sin_ptr + offs, sin)
    tl.store(cos_ptr + offs, cos)


@triton.jit
def _fma_kernel(a_ptr, out_ptr):
    a = tl.load(a_ptr)
    tl.store(out_ptr, tl.fma(a, a, -(a * a)))


def fma_is_fused(dev) -> bool:
    """Whether ``tl.fma`` rounds once here: a*a - fl(a*a) is the rounding error of a*a (2**-24 for a = 1 + 2**-12),
    which only a fused multiply-add sees. GPUs fuse; Triton 3.8's interpreter (torch 2.14.1's pin) computes
    ``x * y + z`` in fp32 and rounds twice (fixed in Triton 3.9's interpreter)."""
    out = torch.zeros(1, device=dev)
    _fma_kernel[(1,)](torch.tensor([1 + 2 ** -12], device=dev), out)
    return out.item() != 0.0


@unittest.skipUnless(os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available(),
                     "the Triton kernels run on CPU only in the interpreter (tests/conftest.py sets it)")
class TestTritonFeatures(unittest.TestCase):
    def test_decode_and_prefill(self):
        from kvops.triton.paged_attention import paged_attention as triton_attention

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        for q_lens in ((1, 1), (1, 4)):
            q, kc, vc, cu, lens, table = make_case(7, batch=2, block_size=8, h_q=3, h_kv=1, d=16, q_lens=q_lens,
                                                   seq_lens=(37, 20), width=5)
            for i, kw in enumerate(FEATURES if q_lens == (1, 1) else FEATURES[1::2]):  # (interpreter time)
                with self.subTest(q_lens=q_lens, kw=kw):
                    kw = resolve(kw, 2, 3, i)
                    if "cache_leftpad" in kw:
                        kw["cache_leftpad"] = kw["cache_leftpad"][:2]
                    want, want_lse = reference(q, kc, vc, cu, lens, table, **kw)
                    fixed, feats = split_kernel_args(kw)
                    feats = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in feats.items()}
                    out, lse = triton_attention(
                        *(t.to(dev) for t in (q, kc, vc, cu, lens, table)), max(q_lens), 16 ** -0.5,
                        fixed["causal"], fixed["window_left"], fixed["softcap"], None, None, None, AttnFeatures(**feats),
                        block_n=16)
                    torch.testing.assert_close(out.cpu().double(), want, atol=2e-5, rtol=0)
                    torch.testing.assert_close(lse.cpu().double(), want_lse, atol=1e-4, rtol=0)

    def test_rope_sin_cos_match_fp64_at_long_context_angles(self):
        """The kernels' RoPE sin/cos (FMA range reduction + polynomials, no libdevice) against fp64, for the fp32
        angles of positions up to 140K (theta 1e4: the first pair turns by the position itself)."""
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        g = torch.Generator().manual_seed(0)
        x = torch.cat([torch.linspace(-7, 7, 1024), torch.rand(3072, generator=g) * 140000]).to(dev)
        sin, cos = torch.empty_like(x), torch.empty_like(x)
        _sincos_kernel[(x.numel() // 1024,)](x, sin, cos, BLOCK=1024)
        # The range reduction is exact only with a fused tl.fma. Where it is not (Triton 3.8's interpreter), the
        # polynomials are still checked on [-7, 7], whose reduction is exact anyway (j <= 5), and the long angles
        # to the error of an unfused reduction (j * 1.5703125 rounded: up to ~1e-2 at 140K).
        fused = fma_is_fused(dev)
        for got, want in ((sin, x.double().sin()), (cos, x.double().cos())):
            torch.testing.assert_close(got[:1024].cpu().double(), want[:1024].cpu(), atol=3e-7, rtol=0)
            torch.testing.assert_close(got.cpu().double(), want.cpu(), atol=3e-7 if fused else 2e-2, rtol=0)
        self.assertTrue(fused or tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 9), f"tl.fma is not fused in Triton {triton.__version__}")

    def test_evicted_blocks_are_never_read(self):
        """-1 table entries between the sinks and the window (a StreamingLLM paged cache), decode and prefill."""
        from kvops.triton.paged_attention import paged_attention as triton_attention

        q, kc, vc, cu, lens, table = make_case(8, batch=1, block_size=8, h_q=2, h_kv=1, d=16, q_lens=(2,),
                                               seq_lens=(60,), width=8)
        table[0, 1:5] = -1  # rows [8, 40) evicted; sinks 0..3, window of the first query (pos 58): [40, 60)
        kw = dict(sink_tokens=4, window_left=18, rope_theta=1e4)
        want, _ = reference(q, kc, vc, cu, lens, table, **kw)
        for qq, cu_, m in ((q, cu, 2), (q[1:], torch.tensor([0, 1], dtype=torch.int32), 1)):
            out, _ = triton_attention(qq, kc, vc, cu_, lens, table, m, 16 ** -0.5, True, 18, 0.0, None, None, None,
                                      AttnFeatures(sink_tokens=4, rope_theta=1e4), block_n=16)
            torch.testing.assert_close(out.double(), want[-qq.shape[0]:], atol=2e-5, rtol=0)


class TestFeatureContracts(expecttest.TestCase):
    def setUp(self):
        self.q, self.kc, self.vc, self.cu, self.lens, self.table = make_case(0, h_q=4, h_kv=2, d=16)

    def attn(self, **kw):
        return lambda q, kc, vc, cu, lens, table: kvops.paged_attention(q, kc, vc, cu, lens, table, 7, **kw)

    def raises(self, exc=ValueError, **kw):
        return raises_everywhere(self, exc, self.attn(**kw), (self.q, self.kc, self.vc, self.cu, self.lens,
                                                              self.table))

    def test_argument_errors(self):
        self.assertExpectedInline(
            self.raises(alibi_slopes=torch.ones(3)),
            """kvops.paged_attention: alibi_slopes must be a float32 tensor of shape [4] or [3, 4] (one slope per query head, optionally per sequence), got shape (3,) and dtype torch.float32.""",
        )
        self.assertExpectedInline(
            self.raises(alibi_slopes=torch.ones(4, dtype=torch.float64)),
            """kvops.paged_attention: alibi_slopes must be a float32 tensor of shape [4] or [3, 4] (one slope per query head, optionally per sequence), got shape (4,) and dtype torch.float64.""",
        )
        self.assertExpectedInline(self.raises(causal=False, window_right=-2),
                                  """kvops.paged_attention: window_right must be -1 (no right bound) or >= 0, got -2.""")
        self.assertExpectedInline(
            self.raises(cache_leftpad=torch.zeros(3, dtype=torch.int64)),
            """kvops.paged_attention: cache_leftpad must be an int32 tensor of shape [3] (the first KV row of each sequence), got shape (3,) and dtype torch.int64. Pass cache_leftpad.to(torch.int32).""",
        )
        self.assertExpectedInline(self.raises(window_left=4, sink_tokens=-1),
                                  """kvops.paged_attention: sink_tokens must be >= 0 (0: none), got -1.""")
        self.assertExpectedInline(
            self.raises(rope_theta=0.0),
            """kvops.paged_attention: RoPE at read time needs rope_theta > 0 and rope_scale > 0, got rope_theta=0.0 and rope_scale=1.0 (FlashInfer's defaults: 1e4 and 1).""",
        )

    def test_rope_needs_even_head_dim(self):
        q, kc, vc, cu, lens, table = make_case(0, h_q=2, h_kv=1, d=15)
        msg = raises_everywhere(self, ValueError, self.attn(rope_theta=1e4), (q, kc, vc, cu, lens, table))
        self.assertExpectedInline(
            msg,
            """kvops.paged_attention: RoPE at read time rotates pairs (j, j + head_dim / 2) and needs an even head_dim, got 15.""",
        )

    def test_value_contracts(self):
        """-1 in a block no query sees passes; -1 in a block a query reads, or a negative cache_leftpad, raises."""
        table = self.table.clone()
        table[0, 1] = -1  # sequence 0 (seq_len 70, one query at 69): window [59, 70) and sinks [0, 4)
        out = kvops.paged_attention(self.q, self.kc, self.vc, self.cu, self.lens, table, 7, window_left=10,
                                    sink_tokens=4)
        want, _ = reference(self.q, self.kc, self.vc, self.cu, self.lens, table, window_left=10, sink_tokens=4)
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=0)
        with self.assertRaises(RuntimeError) as cm:
            kvops.paged_attention(self.q, self.kc, self.vc, self.cu, self.lens, table, 7, window_left=60)
        self.assertExpectedInline(
            str(cm.exception),
            """kvops.paged_attention: block_table[0, 1] = -1 is not a block of the cache: block ids must be in [0, 20) (P = 20 blocks). Sequence 0 reads rows [0, 0) and [9, 70); entries of blocks outside them are never read and may hold any value (e.g. -1).""",
        )
        with self.assertRaises(RuntimeError) as cm:
            kvops.paged_attention(self.q, self.kc, self.vc, self.cu, self.lens, self.table, 7,
                                  cache_leftpad=torch.tensor([0, -1, 0], dtype=torch.int32))
        self.assertExpectedInline(
            str(cm.exception),
            """kvops.paged_attention: cache_leftpad[1] = -1 is negative; it is the first KV row of sequence 1 (0: no left padding).""",
        )
        with kvops.value_checks("off"), self.assertRaises(RuntimeError) as cm:  # the native kernel's own check
            kvops.paged_attention(self.q, self.kc, self.vc, self.cu, self.lens, table, 7, window_left=60)
        self.assertIn("block_table[0, 1] = -1 is not a block of the cache", str(cm.exception))

    def test_flash_attn_feature_errors(self):
        f = kvops.flash_attn_with_kvcache
        q, kc = torch.randn(2, 1, 4, 16), torch.randn(2, 8, 2, 16)
        msg = raises_everywhere(self, ValueError, lambda q, kc, a: f(q, kc, kc, cache_seqlens=1, alibi_slopes=a),
                                (q, kc, torch.ones(2, 3)), compile_exc=PY_ERROR)
        self.assertExpectedInline(
            msg,
            """flash_attn_with_kvcache: alibi_slopes must be float32 of shape [4] or [2, 4] (nheads or (batch_size, nheads)), got shape (2, 3) and dtype torch.float32.""",
        )
        msg = raises_everywhere(self, ValueError, lambda q, kc, c: f(q, kc, kc, cache_seqlens=1, cache_leftpad=c),
                                (q, kc, torch.zeros(3, dtype=torch.int32)), compile_exc=PY_ERROR)
        self.assertExpectedInline(
            msg,
            """flash_attn_with_kvcache: cache_leftpad must be an int32 tensor of shape [2] (the row each sequence's cache starts at), got shape (3,) and dtype torch.int32. Pass cache_leftpad with the shape [2] (one row per sequence).""",
        )
        msg = raises_everywhere(self, ValueError, lambda q, kc: f(q, kc, kc, cache_seqlens=1, window_size=(2, -3)),
                                (q, kc), compile_exc=PY_ERROR)
        self.assertExpectedInline(
            msg,
            """flash_attn_with_kvcache: window_size=(2, -3): each bound must be -1 (unbounded) or >= 0 (FlashAttention's (left, right) local window).""",
        )
        table = torch.arange(2, dtype=torch.int32).view(2, 1)
        msg = raises_everywhere(self, ValueError,
                                lambda q, kc, i, t: f(q, kc, kc, cache_seqlens=1, cache_batch_idx=i, block_table=t),
                                (q, kc, torch.zeros(2, dtype=torch.int32), table), compile_exc=PY_ERROR)
        self.assertExpectedInline(
            msg,
            """flash_attn_with_kvcache: cache_batch_idx cannot be combined with block_table (FlashAttention: "Paged KVcache does not support cache_batch_idx"). Select the sequences' block_table rows instead: block_table[cache_batch_idx.long()].""",
        )

if __name__ == "__main__":
    unittest.main()


class TestFeatureRecord(unittest.TestCase):
    """The features travel as one record (``AttnFeatures``, kvops/_checks/features.py) whose fields are the last
    arguments of both op schemas, in order; the triton_op's inferred schema is the string kept in kvops/_library.py."""

    def test_public_schema_is_the_library_string(self):
        from kvops import _library

        self.assertEqual(str(torch.ops.kvops.paged_attention.default._schema),
                         "kvops::paged_attention" + _library.PAGED_ATTENTION)

    def test_schemas_end_with_the_record_fields(self):
        n = len(AttnFeatures._fields)
        for op in (torch.ops.kvops.paged_attention.default, torch.ops.kvops._paged_attention_native.default):
            with self.subTest(op=str(op)):
                names = [a.name for a in op._schema.arguments][-n:]
                self.assertEqual(tuple(names), AttnFeatures._fields)
                defaults = tuple(a.default_value for a in op._schema.arguments[-n:])
                self.assertEqual(defaults, tuple(AttnFeatures()))

    def test_validator_resolves_unbounded_values(self):
        import sys

        from kvops._checks.paged_attention import check_paged_attention

        q, kc = torch.zeros(2, 4, 8), torch.zeros(2, 4, 2, 8)
        cu, lens, table = (torch.tensor([0, 2], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
                           torch.tensor([[0, 1]], dtype=torch.int32))
        scale, left, feats = check_paged_attention(q, kc, kc, cu, lens, table, 2, None, False, sys.maxsize, 0.0, None,
                                                   None, None, "NHD", AttnFeatures(window_right=sys.maxsize,
                                                                                  sink_tokens=3))
        # an unbounded window keeps every key: no window, so no sinks either (docs/attention_features.md)
        self.assertEqual((scale, left, feats), (8 ** -0.5, -1, AttnFeatures()))
        self.assertEqual((feats.used(), AttnFeatures(sink_tokens=3).used()), (False, True))
