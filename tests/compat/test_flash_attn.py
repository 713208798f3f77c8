"""FlashAttention's ``flash_attn_with_kvcache`` grid through ``kvops.flash_attn_with_kvcache``, against kvops' oracle.

Written from FlashAttention's public test ``tests/test_flash_attn.py::test_flash_attn_kvcache`` (its parameter grid,
its skips and the way it builds each argument, e.g. ``window_size = torch.randint(0, seqlen_k, (2,))``, a tensor) and
``test_flash_attn_kvcache_paged_block_table_bounds``. A seeded sample of the grid runs here (fp16 on the CPU), with
two changes: ``seqlen_k`` above 2048 (FlashAttention's 20000 and 128K) is shrunk to keep CPU memory and time small,
and ``has_batch_idx`` also takes True (FlashAttention's grid pins it to False; its function and its test body
support it). The expected caches are written by hand (v bit for bit; k after RoPE to fp16 rounding), the output is
kvops' dense fp64 oracle (tests/compat/_oracle.py).
"""

from __future__ import annotations

import math
import unittest

import torch

import kvops
from tests.compat._oracle import attend, rotate, sample

GRID = dict(
    seqlens=[(1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799), (64, 2048), (16, 20000), (1, 128 * 1024),
             (16, 128 * 1024), (128, 128)],
    d=[32, 59, 64, 80, 128, 256],
    has_batch_idx=[False, True],
    has_leftpad=[False, True],
    paged_kv_block_size=[None, 256],
    rotary_fraction=[0.0, 0.5, 1.0],
    rotary_interleaved=[False, True],
    seqlen_new_eq_seqlen_q=[True, False],
    causal=[False, True],
    local=[False, True],
    alibi=[False, True],
    new_kv=[False, True],
    mha_type=["mha", "mqa", "gqa"],
    num_splits=[1, 0],
)
SHRUNK = {20000: 2500, 128 * 1024: 3001}  # CPU memory and time; odd lengths, as FlashAttention's


def flash_attn_skips(c) -> bool:
    """FlashAttention's own skips (``pytest.skip()`` in its test)."""
    q, k = c["seqlens"]
    return not ((q > k and c["new_kv"]) or (not c["new_kv"] and c["rotary_fraction"] > 0)
                or (c["has_batch_idx"] and c["paged_kv_block_size"] is not None)
                or (c["has_leftpad"] and c["paged_kv_block_size"] is not None))


def run_case(c, seed):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float16
    seqlen_q, seqlen_k = c["seqlens"]
    seqlen_k = SHRUNK.get(seqlen_k, seqlen_k)
    d, new_kv, causal, local = c["d"], c["new_kv"], c["causal"], c["local"]
    batch = 2
    batch_cache = batch * 2 if c["has_batch_idx"] else batch
    nheads = 6
    nheads_k = {"mha": 6, "mqa": 1, "gqa": 3}[c["mha_type"]]
    rotary_dim = math.floor(int(c["rotary_fraction"] * d) / 16) * 16
    window_size = (-1, -1) if not local else torch.randint(0, seqlen_k, (2,), generator=g)  # a tensor, as FA's
    q = torch.randn(batch, seqlen_q, nheads, d, generator=g).to(dtype)
    seqlen_new = seqlen_q if c["seqlen_new_eq_seqlen_q"] else int(torch.randint(1, seqlen_q + 1, (1,), generator=g))
    k = v = None
    if new_kv:
        k = torch.randn(batch, seqlen_new, nheads_k, d, generator=g).to(dtype)
        v = torch.randn(batch, seqlen_new, nheads_k, d, generator=g).to(dtype)
    block_size = c["paged_kv_block_size"]
    if block_size is None:
        k_cache = torch.randn(batch_cache, seqlen_k, nheads_k, d, generator=g).to(dtype)
        v_cache = torch.randn(batch_cache, seqlen_k, nheads_k, d, generator=g).to(dtype)
        block_table, num_blocks = None, None
    else:
        num_blocks = math.ceil(seqlen_k / block_size) * batch * 3
        k_cache = torch.randn(num_blocks, block_size, nheads_k, d, generator=g).to(dtype)
        v_cache = torch.randn(num_blocks, block_size, nheads_k, d, generator=g).to(dtype)
        block_table = torch.randperm(num_blocks, generator=g).to(torch.int32).view(batch, -1)
    high = (seqlen_k - (seqlen_q if (causal or local) and rotary_dim > 1 else seqlen_new) + 1) if new_kv \
        else seqlen_k + 1
    cache_seqlens = torch.randint(0 if new_kv else 1, high, (batch,), generator=g, dtype=torch.int32)
    cache_leftpad = None
    if c["has_leftpad"]:
        cache_leftpad = torch.tensor([int(torch.randint(0, int(n), (1,), generator=g)) if n > 0 else 0
                                      for n in cache_seqlens], dtype=torch.int32)
    cache_batch_idx = None
    if c["has_batch_idx"]:
        cache_batch_idx = torch.randperm(batch_cache, generator=g).to(torch.int32)[:batch]
    alibi_slopes = torch.rand(batch, nheads, generator=g) * 0.3 if c["alibi"] else None
    cos = sin = None
    if rotary_dim > 0:
        angle = torch.rand(seqlen_k if block_size is None else num_blocks * block_size, rotary_dim // 2,
                           generator=g) * 2 * math.pi
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)

    # the logical caches [B, rows, H_kv, D] each sequence sees, before and as expected after the append
    def logical(cache):
        if block_size is not None:
            return cache[block_table.long()].flatten(1, 2)
        return cache if cache_batch_idx is None else cache[cache_batch_idx.long()]

    want_k, want_v = logical(k_cache).clone(), logical(v_cache).clone()
    base = cache_seqlens.long()
    if new_kv:
        pos = base[:, None] + torch.arange(seqlen_new)[None, :]
        k_ro = k if cos is None else rotate(k, cos, sin, pos, c["rotary_interleaved"]).to(dtype)
        for b in range(batch):
            want_k[b, pos[b]] = k_ro[b]
            want_v[b, pos[b]] = v[b]
    q_ro = q.double()
    if cos is not None:
        q_pos = base[:, None] + (torch.arange(seqlen_q)[None, :] if causal or local else 0)
        q_ro = rotate(q, cos, sin, q_pos.expand(batch, seqlen_q), c["rotary_interleaved"])

    out = kvops.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table, causal=causal,
        window_size=window_size, rotary_interleaved=c["rotary_interleaved"], alibi_slopes=alibi_slopes,
        num_splits=c["num_splits"])
    window = tuple(int(w) for w in window_size)
    ref, _ = attend(q_ro, want_k, want_v, base + (seqlen_new if new_kv else 0), causal=causal, window=window,
                    alibi=alibi_slopes, leftpad=cache_leftpad)
    return out, ref, (logical(k_cache), want_k), (logical(v_cache), want_v), cos is not None


class TestFlashAttnKVCacheGrid(unittest.TestCase):
    def test_sampled_grid(self):
        cases = sample(GRID, 32, seed=30, keep=flash_attn_skips)
        assert any(c["local"] for c in cases) and any(c["has_batch_idx"] for c in cases)
        for i, c in enumerate(cases):
            with self.subTest(case=c):
                out, ref, (k_got, k_want), (v_got, v_want), rotary = run_case(c, seed=i)
                self.assertEqual(out.dtype, torch.float16)
                torch.testing.assert_close(out.double(), ref, atol=4e-3, rtol=4e-3)
                self.assertTrue(torch.equal(v_got, v_want))
                if rotary:  # RoPE in fp32 vs fp64, both rounded to fp16: FlashAttention's test allows 1e-3
                    torch.testing.assert_close(k_got, k_want, atol=1e-3, rtol=1e-3)
                else:
                    self.assertTrue(torch.equal(k_got, k_want))

    def test_paged_block_table_bounds(self):
        """FlashAttention's ``test_flash_attn_kvcache_paged_block_table_bounds``: a length past what the block table
        addresses raises ``RuntimeError`` matching "block_table" (appending or not); exactly at capacity is fine."""
        page, d = 256, 64
        k_cache, v_cache = torch.randn(4, page, 1, d).half(), torch.randn(4, page, 1, d).half()
        table = torch.zeros(1, 1, dtype=torch.int32)
        q = torch.randn(1, 1, 1, d).half()
        k_new = torch.randn(1, 1, 1, d).half()
        for k, lens in ((k_new, page), (None, page + 1)):
            with self.assertRaisesRegex(RuntimeError, "block_table"):
                kvops.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=k, block_table=table, causal=False,
                                              cache_seqlens=torch.full((1,), lens, dtype=torch.int32))
        out = kvops.flash_attn_with_kvcache(q, k_cache, v_cache, block_table=table, causal=False,
                                            cache_seqlens=torch.full((1,), page, dtype=torch.int32))
        self.assertEqual(tuple(out.shape), (1, 1, 1, d))
        self.assertFalse(out.isnan().any())


if __name__ == "__main__":
    unittest.main()
