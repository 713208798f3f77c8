"""Shared builders of MLA test inputs: paged latent caches, varlen batches (decode and chunked prefill) and their
block tables, written through the write op so that attention tests read what the write stores."""

from __future__ import annotations

import math

import torch

FP8 = torch.float8_e4m3fn


def tables(seqlen_ro: int, rotary_dim: int, dtype=torch.float32, base: float = 10000.0):
    """RoPE cos/sin tables ``[seqlen_ro, rotary_dim / 2]``."""
    inv = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = torch.arange(seqlen_ro, dtype=torch.float64)[:, None] * inv
    return ang.cos().to(dtype), ang.sin().to(dtype)


def batch(seq_lens, q_lens, block_size: int, num_blocks: int | None = None, seed: int = 0):
    """``(cu_seqlens_q, seq_lens, block_table, num_blocks)`` int32, each sequence's blocks a random permutation of
    distinct ids; table padding is -1 (never read)."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(s / block_size) for s in seq_lens]
    total = num_blocks or sum(need) + 3
    perm = torch.randperm(total, generator=g)
    width = max(need + [1])
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    at = 0
    for b, k in enumerate(need):
        table[b, :k] = perm[at : at + k].to(torch.int32)
        at += k
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    return cu, torch.tensor(seq_lens, dtype=torch.int32), table, total


def slots_of(block_table, seq_lens, block_size: int) -> torch.Tensor:
    """int64 slots of every sequence's rows ``[0, seq_len)``, sequence after sequence."""
    out = []
    for b, s in enumerate(seq_lens.tolist()):
        j = torch.arange(s)
        out.append(block_table[b].to(torch.int64)[j // block_size] * block_size + j % block_size)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def filled_cache(seq_lens, q_lens, block_size, rank, rope, dtype, *, seed=0, kv_scale=None, garbage=float("nan")):
    """A latent cache holding every sequence's rows (written by ``kvops.mla_cache_write``), unused slots ``garbage``
    (NaN by default: they must never reach the output). Returns ``(kv_cache, cu, seq_lens, block_table)``."""
    import kvops

    cu, lens, table, total = batch(seq_lens, q_lens, block_size, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    cache_dtype = FP8 if kv_scale is not None else dtype
    src_dtype = torch.float32 if dtype == FP8 else dtype
    kv_cache = torch.full((total, block_size, rank + rope), garbage, dtype=torch.float32).to(cache_dtype)
    slots = slots_of(table, lens, block_size)
    n = slots.shape[0]
    kv_c = torch.randn(n, rank, generator=g).to(src_dtype)
    k_pe = torch.randn(n, rope, generator=g).to(src_dtype)
    kvops.mla_cache_write(kv_c, k_pe, kv_cache, slots, kv_scale=kv_scale)
    return kv_cache, cu, lens, table
