"""vLLM's cache-write and unified-attention test grids through kvops' API, against kvops' oracle.

Written from vLLM's public tests:

- ``tests/kernels/attention/test_cache.py::test_reshape_and_cache_flash``: 21 tokens (its 42 halved, as it does),
  8 heads, head sizes 64/80/256, block sizes 8/16/32, 512 or 5000 blocks (its 1024/10000 halved), bf16/fp32, an
  ``auto`` or fp8 cache with a per-tensor scale given as a **0-d tensor** (``(key.amax() / 64.0).to(float32)``) or a
  per-head ``[H]`` scale, NHD or HND caches as views of one ``[P, 2, ...]`` allocation, ``key``/``value`` as strided
  ``unbind`` views of a ``[N, 3, H, D]`` qkv tensor, distinct random slots: through ``kvops.paged_cache_write``,
  bit for bit against a per-token write (fp8: ``x / scale`` saturated to ±448, round to nearest even). vLLM always
  passes scales (ignored for ``auto``); kvops refuses scales with a non-fp8 cache, so ``auto`` cases pass none.
  (Its legacy ``reshape_and_cache`` key layout ``[P, H, D / x, block_size, x]`` is not a strided 4-D view, so no
  kvops op addresses it; its flash layout is the one here.)
- ``tests/kernels/attention/test_triton_unified_attention.py``: ``seq_lens`` ``[(1, 1328), (5, 18), (129, 463)]``
  and ``[(1, 523), (1, 37), (1, 2011)]``, heads (4, 4)/(8, 2)/(5, 1), head size 128/256, block size 16, sliding
  window None/64/128/256 (``window_size = (W - 1, 0)``), soft cap None/50, 32768 or 2048 blocks, random block tables
  (ids may repeat), bf16; and its bf16-query/fp8-KV test (scales 0.5/0.25): through ``kvops.paged_attention``. (vLLM
  also quantizes the queries to fp8 with ``q_descale``; kvops' queries are fp32/bf16/fp16.) Caches of 32768 blocks are
  allocated with ``torch.empty`` and only the blocks in use are filled.

A seeded sample of each grid runs, within a memory budget per case.
"""

from __future__ import annotations

import random
import unittest

import torch

import kvops
from kvops._checks.common import FP8_MAX
from tests.compat._oracle import attend, sample

FP8 = torch.float8_e4m3fn

WRITE_GRID = dict(
    head_size=[64, 80, 256], block_size=[8, 16, 32], num_blocks=[512, 5000], dtype=[torch.bfloat16, torch.float32],
    kv_cache_dtype=["auto", "fp8"], layout=["NHD", "HND"], kv_scale_type=["tensor", "attn_head"],
)
NUM_TOKENS, NUM_HEADS = 21, 8


def write_fits(c) -> bool:
    itemsize = 1 if c["kv_cache_dtype"] == "fp8" else c["dtype"].itemsize
    return c["num_blocks"] * c["block_size"] * NUM_HEADS * c["head_size"] * 2 * itemsize <= 96 * 2 ** 20


def quantize(x, scale):
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


class TestReshapeAndCacheFlash(unittest.TestCase):
    def test_sampled_grid(self):
        cases = sample(WRITE_GRID, 24, seed=31, keep=write_fits)
        assert any(c["num_blocks"] == 5000 for c in cases) and any(c["kv_cache_dtype"] == "fp8" for c in cases)
        for i, c in enumerate(cases):
            with self.subTest(case=c):
                self.check(c, i)

    def check(self, c, seed):
        g = torch.Generator().manual_seed(seed)
        h, d, bs, p = NUM_HEADS, c["head_size"], c["block_size"], c["num_blocks"]
        fp8 = c["kv_cache_dtype"] == "fp8"
        slots = torch.tensor(random.Random(seed).sample(range(p * bs), NUM_TOKENS), dtype=torch.long)
        qkv = torch.randn(NUM_TOKENS, 3, h, d, generator=g).to(c["dtype"])
        _, key, value = qkv.unbind(dim=1)  # strided views, as vLLM's test
        inner = (bs, h, d) if c["layout"] == "NHD" else (h, bs, d)
        kv = torch.randn(p, 2, *inner, generator=g).to(FP8 if fp8 else c["dtype"])
        k_cache, v_cache = kv[:, 0], kv[:, 1]
        k_scale = v_scale = None
        if fp8 and c["kv_scale_type"] == "tensor":
            k_scale, v_scale = (key.amax() / 64.0).to(torch.float32), (value.amax() / 64.0).to(torch.float32)
        elif fp8:
            k_scale = (key.amax(dim=(0, 2)) / 64.0).to(torch.float32)
            v_scale = (value.amax(dim=(0, 2)) / 64.0).to(torch.float32)
        want = kv.clone()
        for i, slot in enumerate(slots.tolist()):
            blk, row = divmod(slot, bs)
            for which, (x, scale) in enumerate(((key, k_scale), (value, v_scale))):
                xi = x[i] if scale is None else quantize(x[i], scale.reshape(-1, 1))
                if c["layout"] == "NHD":
                    want[blk, which, row] = xi
                else:
                    want[blk, which, :, row] = xi
        kvops.paged_cache_write(key, value, k_cache, v_cache, slots, None, k_scale, v_scale, kv_layout=c["layout"])
        as_bits = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)
        self.assertTrue(torch.equal(as_bits(kv), as_bits(want)))


ATTN_GRID = dict(
    seq_lens=[((1, 1328), (5, 18), (129, 463)), ((1, 523), (1, 37), (1, 2011))],
    num_heads=[(4, 4), (8, 2), (5, 1)], head_size=[128, 256], sliding_window=[None, 64, 128, 256],
    soft_cap=[None, 50.0], num_blocks=[32768, 2048], kv=["bf16", "fp8"],
)


def unified_case(c, seed):
    """vLLM's setup: random queries, a cache whose used blocks are random (others never filled), block tables drawn
    with repeats, kv lengths as given; fp8 KV quantized with scales 0.5 / 0.25 (its bf16-query/fp8-KV test)."""
    g = torch.Generator().manual_seed(seed)
    q_lens, kv_lens = [x[0] for x in c["seq_lens"]], [x[1] for x in c["seq_lens"]]
    h_q, h_kv = c["num_heads"]
    d, bs, p = c["head_size"], 16, c["num_blocks"]
    query = torch.randn(sum(q_lens), h_q, d, generator=g).to(torch.bfloat16)
    width = (max(kv_lens) + bs - 1) // bs
    table = torch.randint(0, p, (len(kv_lens), width), generator=g, dtype=torch.int32)
    used = table.unique().long()
    k_cache = torch.empty(p, bs, h_kv, d, dtype=torch.bfloat16)  # untouched pages cost no memory
    v_cache = torch.empty(p, bs, h_kv, d, dtype=torch.bfloat16)
    k_cache[used] = torch.randn(len(used), bs, h_kv, d, generator=g).to(torch.bfloat16)
    v_cache[used] = torch.randn(len(used), bs, h_kv, d, generator=g).to(torch.bfloat16)
    scales = None
    if c["kv"] == "fp8":
        k8, v8 = torch.empty(p, bs, h_kv, d, dtype=FP8), torch.empty(p, bs, h_kv, d, dtype=FP8)
        k8[used], v8[used] = (k_cache[used] / 0.5).to(FP8), (v_cache[used] / 0.25).to(FP8)
        k_cache, v_cache = k8, v8
        scales = (torch.full((h_kv,), 0.5), torch.full((h_kv,), 0.25))  # vLLM's [num_seqs, H_kv] descale, per head
    return query, k_cache, v_cache, q_lens, kv_lens, table, scales


class TestUnifiedAttention(unittest.TestCase):
    def test_sampled_grid(self):
        keep = lambda c: c["kv"] == "bf16" or (c["sliding_window"] is None and c["soft_cap"] is None)  # noqa: E731
        cases = sample(ATTN_GRID, 12, seed=32, keep=keep)
        assert any(c["num_blocks"] == 32768 for c in cases) and any(c["kv"] == "fp8" for c in cases)
        for i, c in enumerate(cases):
            with self.subTest(case=c):
                query, k_cache, v_cache, q_lens, kv_lens, table, scales = unified_case(c, i)
                d, sw = c["head_size"], c["sliding_window"]
                cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
                out = kvops.paged_attention(
                    query, k_cache, v_cache, cu, torch.tensor(kv_lens, dtype=torch.int32), table, max(q_lens),
                    scale=d ** -0.5, causal=True, window_left=-1 if sw is None else sw - 1,
                    softcap=c["soft_cap"] or 0.0, k_scale=None if scales is None else scales[0],
                    v_scale=None if scales is None else scales[1])
                tol = 1.5e-2 if scales is None else 1.5e-1  # vLLM's tolerances
                for b, (n_q, n_kv) in enumerate(zip(q_lens, kv_lens)):
                    rows = table[b].long()
                    k = k_cache[rows].flatten(0, 1)[None, :n_kv]
                    v = v_cache[rows].flatten(0, 1)[None, :n_kv]
                    q = query[cu[b]:cu[b + 1]][None]
                    ref, _ = attend(q, k, v, [n_kv], scale=d ** -0.5, causal=True,
                                    window=(-1 if sw is None else sw - 1, -1), softcap=c["soft_cap"] or 0.0,
                                    k_scale=None if scales is None else scales[0],
                                    v_scale=None if scales is None else scales[1])
                    torch.testing.assert_close(out[cu[b]:cu[b + 1]].double(), ref[0], atol=tol, rtol=tol)


if __name__ == "__main__":
    unittest.main()
